"""Packed blocks (``online.packed``): a block gives back exactly the members it replaced."""

from __future__ import annotations

import math
import struct

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore.online import packed
from featurestore.online.codec import encode_events
from featurestore.types import from_name

TILE = 3_600_000_000
NAMES = ["Int32", "Int64", "Float32", "Float64", "Bool", "UnixTimestamp", "String", "Bytes", "Array(Float64)"]
US = pa.timestamp("us", tz="UTC")
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 12.34, -0.1]
NAN_PAYLOAD = struct.unpack(">d", bytes.fromhex("7ff8000000000bad"))[0]


def _members(events, floats_kind: str, ids_from_column: bool) -> tuple[list[bytes], list]:
    features = [(f"c{k}", from_name(n)) for k, n in enumerate(NAMES)]
    n = len(events)
    cents = [None if e[3] is None else round(e[3] % 1000, 2) for e in events]
    floats = {
        "any": [e[3] for e in events],
        "decimal": cents,
        "steady": [None if e[3] is None else 20.5 + (i % 3) for i, e in enumerate(events)],
    }[floats_kind]
    table = pa.table(
        {
            "event_timestamp": pa.array([e[0] for e in events], pa.int64()).cast(US),
            "created_timestamp": pa.array([0] * n, pa.int64()).cast(US),
            "_run_id": pa.array([1] * n, pa.int64()),
            "_row_id": pa.array(range(n), pa.int64()),
            "c0": pa.array([e[2] for e in events], pa.int32()),
            "c1": pa.array([e[1] if ids_from_column else e[2] for e in events], pa.int64()),
            "c2": pa.array([e[3] for e in events], pa.float32()),
            "c3": pa.array(floats, pa.float64()),
            "c4": pa.array([e[4] for e in events], pa.bool_()),
            "c5": pa.array([e[0] if e[4] else None for e in events], pa.int64()).cast(US),
            "c6": pa.array([None if e[2] is None else str(e[2] % 7) for e in events], pa.string()),
            "c7": pa.array(
                [None if e[4] is None else bytes([e[0] % 256]) * ((e[2] or 0) % 5) for e in events], pa.binary()
            ),
            "c8": pa.array([None if e[3] is None else [e[3], 1.0] for e in events], pa.list_(pa.float64())),
        }
    )
    members = encode_events(table, features, np.array([e[1] for e in events], dtype=np.int64)).to_pylist()
    return sorted(members, key=lambda m: (m[8:16], m[:8])), features


block_events = st.lists(
    st.tuples(
        st.integers(0, packed.BLOCK_TILES * TILE - 1),  # µs inside block 0 (shifted below)
        st.integers(-(2**63), 2**63 - 1),  # event id
        st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
        st.one_of(st.none(), st.sampled_from(SPECIAL + [NAN_PAYLOAD]), st.floats(allow_nan=True, width=64)),
        st.one_of(st.none(), st.booleans()),
    ),
    min_size=1,
    max_size=60,
    unique_by=lambda e: e[1],
)


@settings(max_examples=150, deadline=None)
@given(
    events=block_events,
    block=st.integers(-3, 10**6),
    floats_kind=st.sampled_from(["any", "decimal", "steady"]),
    ids_from_column=st.booleans(),
)
def test_a_block_gives_back_its_members_byte_for_byte(events, block, floats_kind, ids_from_column):
    """Every column type, nulls, NaN payloads, ±inf, -0.0, subnormals, equal times, any ids:
    ``unpack(pack(members)) == members``, and the header counts each tile's events."""
    start = block * packed.BLOCK_TILES * TILE
    events = [(start + e[0], *e[1:]) for e in events]
    members, features = _members(events, floats_kind, ids_from_column)
    blob = packed.pack(members, features, TILE)
    assert packed.is_block(blob) and not any(packed.is_block(m) for m in members)
    assert packed.unpack(blob, features) == members
    number, counts = packed.header(blob)
    assert number == block
    assert counts == [sum(1 for e in events if (e[0] - start) // TILE == t) for t in range(packed.BLOCK_TILES)]
    assert packed.event_count([blob, members[0]]) == len(members) + 1
    assert packed.expand([members[-1], blob], features) == sorted(
        [*members, members[-1]], key=lambda m: (m[8:16], m[:8])
    )


def test_members_of_two_blocks_are_refused():
    members, features = _members([(0, 1, 1, 1.0, True), (packed.BLOCK_TILES * TILE, 2, 1, 1.0, True)], "any", False)
    with pytest.raises(ValueError, match="more than one block"):
        packed.pack(members, features, TILE)


def test_typical_events_pack_small():
    """Money amounts (cents), sequential integer ids and times a few seconds apart: a few bytes an event."""
    rng = np.random.default_rng(0)
    n = 2000
    times = np.sort(rng.integers(0, packed.BLOCK_TILES * TILE, n))
    features = [("tx_id", from_name("Int64")), ("amount", from_name("Float64"))]
    ids = rng.permutation(n) + 10**9
    table = pa.table(
        {
            "event_timestamp": pa.array(times, pa.int64()).cast(US),
            "created_timestamp": pa.array([0] * n, pa.int64()).cast(US),
            "_run_id": pa.array([1] * n, pa.int64()),
            "_row_id": pa.array(range(n), pa.int64()),
            "tx_id": pa.array(ids, pa.int64()),
            "amount": np.round(rng.lognormal(3.5, 1.1, n), 2),
        }
    )
    members = encode_events(table, features, ids).to_pylist()
    blob = packed.pack(members, features, TILE)
    assert packed.unpack(blob, features) == members
    assert len(blob) / n < 10, len(blob) / n  # against 33 bytes a plain member
