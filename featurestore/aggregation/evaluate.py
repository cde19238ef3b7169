"""Online windowed aggregation: the aggregates of a view at the lookup time, from its events.

Events come in (event time, event id) order (the order of Redis's sorted set)
— the order the offline ``last`` and ``last_n`` use — and each aggregate keeps those with event
time in ``(now - window, now]``, passing its ``where`` filter (``aggregation.where``); each
function reduces them as its class says (``aggregation.functions``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from featurestore.aggregation import AggregationOverflow, overflow_message
from featurestore.aggregation.functions import FUNCTIONS
from featurestore.aggregation.where import predicate, typed_value
from featurestore.definitions import Aggregation, FeatureView

PRESENT, NOT_FOUND, NULL_VALUE = "PRESENT", "NOT_FOUND", "NULL_VALUE"

_MICRO = timedelta(microseconds=1)

Filter = tuple[int, Callable[[Any], bool]]  # (column index, test of a non-null value)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def checked(value: Any, view: str, agg: Aggregation) -> Any:
    """A value, if it is not an integer past Int64's range (only a sum can be: offline raises the same error)."""
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise AggregationOverflow(overflow_message(view, agg))
    return value


class WindowEvaluator:
    """Computes a fixed list of a view's aggregations from its events at a lookup time."""

    def __init__(self, view: FeatureView, aggregations: Sequence[Aggregation]):
        columns = [f.name for f in view.schema]
        stored = {f.name: f.dtype for f in view.schema}
        self.view = view.name
        self.aggregations = list(aggregations)
        self.functions = [FUNCTIONS[a.function] for a in self.aggregations]
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
        self.empty = [fn.empty(view.field(a.output_name).dtype) for a, fn in zip(self.aggregations, self.functions)]

    def evaluate(self, times: list[int], columns: dict[int, list[Any]], now_us: int) -> tuple[list[Any], list[str]]:
        """Values and statuses at ``now_us`` of events given as columns (``times`` ascending, as
        Redis's sorted set orders them; ``columns``: stored column index -> values, at least
        ``needed``). NOT_FOUND when the window has no events (the value is then the function's
        empty value), NULL_VALUE when it has some but the result is null."""
        values, statuses = [], []
        end = bisect.bisect_right(times, now_us)
        for agg, function, window, column, where, empty in zip(
            self.aggregations, self.functions, self.windows_us, self.columns, self.filters, self.empty
        ):
            start = bisect.bisect_right(times, now_us - window, 0, end)  # the window is (now - window, now]
            count, picked = pick(columns, column, where, start, end)
            if not count:
                values.append(empty)
                statuses.append(NOT_FOUND)
                continue
            if picked is None:
                picked = [1] * count
            value = checked(function.reduce(picked, agg.n), self.view, agg) if picked else empty
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
