"""Packed blocks (``online.packed``): a block gives back exactly the members it replaced."""

from __future__ import annotations

import itertools
import math
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore.online import packed
from featurestore.online.codec import EVENT_ID, encode_events
from featurestore.types import from_name

from .conftest import examples

TILE = 3_600_000_000
NAMES = ["Int32", "Int64", "Float32", "Float64", "Bool", "UnixTimestamp", "String", "Bytes", "Array(Float64)"]
US = pa.timestamp("us", tz="UTC")
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 12.34, -0.1]
NAN_PAYLOAD = struct.unpack(">d", bytes.fromhex("7ff8000000000bad"))[0]


def _members(events, floats_kind: str, ids_from_column: bool) -> tuple[list[bytes], list]:
    """Members of ``events`` with every column type; ``ids_from_column``: the Int64 column is the
    event id (``EVENT_ID``: no bytes of its own)."""
    features = [(f"c{k}", from_name(n)) for k, n in enumerate(NAMES)]
    if ids_from_column:
        features[1] = ("c1", EVENT_ID)
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
            # (else the ids' full int64 range too: offsets of up to 64 bits)
            "c1": pa.array([e[1] if ids_from_column or e[2] is not None else None for e in events], pa.int64()),
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


BLOCK_EVENTS = """
local out = {}
for t = 0, BLOCK_TILES - 1 do out[#out + 1] = block_events(ARGV[1], t) end
return out
"""


def _lua(redis_url: str, harness: str, *args):
    """``harness`` run after ``_blocks.lua``'s functions, on ``args``."""
    import redis

    code = (Path(packed.__file__).parent / "scripts" / "_blocks.lua").read_text() + harness
    return redis.Redis.from_url(redis_url).eval(code, 0, *args)


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


@settings(deadline=None)
@given(
    events=block_events,
    block=st.integers(-3, 10**6),
    floats_kind=st.sampled_from(["any", "decimal", "steady"]),
    ids_from_column=st.booleans(),
    grid=st.sampled_from([1, 1000, 10**6]),
)
def test_a_block_gives_back_its_members_byte_for_byte(redis_url, events, block, floats_kind, ids_from_column, grid):
    """Every column type, nulls, NaN payloads, ±inf, -0.0, subnormals, equal times, any ids, times
    in µs or whole ms or seconds: ``unpack(pack(members)) == members``, and the header counts each
    tile's events, as Python and the Lua scripts read it."""
    start = block * packed.BLOCK_TILES * TILE
    events = [(start + e[0] // grid * grid, *e[1:]) for e in events]
    members, features = _members(events, floats_kind, ids_from_column)
    blob = packed.pack(members, features, TILE)
    assert packed.is_block(blob) and not any(packed.is_block(m) for m in members)
    assert packed.unpack(blob, features) == members
    number, counts = packed.header(blob)
    assert number == block
    assert counts == [sum(1 for e in events if (e[0] - start) // TILE == t) for t in range(packed.BLOCK_TILES)]
    assert _lua(redis_url, BLOCK_EVENTS, blob) == counts
    assert packed.event_count([blob, members[0]]) == len(members) + 1
    assert packed.expand([members[-1], blob], features) == sorted(
        [*members, members[-1]], key=lambda m: (m[8:16], m[:8])
    )


@settings(deadline=None)
@given(
    events=block_events,
    floats_kind=st.sampled_from(["any", "decimal", "steady"]),
    bounds=st.lists(st.tuples(st.integers(-2, 34), st.sampled_from([0, -1, 1, TILE // 3])), min_size=2, max_size=2),
    skipped=st.sets(st.integers(0, 31)),
)
def test_a_block_gives_the_members_of_the_tiles_asked_decoding_their_rows_only(events, floats_kind, bounds, skipped):
    """Every column type: ``unpack`` with a window and tiles to skip gives the members inside the
    window outside those tiles, byte for byte. With tiles to skip (a heavy card's summarized
    ones), it decodes only the rows of the other tiles reaching into the window, and nothing of a
    block holding none; without, the whole block (a plain read's blocks are inside its window)."""
    members, features = _members(events, floats_kind, False)
    blob = packed.pack(members, features, TILE)
    # (edges inside tiles, and either side of their starts)
    low, high = sorted(tile * TILE + offset for tile, offset in bounds)
    expected = [m for m in members if low < packed.tile_of(m, 1) <= high and packed.tile_of(m, TILE) not in skipped]
    packed.decoded_blocks.clear()
    assert packed.unpack(blob, features, (low, high), TILE, skipped) == expected
    wanted = [  # rows of the tiles reaching into the window, not skipped
        row
        for row, m in enumerate(members)
        if (tile := packed.tile_of(m, TILE)) not in skipped and tile * TILE <= high and (tile + 1) * TILE - 1 > low
    ]
    consecutive = [[row for _, row in run] for _, run in itertools.groupby(enumerate(wanted), lambda p: p[1] - p[0])]
    runs = tuple((run[0], run[-1] + 1) for run in consecutive)
    if not skipped:  # (a plain read: its blocks are decoded whole, and shared)
        runs = None
    elif runs == ((0, len(members)),):  # (all rows: the whole block's decode)
        runs = None
    elif not runs:
        assert len(packed.decoded_blocks) == 0
        return
    assert len(packed.decoded_blocks) == 1 and (blob, tuple(features), runs) in packed.decoded_blocks
    times, heads, _ = packed.decoded_blocks.get((blob, tuple(features), runs))
    for array in (times, heads):  # (what the cache counts is what it keeps: no view of a larger array)
        assert array.base is None or array.base.nbytes == array.nbytes


@settings(max_examples=examples(200), deadline=None)
@given(
    st.integers(0, 64),
    st.sampled_from([1, 2, packed.SMALL, packed.SMALL + 1, packed.BIT_ROWS_MOST, packed.BIT_ROWS_MOST + 1, 1000]),
    st.integers(0, 2**32 - 1),
)
def test_bit_packed_values_read_back(width, n, seed):
    """Every width, in Python (few values), as rows of bits (more) and as words (many), with values
    touching every bit (random ones drawn by numpy: hypothesis drawing a thousand took seconds);
    all of them, and a range of them starting at any bit (a lookup decodes a block's edge tiles)."""
    top = (1 << width) - 1
    rng = np.random.default_rng(seed)
    array = rng.integers(0, top, n, dtype=np.uint64, endpoint=True)
    array[rng.integers(0, n, 3)] = [0, top, top >> 1]
    values = array.tolist()
    blob = b"\x07" + packed._bits(array, width) + b"\x07"
    read, end = packed._read_bits(memoryview(blob), 1, n, width)
    assert read.tolist() == values and end == len(blob) - 1
    cuts = sorted(rng.integers(0, n, 4, endpoint=True).tolist())
    runs = ((cuts[0], cuts[1]), (cuts[2], cuts[3]))
    read, end = packed._read_bits(memoryview(blob), 1, n, width, runs)
    assert read.tolist() == values[cuts[0] : cuts[1]] + values[cuts[2] : cuts[3]] and end == len(blob) - 1


@settings(max_examples=examples(200), deadline=None)
@given(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([1, 2, 3, 1000, 10**6, 2**40, 2**62]) | st.integers(1, 2**63),
    st.lists(st.integers(0, 2**20) | st.sampled_from([0, 1, 2**63 - 1]), min_size=1, max_size=80),
)
def test_integers_sharing_a_factor_read_back_and_store_it_once(base, scale, steps):
    """Integer sections (ids, times, integer columns): any int64 values read back, including values
    that wrap around 2^64 in their frame; values on a grid (times in whole seconds) store the
    grid's factor once, so they take no more room than their multiples of it would."""
    values = np.array([(base + scale * k) % 2**64 for k in steps], np.uint64).view(np.int64)
    blob = packed._ints(values) + b"\x07"
    read, end = packed._read_ints(memoryview(blob), 0, len(values))
    assert read.tolist() == values.tolist() and end == len(blob) - 1
    n = len(values)
    for runs in (((0, 1),), ((n // 2, n),), ((0, n // 3), (n // 2, n)), ((n - 1, n),)):
        read, end = packed._read_ints(memoryview(blob), 0, n, runs)  # (deltas: those before are summed too)
        assert read.tolist() == [v for first, stop in runs for v in values.tolist()[first:stop]]
        assert end == len(blob) - 1
    if base + scale * max(steps) < 2**63:  # (no int64 wrap: the values are multiples of scale from base)
        multiples = np.array(steps, np.int64)
        assert len(blob) - 1 <= len(packed._ints(multiples)) + 8


_INT64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(_INT64 | st.integers(-1000, 1000) | st.sampled_from([-(2**63), 2**63 - 1, 0]), max_size=packed.SMALL),
    st.integers(1, 10**6),
    st.lists(st.floats(width=64) | st.sampled_from(SPECIAL + [NAN_PAYLOAD, 2.0**53, 2.0**53 - 1]), max_size=32),
    st.integers(0, 7),
    st.lists(st.floats(width=32), max_size=32),
    st.lists(st.integers(0, 2**64 - 1), max_size=32),
)
def test_a_few_values_are_packed_in_python_byte_for_byte_as_numpy_packs_them(
    ints, step, floats, decimals, floats32, bit_patterns
):
    """Integer and float sections and directories of up to ``SMALL`` values are packed in Python
    (numpy's per-call costs made a float column most of a small block's packing): the bytes are
    numpy's, for any int64 values (a grid's factor, wrapping deltas), floats that are decimals of
    any exponent and those that are not, specials (NaN payloads, ±inf, -0.0, subnormals, 2^53),
    float32, any bit patterns of either width, and directories of any ids (repeated too) at times
    on any unit's grid."""

    def both(pack, values) -> tuple[bytes, bytes]:
        few, small = pack(values), packed.SMALL
        packed.SMALL = -1  # (numpy's path for any count)
        try:
            return few, pack(values)
        finally:
            packed.SMALL = small

    start = ints[0] if ints else 0
    grid = np.array([(start + step * k) % 2**64 for k in range(len(ints))], np.uint64).view(np.int64)
    for values in (np.array(ints, np.int64), grid):
        few, numpy = both(packed._ints, values)
        assert few == numpy
    if ints:  # a directory: ids (any 64 bits, repeated), times (whole s, ms or µs apart, before 1970 too)
        ids = np.array([i % 2**64 for i in ints], np.uint64)
        times = np.array([(i % 10**15 - 5 * 10**14) // 10**decimals * 10**decimals for i in ints], np.int64)
        few, numpy = both(lambda rows: packed.directory(rows[0], rows[1]), (ids, times))
        assert few == numpy
    cents = [round(f, decimals) if math.isfinite(f) and abs(f) < 1e12 else f for f in floats]
    patterns = np.array(bit_patterns, np.uint64)  # (any bits: NaN payloads, signalling ones too)
    in_32_bits = (patterns & np.uint64(2**32 - 1)).astype(np.uint32).view(np.float32)
    every = [np.array(floats, np.float64), np.array(cents, np.float64), np.array(floats32, np.float32)]
    for values in [*every, patterns.view(np.float64), in_32_bits]:
        few, numpy = both(packed._floats, values)
        assert few == numpy


@settings(max_examples=examples(100), deadline=None)
@given(
    st.lists(
        st.tuples(block_events, st.integers(-3, 10**6), st.sampled_from([1, 1000, 10**6])), min_size=1, max_size=6
    ),
    st.sampled_from(["any", "decimal", "steady"]),
    st.booleans(),
    st.lists(st.integers(0, 5), max_size=3),
)
def test_many_blocks_are_packed_and_decoded_at_once_as_one_at_a_time(groups, floats_kind, ids_from_column, refused):
    """``pack_many`` (a packing run's hundreds of small blocks at once) gives each block ``pack``'s
    bytes: every column type, nulls, NaN payloads, ±inf, -0.0, decimals, blocks of one event and of
    many, on any grid, before 1970; and None where ``pack`` refuses (empty, across two blocks).
    Decoded at once (``expand_many``: the blocks a packing run packs again), each gives what it
    gives alone."""
    blocks, expected = [], []
    for events, block, grid in groups:
        start = block * packed.BLOCK_TILES * TILE
        members, features = _members(
            [(start + e[0] // grid * grid, *e[1:]) for e in events], floats_kind, ids_from_column
        )
        blocks.append(members)
        expected.append(packed.pack(members, features, TILE))
    for at in refused:
        last = blocks[at % len(blocks)][-1]
        later = int.from_bytes(last[8:16], "big") + packed.BLOCK_TILES * TILE  # (in the next block)
        crossing = [*blocks[at % len(blocks)], last[:8] + later.to_bytes(8, "big") + last[16:]]
        blocks.insert(at % (len(blocks) + 1), crossing)
        expected.insert(at % (len(expected) + 1), None)
    blocks.append([])
    expected.append(None)
    few, packed.FEW_BLOCKS = packed.FEW_BLOCKS, 0  # (at once, however few)
    try:
        assert packed.pack_many(blocks, features, TILE) == expected
    finally:
        packed.FEW_BLOCKS = few
    ids = [np.frombuffer(b"".join(m[:8] for m in members), ">u8").astype(np.uint64) for members in blocks]
    assert packed.id_filters(np.concatenate(ids), [len(i) for i in ids]) == [packed.id_filter(i) for i in ids]
    # and decoded at once as one at a time: each block's µs, head records and variable-width values
    blobs = [blob for blob in expected if blob is not None]
    for (times, heads, var), blob in zip(packed._decode_blocks(blobs, tuple(features)), blobs):
        one_times, one_heads, one_var = packed._decode(blob, tuple(features))
        assert times.tolist() == one_times.tolist()
        for name in heads.dtype.names:
            assert heads[name].tobytes() == one_heads[name].tobytes(), name
        assert var == one_var
    plain = [m for members in blocks for m in members[:2]]
    lists = [[blob, *plain[: k % 3]] for k, blob in enumerate(blobs)] + [plain]
    assert packed.expand_many(lists, features, keep=False) == [packed.expand(m, features) for m in lists]


def test_counts_past_a_byte_read_back_in_python_and_lua(redis_url):
    """A block's header counts each tile's events in one byte until a tile holds 256 or more."""
    for many in (255, 256, 3000):
        events = [(5 * TILE + i, i, i, 1.0, True) for i in range(many)] + [(31 * TILE, -1, 0, 2.0, False)]
        members, features = _members(events, "any", False)
        blob = packed.pack(members, features, TILE)
        counts = [0] * packed.BLOCK_TILES
        counts[5], counts[31] = many, 1
        assert packed.header(blob) == (0, counts) and _lua(redis_url, BLOCK_EVENTS, blob) == counts
        assert packed.unpack(blob, features) == members


def test_members_of_two_blocks_are_refused():
    members, features = _members([(0, 1, 1, 1.0, True), (packed.BLOCK_TILES * TILE, 2, 1, 1.0, True)], "any", False)
    with pytest.raises(ValueError, match="more than one block"):
        packed.pack(members, features, TILE)


def test_decoded_blocks_stay_within_their_byte_bound(monkeypatch):
    """A process keeps the blocks it decoded (a hot entity's lookups decode each once), but at
    most ``DECODED_BLOCK_BYTES`` of them: one block may hold millions of events, so a count of
    blocks bounds nothing. Each answer equals a fresh decode, cached or not."""
    rng = np.random.default_rng(1)
    blobs = []
    for block in range(12):
        start = block * packed.BLOCK_TILES * TILE
        events = [
            (start + int(t), int(i), int(i) % 1000, float(i) / 7, bool(i % 2))
            for i, t in zip(rng.permutation(3000) + block * 10**6, rng.integers(0, packed.BLOCK_TILES * TILE, 3000))
        ]
        members, features = _members(events, "any", False)
        blobs.append((packed.pack(members, features, TILE), members))
    monkeypatch.setattr(packed.decoded_blocks, "most_bytes", 2 << 20)
    packed.decoded_blocks.clear()
    for _ in range(2):
        for blob, members in blobs:
            assert packed.unpack(blob, features) == members
            assert 0 < packed.decoded_blocks.nbytes <= 2 << 20
    assert len(packed.decoded_blocks) < len(blobs)  # (each block is over 200 KB decoded: some went)
    monkeypatch.setattr(packed.decoded_blocks, "most_bytes", 1000)  # a block bigger than the bound is decoded, not kept
    packed.decoded_blocks.clear()
    assert packed.unpack(blobs[0][0], features) == blobs[0][1] and packed.decoded_blocks.nbytes == 0


def test_a_block_read_to_be_packed_again_is_not_kept_decoded():
    """A packing run reads each block it packs again with new events (``expand(..., keep=False)``):
    kept, those dead blocks filled a pushing process's decoded blocks up to their bound and pushed
    out what its lookups read. A block a lookup decoded is still read from the cache."""
    blocks = []
    for block in (0, 1):
        start = block * packed.BLOCK_TILES * TILE
        events = [(start + i * TILE // 3, block * 100 + i, i, i / 4, True) for i in range(30)]
        members, features = _members(events, "decimal", False)
        blocks.append((packed.pack(members[:20], features, TILE), members))
    packed.decoded_blocks.clear()
    (looked_up, members), (repacked, others) = blocks
    assert packed.unpack(looked_up, features) == members[:20]  # a lookup's: kept
    held = (len(packed.decoded_blocks), packed.decoded_blocks.nbytes)
    assert packed.expand([repacked, *others[20:]], features, keep=False) == others  # a packing run's: not kept
    assert packed.expand([looked_up, *members[20:]], features, keep=False) == members
    assert (len(packed.decoded_blocks), packed.decoded_blocks.nbytes) == held and looked_up in {
        key[0] for key in packed.decoded_blocks._values
    }


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
    # against 33 bytes a plain member (and its id's record in the ids hash): the directory takes
    # 2 bytes of id and 5 of µs an event, the amount about 2
    assert len(blob) / n < 11, len(blob) / n


def _entry(event_id: int, us: int) -> bytes:
    return ((event_id + (1 << 63)) % (1 << 64)).to_bytes(8, "big") + (us + (1 << 63)).to_bytes(8, "big")


_ids = st.one_of(st.integers(0, 300), st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 2**32, 2**40 + 7]))


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.tuples(_ids, st.integers(0, packed.BLOCK_TILES * TILE - 1)), min_size=1, max_size=40, unique=True),
    st.integers(-(2**16), 2**16),  # (µs within ±2^53: Lua numbers are doubles)
    st.sampled_from([1, 1000, 10**6]),
    st.lists(_ids, max_size=5),
)
def test_a_blocks_directory_gives_the_writes_of_each_id(redis_url, writes, block, grid, others):
    """``_blocks.lua`` finds an id's writes in a block's directory (ids sharing a prefix or not, one
    id written at several times, equal times, times in whole seconds, ms or µs, blocks before and
    after 1970), as the events the block holds say, and none for an id it lacks; the block still
    gives its members back byte for byte."""
    start = block * packed.BLOCK_TILES * TILE
    writes = sorted({(i, start + t // grid * grid) for i, t in writes})
    events = [(t, i, None, None, None) for i, t in writes]
    members, features = _members(events, "any", False)
    blob = packed.pack(members, features, TILE)
    assert packed.unpack(blob, features) == members
    entries = sorted(_entry(i, t) for i, t in writes)
    for event_id in {e[:8] for e in entries} | {_entry(i, 0)[:8] for i in others}:
        found = _lua(redis_url, "return id_writes(directory(ARGV[1]), ARGV[2])", blob, event_id)
        assert found == b"".join(e[8:] for e in entries if e[:8] == event_id)


_FILTER_CHECK = """
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = {may_hold(ARGV[1], 1, #ARGV[1], {id_hashes(ARGV[i])}) and 1 or 0, id_hashes(ARGV[i])}
end
return out"""


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(_ids, max_size=300), st.lists(_ids, max_size=40))
def test_a_blocks_id_filter_lets_each_of_its_ids_through(redis_url, ids, others):
    """A block's id filter (``packed.id_filter``, read by ``_blocks.lua``'s ``may_hold``) lets
    through every id the block holds, whatever the ids (repeated, sharing a prefix or not, signed
    extremes), so a write never misses a packed write of its id; Lua hashes an id as Python does,
    and lets an id through exactly where the filter's bits say so."""
    held = np.array([(i + (1 << 63)) % (1 << 64) for i in ids], dtype=np.uint64)
    asked = np.concatenate([held, np.array([(i + (1 << 63)) % (1 << 64) for i in others], dtype=np.uint64)])
    id_filter = packed.id_filter(held)
    if not asked.size:
        return
    answers = _lua(redis_url, _FILTER_CHECK, id_filter, *(int(i).to_bytes(8, "big") for i in asked))
    hashes = packed.filter_hashes(asked)
    assert [a[1:] for a in answers] == hashes.tolist()
    if not held.size:
        assert id_filter == b"" and all(a[0] == 1 for a in answers)  # (no filter: a block without one is read)
        return
    bits = np.unpackbits(np.frombuffer(id_filter, dtype=np.uint8), bitorder="little")
    through = bits[hashes % np.uint64(len(bits))].all(axis=1)
    assert [a[0] for a in answers] == through.astype(int).tolist()
    assert through[: len(held)].all()


@pytest.mark.parametrize("ids", ["sequential", "random"])
def test_a_blocks_id_filter_lets_few_new_ids_through(redis_url, ids):
    """Ids a block lacks get through its filter rarely (a byte an id, three bits set: a few in a
    hundred), for sequential ids (a new one past all the block holds) as for random ones, so a
    write of a new id reads few blocks."""
    rng = np.random.default_rng(7)
    for n in (packed.SPARSE_PACK_FROM, 8, 32, 100, 3000):
        if ids == "sequential":
            held, new = np.arange(10**6, 10**6 + n), np.arange(10**6 + n, 10**6 + n + 2000)
        else:
            held, new = rng.integers(0, 2**62, n), rng.integers(0, 2**62, 2000)
        id_filter = packed.id_filter(held.astype(np.uint64) ^ np.uint64(1 << 63))
        asked = (new.astype(np.uint64) ^ np.uint64(1 << 63)).tolist()
        answers = _lua(redis_url, _FILTER_CHECK, id_filter, *(int(i).to_bytes(8, "big") for i in asked))
        assert sum(a[0] for a in answers) / len(asked) < 0.08, (n, ids)
