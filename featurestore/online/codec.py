"""Online key and value layout (Redis-independent bytes).

Key: one Redis hash per entity-key combination, all views of it as fields::

    fs:<project>:{card_id=42}                      one join key
    fs:<project>:{card_id=42\\x1fmerchant_id=7}     several, sorted by name, unit-separated

The braces are a Redis Cluster hash tag: a later cluster keeps every view of an entity
on one slot, so one HMGET per entity still answers a lookup across all its views.

Value (one per view field), written in bulk from Arrow columns:

    32 bytes  order key: event µs, created µs, run id, row id; each int64 big-endian with the
              sign bit flipped, so the Lua write script compares rows like the offline tie-break
    ceil(F/8) null bitmap, bit i set when feature i is null
    per feature, in schema order:
              Int32/Float32: 4 bytes LE; Int64/Float64/UnixTimestamp (µs): 8 bytes LE; Bool: 1 byte;
              String/Bytes: uint32 LE length + bytes; Array(...): uint32 length + JSON text
"""

from __future__ import annotations

import struct
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import duckdb
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.types import DType

ORDER_KEY_BYTES = 32
_SIGN = np.uint64(1 << 63)
_HEADER = struct.Struct(">QQQQ")
_LEN = struct.Struct("<I")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

_FIXED: dict[str, tuple[str, int]] = {
    "Int32": ("<i4", 4),
    "Int64": ("<i8", 8),
    "Float32": ("<f4", 4),
    "Float64": ("<f8", 8),
    "UnixTimestamp": ("<i8", 8),
    "Bool": ("<u1", 1),
}


# ------------------------------------------------------------------ keys


def key_prefix(project: str) -> bytes:
    return f"fs:{project}:".encode()


def entity_key(project: str, key_values: dict[str, Any]) -> bytes:
    """The Redis key of one entity (values as text, exactly as ``entity_keys`` writes them)."""
    inner = "\x1f".join(f"{name}={_key_text(key_values[name])}" for name in sorted(key_values))
    return key_prefix(project) + b"{" + inner.encode() + b"}"


def _key_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def entity_keys(project: str, table: pa.Table, join_keys: Sequence[str]) -> list[bytes]:
    """Vectorized ``entity_key`` for every row of ``table``."""
    parts: list[Any] = []
    for i, name in enumerate(sorted(join_keys)):
        text = pc.cast(table[name], pa.string())
        if pa.types.is_boolean(table[name].type):
            text = pc.if_else(table[name], "true", "false")
        parts += [("\x1f" if i else "") + f"{name}=", text]
    prefix = key_prefix(project).decode() + "{"
    joined = pc.binary_join_element_wise(prefix, *parts, "}", "")
    return pc.cast(joined, pa.binary()).to_pylist()


# ------------------------------------------------------------------ values


def _fixed(buffer: bytes, width: int, n: int) -> pa.Array:
    arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(buffer)])
    return pc.cast(arr, pa.binary())


def _micros(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.cast(pc.cast(column, pa.timestamp("us", tz="UTC")), pa.int64()).to_numpy(zero_copy_only=False)


def encode_values(table: pa.Table, features: Sequence[tuple[str, DType]]) -> list[bytes]:
    """Encode every row of ``table`` (history columns + features) in bulk."""
    n = table.num_rows
    header = np.empty((n, 4), dtype=np.uint64)
    header[:, 0] = _micros(table["event_timestamp"]).view(np.uint64) ^ _SIGN
    header[:, 1] = _micros(table["created_timestamp"]).view(np.uint64) ^ _SIGN
    header[:, 2] = table["_run_id"].to_numpy().astype(np.int64).view(np.uint64) ^ _SIGN
    header[:, 3] = table["_row_id"].to_numpy().astype(np.int64).view(np.uint64) ^ _SIGN
    parts = [_fixed(header.astype(">u8").tobytes(), ORDER_KEY_BYTES, n)]

    nbytes = (len(features) + 7) // 8
    bits = np.zeros((n, max(nbytes, 1)), dtype=np.uint8)
    for i, (name, _) in enumerate(features):
        is_null = table[name].is_null().to_numpy(zero_copy_only=False).astype(np.uint8)
        bits[:, i // 8] |= is_null << (i % 8)
    parts.append(_fixed(bits[:, :nbytes].tobytes(), nbytes, n) if nbytes else None)

    for name, dtype in features:
        column = table[name]
        if dtype.name in _FIXED:
            np_type, width = _FIXED[dtype.name]
            if dtype.name == "UnixTimestamp":
                values = np.nan_to_num(_micros(column.fill_null(0)) if column.null_count < n else np.zeros(n)).astype(np_type)
            else:
                values = column.fill_null(False if dtype.name == "Bool" else 0).to_numpy(zero_copy_only=False).astype(np_type)
            parts.append(_fixed(values.tobytes(), width, n))
            continue
        if dtype.is_array:
            con = duckdb.connect()
            con.register("t", pa.table({"v": column}))
            column = con.sql("SELECT to_json(v)::VARCHAR AS v FROM t").to_arrow_table()["v"]
        data = pc.cast(column, pa.binary()).fill_null(b"")
        lengths = pc.binary_length(data).to_numpy(zero_copy_only=False).astype("<u4")
        parts += [_fixed(lengths.tobytes(), 4, n), data]
    joined = pc.binary_join_element_wise(*[p for p in parts if p is not None], b"")
    return joined.to_pylist()



def make_decoder(features: Sequence[tuple[str, DType]]) -> Callable[[bytes, Sequence[int]], tuple[int, list[Any]]]:
    """A decoder for one view's values: ``decode(value, wanted_indexes) -> (event µs, values)``."""
    nbytes = (len(features) + 7) // 8
    readers: list[Callable[[bytes, int], tuple[Any, int]]] = [_reader(dtype) for _, dtype in features]

    def decode(value: bytes, wanted: Sequence[int]) -> tuple[int, list[Any]]:
        event_us = (_HEADER.unpack_from(value)[0] ^ (1 << 63))
        if event_us >= 1 << 63:
            event_us -= 1 << 64
        bitmap = value[ORDER_KEY_BYTES:ORDER_KEY_BYTES + nbytes]
        pos = ORDER_KEY_BYTES + nbytes
        decoded = []
        for read in readers:
            item, pos = read(value, pos)
            decoded.append(item)
        return event_us, [None if bitmap[i >> 3] >> (i & 7) & 1 else decoded[i] for i in wanted]

    return decode


def _reader(dtype: DType) -> Callable[[bytes, int], tuple[Any, int]]:
    if dtype.name in _FIXED:
        np_type, width = _FIXED[dtype.name]
        fmt = struct.Struct({"<i4": "<i", "<i8": "<q", "<f4": "<f", "<f8": "<d", "<u1": "<?"}[np_type])
        if dtype.name == "UnixTimestamp":
            return lambda b, p: (micros_to_datetime(fmt.unpack_from(b, p)[0]), p + width)
        return lambda b, p: (fmt.unpack_from(b, p)[0], p + width)

    def var(b: bytes, p: int) -> tuple[Any, int]:
        (length,) = _LEN.unpack_from(b, p)
        raw = b[p + 4:p + 4 + length]
        if dtype.is_array:  # a null array is stored empty (its bitmap bit says null); "[]" is never empty
            return (orjson.loads(raw) if length else None), p + 4 + length
        return (raw.decode() if dtype.name == "String" else raw), p + 4 + length

    return var


def micros_to_datetime(us: int) -> datetime:
    return datetime.fromtimestamp(us // 1_000_000, tz=timezone.utc).replace(microsecond=us % 1_000_000)
