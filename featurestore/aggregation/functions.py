"""One class per aggregation function: its type, its SQL, its reduce over events and its tile state.

Both paths evaluate a function from the same class, so they cannot drift: ``aggregation.sql``
asks it for SQL, ``aggregation.evaluate`` for its reduce over a window's events and
``aggregation.tiles`` for a mergeable state (Chronon's prepare / update / merge / finalize).
The capabilities are small protocols, as Ibis's backends declare theirs:

- every function (``AggregationFunction``) has an output type, an empty value (no events in the
  window), a ``reduce`` over the window's non-null values in (event time, event id) order and
  the SQL turning its parts into the feature;
- a ``OnePass`` function is one SQL aggregate per part over a window frame; a ``TwoPass`` one
  (variances) is computed from the window's exact mean, then the squared deviations;
- a ``Mergeable`` function keeps a state per tile that merges exactly, so a heavy entity reads
  tile summaries instead of every event.

Adding a function is a class here, registered in ``FUNCTIONS``; the validation, the output
names and types, both evaluators and the tiles take it from there. NaN, zeros and overflow
follow DuckDB on both paths: NaN sorts above every number, distinct counts treat NaNs as one
value, a zero result is +0.0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from featurestore import types as t
from featurestore.aggregation.exact_sum import SumScale, float_sum, fsum, partials
from featurestore.types import DType


@dataclass(frozen=True)
class SqlInput:
    """What a function's SQL aggregates. ``value``: the column (or the event id of a column-less
    count), null where the ``where`` filter fails; ``order``: the (event time, event id) struct of
    a non-null value; ``over``: the OVER or FILTER clause every aggregate takes; ``scale``: how the
    column's floats are summed exactly (``exact_sum``); ``n``: an ``Aggregation``'s n."""

    value: str
    order: str
    over: str
    is_float: bool
    scale: SumScale | None
    n: int


@dataclass(frozen=True)
class SqlOutput:
    """What the feature column is built from. ``part(name)``: the SQL column of one of the
    function's parts; ``output_type``: the feature's DuckDB type; ``overflow``: a SQL string, the
    error an integer sum past Int64's range raises."""

    part: Callable[[str], str]
    is_float: bool
    output_type: str
    overflow: str


class Unsealable(Exception):
    """A tile's state cannot be kept exactly (a float that is not finite, a sum past the float range)."""


class AggregationFunction(Protocol):
    name: str
    needs_column: bool  # False: without a column it aggregates the events themselves
    numeric: bool  # needs a numeric column (bools aggregate as 0 and 1)
    sums: bool  # sums its values: offline needs the column's ``SumScale``; a float result is rounded
    takes_n: bool  # takes ``Aggregation.n``

    def output_type(self, input_type: DType | None) -> DType:
        """The feature's type, given the column's (None without a column)."""
        ...

    def empty(self, output: DType) -> Any:
        """The feature when the window holds no events (or none with a value)."""
        ...

    def reduce(self, values: list[Any], n: int | None) -> Any:
        """The feature over a window's non-null values (at least one), oldest first."""
        ...

    def sql_output(self, out: SqlOutput) -> str:
        """SQL: the feature from the parts, the empty value where the entity row had no events."""
        ...


@runtime_checkable
class OnePass(Protocol):
    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        """``(part, SQL aggregate)``, each applying ``e.over``."""
        ...


@runtime_checkable
class TwoPass(Protocol):
    def from_variance_sql(self, variance: str) -> str:
        """SQL: the feature from the window's (sample) variance, computed in two passes."""
        ...


@runtime_checkable
class Mergeable(Protocol):
    state_kind: str  # functions of one state kind over one column and filter share a tile's state

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        """The state of a tile's non-null values (at least one). ``compact``: as stored in a
        summary (raises ``Unsealable`` when it cannot be exact), else as cheap to build as may be."""
        ...

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        """The feature from the states of tiles holding ``values`` non-null values in all, oldest first."""
        ...


def _has_nan(values: list[Any]) -> bool:
    return isinstance(values[0], float) and any(map(math.isnan, values))  # a column holds one type


def _zero_signless(value: Any) -> Any:
    """A float zero as +0.0 (equal zeros of both signs: which one a store returns is arbitrary)."""
    return value + 0.0 if isinstance(value, float) else value


def _minimum(values: list[Any]) -> Any:
    """The smallest number, NaN only if all are."""
    if not _has_nan(values):
        return _zero_signless(min(values))
    numbers = [v for v in values if not math.isnan(v)]
    return _zero_signless(min(numbers)) if numbers else values[0]


def _maximum(values: list[Any]) -> Any:
    """The largest number, NaN (the first) if any is."""
    if not _has_nan(values):
        return _zero_signless(max(values))
    return next(v for v in values if math.isnan(v))


def _variance(values: list[Any]) -> float | None:
    """Two passes, as offline: the exact mean, then the compensated sum of squared deviations."""
    if len(values) < 2:
        return None
    floats = values if isinstance(values[0], float) else [float(v) for v in values]
    mean = fsum(floats) / len(floats)
    return fsum([(v - mean) ** 2 for v in floats]) / (len(floats) - 1)


def _exact_sum_sql(e: SqlInput, part: str = "") -> tuple[str, str]:
    """The ``s`` part (an integer sum, exact as HUGEINT) or the ``f`` part (a float sum, exact when scaled)."""
    if e.is_float:
        return ("f", float_sum(f"CAST({e.value} AS DOUBLE)", e.scale, e.over))
    return ("s", f"sum({e.value}) {e.over}")


class Count:
    name, needs_column, numeric, sums, takes_n = "count", False, False, False, False
    state_kind = "count"

    def output_type(self, input_type: DType | None) -> DType:
        return t.Int64

    def empty(self, output: DType) -> Any:
        return 0

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return len(values)

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [("n", f"count({e.value}) {e.over}")]

    def sql_output(self, out: SqlOutput) -> str:
        return f"COALESCE({out.part('n')}, 0)"

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        return None  # a tile's count of values is in every state

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        return values


class CountDistinct:
    name, needs_column, numeric, sums, takes_n = "count_distinct", True, False, False, False

    def output_type(self, input_type: DType | None) -> DType:
        return t.Int64

    def empty(self, output: DType) -> Any:
        return 0

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return len({"NaN" if isinstance(v, float) and math.isnan(v) else v for v in values})

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [("n", f"count(DISTINCT {e.value}) {e.over}")]

    def sql_output(self, out: SqlOutput) -> str:
        return f"COALESCE({out.part('n')}, 0)"


class Sum:
    name, needs_column, numeric, sums, takes_n = "sum", True, True, True, False
    state_kind = "sum"

    def output_type(self, input_type: DType | None) -> DType:
        assert input_type is not None
        return t.Int64 if input_type.name in ("Int32", "Int64", "Bool") else t.Float64

    def empty(self, output: DType) -> Any:
        return 0.0 if output.name == "Float64" else 0

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return fsum(values)

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [_exact_sum_sql(e)]

    def sql_output(self, out: SqlOutput) -> str:
        if out.is_float:
            return f"COALESCE({out.part('f')} + 0.0, 0.0)"
        s = out.part("s")  # Int64, or an error naming the aggregation
        return (
            f"CASE WHEN {s} IS NULL THEN 0 WHEN {s} BETWEEN {-(2**63)} AND {2**63 - 1} THEN CAST({s} AS BIGINT) "
            f"ELSE error({out.overflow}) END"
        )

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        """Floats as Shewchuk's partials (or the values themselves), integers as their exact sum."""
        if not is_float:
            return sum(values)
        if not compact:
            return values
        kept = partials(values)
        if kept is None:
            raise Unsealable
        return kept

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        return fsum([x for s in states for x in s]) if is_float else sum(states)


class Mean:
    name, needs_column, numeric, sums, takes_n = "mean", True, True, True, False
    state_kind = "sum"  # a mean's state is its sum's (the count of values is in every state)

    def output_type(self, input_type: DType | None) -> DType:
        return t.Float64

    def empty(self, output: DType) -> Any:
        return None

    def reduce(self, values: list[Any], n: int | None) -> Any:
        """The exact sum rounded once over the count; integers summed as integers."""
        return (fsum(values) if isinstance(values[0], float) else float(sum(values))) / len(values)

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [_exact_sum_sql(e), ("n", f"count({e.value}) {e.over}")]

    def sql_output(self, out: SqlOutput) -> str:
        total = out.part("f") if out.is_float else f"CAST({out.part('s')} AS DOUBLE)"
        return f"{total} / NULLIF({out.part('n')}, 0)"

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        return SUM.state(values, is_float, compact)

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        total = SUM.merge(states, values, is_float)
        return (total if is_float else float(total)) / values


class _Extreme:
    """``min`` or ``max``: DuckDB's order, NaN above every number."""

    needs_column, numeric, sums, takes_n = True, False, False, False

    def __init__(self, name: str, pick: Callable[[list[Any]], Any]):
        self.name = self.state_kind = name
        self._pick = pick

    def output_type(self, input_type: DType | None) -> DType:
        assert input_type is not None
        return input_type

    def empty(self, output: DType) -> Any:
        return None

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return self._pick(values)

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        # + 0.0: a zero is +0.0, as online (DuckDB returns the last of equal zeros)
        sql = f"{self.name}({e.value}) {e.over}"
        return [("v", f"({sql}) + 0.0" if e.is_float else sql)]

    def sql_output(self, out: SqlOutput) -> str:
        return out.part("v")

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        return self._pick(values)

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        return self._pick(states)


class _Spread:
    """``variance`` or ``stddev`` (the sample's): two passes on both paths, the exact mean, then
    the compensated sum of squared deviations in (time, id) order."""

    needs_column, numeric, sums, takes_n = True, True, True, False

    def __init__(self, name: str, root: bool):
        self.name, self._root = name, root

    def output_type(self, input_type: DType | None) -> DType:
        return t.Float64

    def empty(self, output: DType) -> Any:
        return None

    def reduce(self, values: list[Any], n: int | None) -> Any:
        variance = _variance(values)
        return math.sqrt(variance) if self._root and variance is not None else variance

    def from_variance_sql(self, variance: str) -> str:
        return f"sqrt({variance})" if self._root else variance

    def sql_output(self, out: SqlOutput) -> str:
        return out.part("v")


class _End:
    """``last`` or ``first``: the newest or the oldest non-null value in the window."""

    needs_column, numeric, sums, takes_n = True, False, False, False

    def __init__(self, name: str, newest: bool):
        self.name = self.state_kind = name
        self._at, self._arg = (-1, "arg_max") if newest else (0, "arg_min")

    def output_type(self, input_type: DType | None) -> DType:
        assert input_type is not None
        return input_type

    def empty(self, output: DType) -> Any:
        return None

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return values[self._at]

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [("v", f"{self._arg}({e.value}, {e.order}) {e.over}")]

    def sql_output(self, out: SqlOutput) -> str:
        return out.part("v")

    def state(self, values: list[Any], is_float: bool, compact: bool) -> Any:
        return values[self._at]

    def merge(self, states: list[Any], values: int, is_float: bool) -> Any:
        return states[self._at]


class LastN:
    """The ``n`` newest non-null values, newest first."""

    name, needs_column, numeric, sums, takes_n = "last_n", True, False, False, True

    def output_type(self, input_type: DType | None) -> DType:
        assert input_type is not None
        return t.Array(input_type)

    def empty(self, output: DType) -> Any:
        return []

    def reduce(self, values: list[Any], n: int | None) -> Any:
        return values[::-1][:n]

    def sql_parts(self, e: SqlInput) -> list[tuple[str, str]]:
        return [("v", f"max_by({e.value}, {e.order}, {e.n}) {e.over}")]

    def sql_output(self, out: SqlOutput) -> str:
        return f"COALESCE({out.part('v')}, CAST([] AS {out.output_type}))"


SUM = Sum()
FUNCTIONS: dict[str, AggregationFunction] = {
    f.name: f
    for f in (
        Count(),
        SUM,
        Mean(),
        _Extreme("min", _minimum),
        _Extreme("max", _maximum),
        _Spread("stddev", root=True),
        _Spread("variance", root=False),
        _End("last", newest=True),
        _End("first", newest=False),
        LastN(),
        CountDistinct(),
    )
}
