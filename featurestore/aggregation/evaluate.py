"""Online windowed aggregation: the aggregates of a view at the lookup time, from its events.

Events come in (event time, event id) order (the order of Redis's sorted set)
— the order the offline ``last`` and ``last_n`` use — and each aggregate keeps those with event
time in ``(now - window, now]``.
Float handling follows DuckDB's, so both paths agree: NaN sorts above every number (``max``
is NaN if any value is, ``min`` only if all are), distinct counts treat NaNs as one value.
Sums are exact, rounded once (see ``featurestore.aggregation``); ``where`` filters compare as
``aggregation.where`` says.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from fractions import Fraction
from typing import Any

from featurestore.aggregation import AggregationOverflow, overflow_message
from featurestore.aggregation.where import predicate, typed_value
from featurestore.definitions import Aggregation, FeatureView

PRESENT, NOT_FOUND, NULL_VALUE = "PRESENT", "NOT_FOUND", "NULL_VALUE"

_MICRO = timedelta(microseconds=1)


def _has_nan(values: list[Any]) -> bool:
    return isinstance(values[0], float) and any(map(math.isnan, values))  # a column holds one type


def _zero_signless(value: Any) -> Any:
    """A float zero as +0.0 (equal zeros of both signs: which one a store returns is arbitrary)."""
    return value + 0.0 if isinstance(value, float) else value


def _min(values: list[Any]) -> Any:
    """The smallest number, NaN only if all are; a zero is +0.0."""
    if not values or not _has_nan(values):
        return _zero_signless(min(values)) if values else None
    numbers = [v for v in values if not math.isnan(v)]
    return _zero_signless(min(numbers)) if numbers else values[0]


def _max(values: list[Any]) -> Any:
    """The largest number, NaN (the first) if any is; a zero is +0.0."""
    if not values or not _has_nan(values):
        return _zero_signless(max(values)) if values else None
    return next(v for v in values if math.isnan(v))


def _distinct_key(value: Any) -> Any:
    return "NaN" if isinstance(value, float) and math.isnan(value) else value


def _fsum(values: list[Any]) -> Any:
    """The exact sum, rounded once (offline computes the same, see ``aggregation.sql``); exact
    for integers. A zero sum is +0.0; NaN, or both infinities, give NaN; one infinity gives itself."""
    if not values or not isinstance(values[0], float):
        return sum(values)
    try:
        return math.fsum(values) + 0.0
    except ValueError:  # inf - inf
        return math.nan
    except OverflowError:  # a partial sum left the float range: exactly, then rounded (to +-inf if it must)
        total = sum(map(Fraction, values), Fraction(0))
        try:
            return float(total)
        except OverflowError:
            return math.inf if total > 0 else -math.inf


def _mean(values: list[Any]) -> float:
    """The exact sum rounded once over the count, as offline: integers summed as integers."""
    return (_fsum(values) if isinstance(values[0], float) else float(sum(values))) / len(values)


def _variance(values: list[Any]) -> float | None:
    """Two passes, as offline: the mean, then the sum of squared deviations (compensated)."""
    if len(values) < 2:
        return None
    floats = values if isinstance(values[0], float) else [float(v) for v in values]
    mean = _fsum(floats) / len(floats)
    return _fsum([(v - mean) ** 2 for v in floats]) / (len(floats) - 1)


_REDUCERS: dict[str, Callable[[list[Any], Aggregation], Any]] = {
    "count": lambda vs, a: len(vs),
    "count_distinct": lambda vs, a: len({_distinct_key(v) for v in vs}),
    "sum": lambda vs, a: _fsum(vs),
    "mean": lambda vs, a: _mean(vs),
    "min": lambda vs, a: _min(vs),
    "max": lambda vs, a: _max(vs),
    "variance": lambda vs, a: _variance(vs),
    "stddev": lambda vs, a: None if (var := _variance(vs)) is None else math.sqrt(var),
    "last": lambda vs, a: vs[-1] if vs else None,
    "last_n": lambda vs, a: vs[::-1][: a.n],
}

Filter = tuple[int, Callable[[Any], bool]]  # (column index, test of a non-null value)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def checked_sum(total: Any, view: str, agg: Aggregation) -> Any:
    """An integer sum, if Int64 holds it (offline raises the same error)."""
    if isinstance(total, int) and not INT64_MIN <= total <= INT64_MAX:
        raise AggregationOverflow(overflow_message(view, agg))
    return total


class WindowEvaluator:
    """Computes a fixed list of a view's aggregations from its events at a lookup time."""

    def __init__(self, view: FeatureView, aggregations: Sequence[Aggregation]):
        columns = [f.name for f in view.schema]
        stored = {f.name: f.dtype for f in view.schema}
        self.view = view.name
        self.aggregations = list(aggregations)
        self.windows_us = [a.window // _MICRO for a in self.aggregations]
        self.longest_us = max(self.windows_us)
        # per aggregation: index of its column (None: the event itself), and its filter (column index, test, value)
        self.columns = [columns.index(a.column) if a.column else None for a in self.aggregations]
        self.filters: list[Filter | None] = [
            None
            if a.where is None
            else (
                columns.index(a.where[0]),
                predicate(a.where[1], typed_value(a.where[1], a.where[2], stored[a.where[0]])),
            )
            for a in self.aggregations
        ]
        self.needed = sorted({c for c in self.columns if c is not None} | {f[0] for f in self.filters if f is not None})
        self.empty = [_empty(a, view.field(a.output_name).dtype.name) for a in self.aggregations]

    def evaluate(self, times: list[int], columns: dict[int, list[Any]], now_us: int) -> tuple[list[Any], list[str]]:
        """Values and statuses at ``now_us`` of events given as columns (``times`` ascending, as
        Redis's sorted set orders them; ``columns``: stored column index -> values, at least
        ``needed``). NOT_FOUND when the window has no events (the value is then the function's
        empty value), NULL_VALUE when it has some but the result is null."""
        values, statuses = [], []
        end = bisect.bisect_right(times, now_us)
        for agg, window, column, where, empty in zip(
            self.aggregations, self.windows_us, self.columns, self.filters, self.empty
        ):
            start = bisect.bisect_right(times, now_us - window, 0, end)  # the window is (now - window, now]
            count, picked = pick(columns, column, where, start, end)
            if not count:
                values.append(empty)
                statuses.append(NOT_FOUND)
                continue
            if picked is None:
                picked = [1] * count
            value = _REDUCERS[agg.function](picked, agg) if picked else empty
            if agg.function == "sum":
                value = checked_sum(value, self.view, agg)
            values.append(value)
            statuses.append(NULL_VALUE if value is None else PRESENT)
        return values, statuses


def pick(
    columns: dict[int, list[Any]], column: int | None, where: Filter | None, start: int, end: int
) -> tuple[int, list[Any] | None]:
    """Of events ``start:end``: how many pass ``where``, and their non-null values of ``column``
    (None without a column)."""
    picked = columns[column][start:end] if column is not None else None
    if where is None:
        count = end - start
    else:
        i, test = where
        kept = [w is not None and test(w) for w in columns[i][start:end]]
        count = sum(kept)
        if picked is not None:
            picked = [v for v, keep in zip(picked, kept) if keep]
    if picked is not None and None in picked:
        picked = [v for v in picked if v is not None]
    return count, picked


def _empty(agg: Aggregation, output_type: str) -> Any:
    if agg.function in ("count", "count_distinct", "sum"):
        return 0.0 if output_type == "Float64" else 0
    return [] if agg.function == "last_n" else None
