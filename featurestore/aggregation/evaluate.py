"""Online windowed aggregation: the aggregates of a view at the lookup time, from its events.

Events come in (event time, event id) order (``codec.events_between`` sorts what Redis holds)
— the order the offline ``last`` and ``last_n`` use — and each aggregate keeps those with event
time in ``(now - window, now]``.
Float handling follows DuckDB's, so both paths agree: NaN sorts above every number (``max``
is NaN if any value is, ``min`` only if all are), distinct counts treat NaNs as one value.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Callable, Sequence

from featurestore.definitions import Aggregation, FeatureView

PRESENT, NOT_FOUND, NULL_VALUE = "PRESENT", "NOT_FOUND", "NULL_VALUE"

_MICRO = timedelta(microseconds=1)

Event = tuple[int, list[Any]]  # (event µs, stored column values in schema order)


def _nan_last(value: Any) -> tuple[bool, Any]:
    return (isinstance(value, float) and math.isnan(value), value)


def _distinct_key(value: Any) -> Any:
    return "NaN" if isinstance(value, float) and math.isnan(value) else value


def _fsum(values: list[Any]) -> Any:
    """Correctly rounded float sum (DuckDB's fsum offline agrees); exact for integers."""
    if not values or not isinstance(values[0], float):
        return sum(values)
    try:
        return math.fsum(values)
    except (OverflowError, ValueError):  # inf - inf, or beyond the float range: as DuckDB, plainly
        return sum(values)


def _variance(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


_REDUCERS: dict[str, Callable[[list[Any], Aggregation], Any]] = {
    "count": lambda vs, a: len(vs),
    "count_distinct": lambda vs, a: len({_distinct_key(v) for v in vs}),
    "sum": lambda vs, a: _fsum(vs),
    "mean": lambda vs, a: _fsum([float(v) for v in vs]) / len(vs),
    "min": lambda vs, a: min(vs, key=_nan_last) if vs and not all(_nan_last(v)[0] for v in vs) else (vs[0] if vs else None),
    "max": lambda vs, a: max(vs, key=_nan_last) if vs else None,
    "variance": lambda vs, a: _variance(vs),
    "stddev": lambda vs, a: None if (var := _variance(vs)) is None else math.sqrt(var),
    "last": lambda vs, a: vs[-1] if vs else None,
    "last_n": lambda vs, a: vs[::-1][: a.n],
}

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda x, y: x == y, "!=": lambda x, y: x != y, "<": lambda x, y: x < y, "<=": lambda x, y: x <= y,
    ">": lambda x, y: x > y, ">=": lambda x, y: x >= y, "in": lambda x, y: x in y, "not in": lambda x, y: x not in y,
}


class WindowEvaluator:
    """Computes a fixed list of a view's aggregations from its events at a lookup time."""

    def __init__(self, view: FeatureView, aggregations: Sequence[Aggregation]):
        columns = [f.name for f in view.schema]
        self.aggregations = list(aggregations)
        self.windows_us = [a.window // _MICRO for a in self.aggregations]
        self.longest_us = max(self.windows_us)
        # per aggregation: index of its column (None: the event itself), and its filter
        self.columns = [columns.index(a.column) if a.column else None for a in self.aggregations]
        self.filters: list[Callable[[list[Any]], bool] | None] = []
        for a in self.aggregations:
            if a.where is None:
                self.filters.append(None)
                continue
            column, op, value = a.where
            i, test = columns.index(column), _OPS[op]
            self.filters.append(lambda row, i=i, test=test, value=value: row[i] is not None and bool(test(row[i], value)))
        self.empty = [_empty(a, view.field(a.output_name).dtype.name) for a in self.aggregations]

    def evaluate(self, events: Sequence[Event], now_us: int) -> tuple[list[Any], list[str]]:
        """Values and statuses at ``now_us``: NOT_FOUND when the window has no events (the value
        is then the function's empty value), NULL_VALUE when it has some but the result is null."""
        values, statuses = [], []
        for agg, window, column, keep, empty in zip(self.aggregations, self.windows_us, self.columns, self.filters, self.empty):
            low = now_us - window
            rows = [row for ts, row in events if low < ts <= now_us and (keep is None or keep(row))]
            if not rows:
                values.append(empty)
                statuses.append(NOT_FOUND)
                continue
            picked = [1] * len(rows) if column is None else [row[column] for row in rows if row[column] is not None]
            value = _REDUCERS[agg.function](picked, agg) if picked else empty
            values.append(value)
            statuses.append(NULL_VALUE if value is None else PRESENT)
        return values, statuses


def _empty(agg: Aggregation, output_type: str) -> Any:
    if agg.function in ("count", "count_distinct", "sum"):
        return 0.0 if output_type == "Float64" else 0
    return [] if agg.function == "last_n" else None

