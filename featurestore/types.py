"""Feature value types and their one mapping to Arrow types.

Every module that needs a physical type asks ``dtype.arrow``; nothing else maps types.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from featurestore.errors import RequestError
from featurestore.timestamps import epoch_column, micros_column


@dataclass(frozen=True)
class DType:
    """A feature or join-key type; ``arrow`` is its storage type everywhere."""

    name: str
    arrow: pa.DataType

    def __repr__(self) -> str:
        return self.name

    @property
    def is_array(self) -> bool:
        return pa.types.is_list(self.arrow)


Int32 = DType("Int32", pa.int32())
Int64 = DType("Int64", pa.int64())
Float32 = DType("Float32", pa.float32())
Float64 = DType("Float64", pa.float64())
String = DType("String", pa.string())
Bool = DType("Bool", pa.bool_())
Bytes = DType("Bytes", pa.binary())
UnixTimestamp = DType("UnixTimestamp", pa.timestamp("us", tz="UTC"))

SCALARS: dict[str, DType] = {t.name: t for t in (Int32, Int64, Float32, Float64, String, Bool, Bytes, UnixTimestamp)}


def Array(of: DType) -> DType:  # noqa: N802 - reads like a type constructor, as in Feast
    """A list of one scalar type, e.g. ``Array(Float32)``."""
    if of.name not in SCALARS:
        raise TypeError(f"Array() takes a scalar type ({', '.join(SCALARS)}), not {of!r}")
    return DType(f"Array({of.name})", pa.list_(of.arrow))


def from_name(name: str) -> DType:
    """Inverse of ``DType.name`` (used when reading specs back from the registry)."""
    if name.startswith("Array(") and name.endswith(")"):
        return Array(from_name(name[6:-1]))
    try:
        return SCALARS[name]
    except KeyError:
        raise ValueError(f"unknown type {name!r}; use one of {', '.join(SCALARS)} or Array(...)") from None


def from_arrow(arrow_type: pa.DataType) -> DType | None:
    """The DType whose storage type matches ``arrow_type`` loosely (None when none does)."""
    for family in _FAMILIES:
        if family[0](arrow_type):
            return family[1]
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        inner = from_arrow(arrow_type.value_type)
        return Array(inner) if inner else None
    return None


_FAMILIES = [
    (pa.types.is_int32, Int32),
    (pa.types.is_int64, Int64),
    (lambda t: pa.types.is_integer(t), Int64),
    (pa.types.is_float32, Float32),
    (pa.types.is_floating, Float64),
    (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), String),
    (pa.types.is_boolean, Bool),
    (lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t), Bytes),
    (lambda t: pa.types.is_timestamp(t) or pa.types.is_date(t), UnixTimestamp),
]


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):  # (pandas' categoricals): the kind of its values
        return _kind(t.value_type)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "bytes"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list:" + _kind(t.value_type)
    return str(t)


def castable(source: pa.DataType, target: DType) -> bool:
    """Whether source data can be stored as ``target`` without changing its meaning."""
    src, dst = _kind(source), _kind(target.arrow)
    if src == dst:
        # a float column cannot silently become an integer feature
        return not (src == "number" and pa.types.is_integer(target.arrow) and pa.types.is_floating(source))
    return False


def pushable(source: pa.DataType, target: DType) -> bool:
    """Whether pushed values of ``source`` convert to ``target`` keeping their meaning: values of
    the same kind (numbers to numbers, where Arrow's safe cast refuses fractions and overflow), and
    what clients send for want of a type (JSON has no int64, bytes or times): an integer's text for
    an integer, an integer for its text, text for bytes or a time, an epoch number for a time. A
    bool as a number, a number as a bool, a float as text or text as a float is refused."""
    src, dst = _kind(source), _kind(target.arrow)
    if src == dst or pa.types.is_null(source) or (src == "list:null" and dst.startswith("list:")):
        return True  # (a list's values convert only to values of their kind: no epoch numbers, no text)
    if (src, dst) in (("string", "bytes"), ("string", "time"), ("number", "time")):
        return True
    return (src == "string" and pa.types.is_integer(target.arrow)) or (pa.types.is_integer(source) and dst == "string")


def as_declared(
    name: str, column: pa.ChunkedArray | pa.Array, dtype: DType, what: str = "column"
) -> pa.ChunkedArray | pa.Array:
    """Values a client sent (a pushed column, a request field) as their declared type (``pushable``):
    epoch numbers as times in the unit their size says (as over REST), nanoseconds truncated to the
    µs (as everywhere), text as an integer only where
    it is the integer's own text (as lookups take keys); anything that would change a value's
    meaning is a ``RequestError`` naming the column, never a cast."""
    if column.type == dtype.arrow:
        return column
    if pa.types.is_dictionary(column.type):  # (a categorical: its values)
        return as_declared(name, column.cast(column.type.value_type), dtype, what)
    if not pushable(column.type, dtype):
        raise RequestError(f"{what} {name!r} holds {column.type} values, not {dtype!r}: convert them first")
    number = pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
    text = _kind(column.type) == "string"
    try:
        if pa.types.is_timestamp(dtype.arrow) and number:
            return epoch_column(column)
        if pa.types.is_timestamp(dtype.arrow) and pa.types.is_timestamp(column.type) and column.type.unit == "ns":
            return micros_column(column)
        converted = column.cast(dtype.arrow)
        # ("017", "+17", " 17" name no integer plainly: refused, as lookups refuse them)
        if text and pa.types.is_integer(dtype.arrow):
            if not pc.all(pc.equal(converted.cast(pa.string()), column.cast(pa.string())), min_count=0).as_py():
                raise RequestError(f"{what} {name!r} holds text that is not an integer's own (such as '17')")
        return converted
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, ValueError) as exc:
        raise RequestError(f"{what} {name!r} does not convert to {dtype!r}: {exc}") from exc


def is_timestamp_like(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t)


def duckdb_type(dtype: DType) -> str:
    """The SQL type DuckDB computes a feature in (timestamps are naive UTC inside SQL)."""
    if dtype.is_array:
        inner = from_arrow(dtype.arrow.value_type)
        assert inner is not None
        return duckdb_type(inner) + "[]"
    return _DUCKDB[dtype.name]


_DUCKDB = {
    "Int32": "INTEGER",
    "Int64": "BIGINT",
    "Float32": "FLOAT",
    "Float64": "DOUBLE",
    "String": "VARCHAR",
    "Bool": "BOOLEAN",
    "Bytes": "BLOB",
    "UnixTimestamp": "TIMESTAMP",
}
