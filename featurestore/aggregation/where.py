"""``Aggregation(where=(column, op, value))``: one comparison semantics for both stores.

- The value is typed like the column (``typed_value``): a Float32 column compares with the
  value rounded to Float32, an integer column takes whole numbers only, a string column
  strings, a bool column booleans. Both paths compare the same two numbers.
- IEEE 754 for NaN: every ordered comparison and ``==`` with NaN is false, ``!=`` is true;
  ``in`` never finds NaN, ``not in`` always passes it. (DuckDB orders NaN above every number
  and calls it equal to itself; the SQL below says otherwise explicitly.) -0.0 equals 0.0.
- A null column value never passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.sources import ident, quote
from featurestore.types import DType, duckdb_type

OPERATORS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in")
_SQL_OPS = {"==": "=", "!=": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
_FLOATS = ("Float32", "Float64")


def _one(value: Any, dtype: DType) -> Any:
    """``value`` as a value of ``dtype`` (ValueError saying why it is not one)."""
    name = dtype.name
    if name in ("Int32", "Int64"):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.integer, np.floating))
            or (isinstance(value, float) and not value.is_integer())
        ):
            raise ValueError(f"{value!r} is not a whole number, as the {name} column is")
        return int(value)
    if name in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{value!r} is not a number, as the {name} column is")
        return float(np.float32(value)) if name == "Float32" else float(value)
    if name == "String":
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a string, as the String column is")
        return value
    if name == "Bool":
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{value!r} is not True or False, as the Bool column is")
        return bool(value)
    raise ValueError(f"where= compares numbers, strings and booleans; the column is {name}")


def typed_value(op: str, value: Any, dtype: DType) -> Any:
    """The comparison's value (a list for ``in``/``not in``) typed like the column."""
    if op in ("in", "not in"):
        return [_one(v, dtype) for v in value]
    return _one(value, dtype)


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def predicate(op: str, value: Any) -> Callable[[Any], bool]:
    """The test online evaluation applies to a non-null column value (``value`` already typed)."""
    if op in ("in", "not in"):
        items = [v for v in value if not _is_nan(v)]  # NaN is never found (nor finds anything)
        if op == "in":
            return lambda x: any(x == v for v in items)
        return lambda x: not any(x == v for v in items)
    compare: Callable[[Any, Any], bool] = {
        "==": lambda x, y: x == y,
        "!=": lambda x, y: x != y,
        "<": lambda x, y: x < y,
        "<=": lambda x, y: x <= y,
        ">": lambda x, y: x > y,
        ">=": lambda x, y: x >= y,
    }[op]
    return lambda x: bool(compare(x, value))  # Python floats compare as IEEE 754 does


def _literal(value: Any, dtype: DType) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, float):
        text = "'NaN'" if math.isnan(value) else f"'{value!r}'" if math.isinf(value) else repr(value)
        return f"CAST({text} AS {duckdb_type(dtype)})"
    return f"CAST({int(value)} AS {duckdb_type(dtype)})"


def where_sql(where: tuple[str, str, Any] | None, dtype: DType | None, prefix: str = "") -> str | None:
    """The filter as a DuckDB boolean (never null), with the semantics above."""
    if where is None:
        return None
    assert dtype is not None
    column, op, raw = where
    value = typed_value(op, raw, dtype)
    col = prefix + ident(column)
    floats = dtype.name in _FLOATS
    passes_nan = op in ("!=", "not in")  # what IEEE 754 says of NaN for this operator
    if op in ("in", "not in"):
        items = [v for v in value if not _is_nan(v)]
        test = (
            f"{col} {op.upper()} ({', '.join(_literal(v, dtype) for v in items)})"
            if items
            else ("TRUE" if op == "not in" else "FALSE")
        )
    elif _is_nan(value):  # nothing equals or orders with NaN
        test = "TRUE" if op == "!=" else "FALSE"
    else:
        test = f"{col} {_SQL_OPS[op]} {_literal(value, dtype)}"
    if floats:
        test = f"CASE WHEN isnan({col}) THEN {'TRUE' if passes_nan else 'FALSE'} ELSE {test} END"
    return f"COALESCE({col} IS NOT NULL AND ({test}), FALSE)"
