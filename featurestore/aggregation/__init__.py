"""Windowed aggregations: one rule, two evaluators.

The value of an ``Aggregation`` at time t aggregates the entity's events with event time in
``(t - window, t]``, each event counted once (deduplicated by event id, first write wins).

- offline (``sql.py``): DuckDB over the view's event history. ``as_of="event"`` puts entity rows
  and events in one stream per entity and evaluates each window as a RANGE frame ending at the
  row (O(n log n), no per-row Python); ``as_of="created"`` also needs ``created <= t`` and uses
  a range join grouped per entity row.
- online (``evaluate.py``): Redis keeps each entity's events of the last ``longest window +
  retention`` in a sorted set by event time (added once per event id, first write wins, in one
  Lua call per batch); a lookup reads its window in the same round trip as the other views and
  aggregates it in Python. A heavy entity reads tile summaries and the events at the window's
  edges instead (``tiles.py``), with the same result.

Counts, min, max, last, last-N and distinct counts agree exactly; integer sums too. Float
sums and means use compensated summation on both paths (DuckDB's ``fsum``, Python's
``math.fsum``), which agree to the bit in practice; variances and standard deviations are
computed by different algorithms (Welford offline, two-pass online). The guaranteed bound for
these is ``FLOAT_TOLERANCE`` relative, which the consistency check applies and reports.
"""

from __future__ import annotations

from featurestore.definitions import Aggregation, FeatureView

FLOAT_TOLERANCE = 1e-9
INEXACT_FUNCTIONS = frozenset({"sum", "mean", "stddev", "variance"})
WHERE_OPERATORS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in")


def event_id_sql(view: FeatureView, prefix: str = "") -> str:
    """SQL giving each stored event its 63-bit id (the same expression feeds both stores)."""
    if view.event_id is None:  # the event's content: a retried push is the same event, whenever it arrived
        content = [*view.join_keys, "event_timestamp", *(f.name for f in view.schema)]
        return f"(hash({', '.join(prefix + chr(34) + c + chr(34) for c in content)}) >> 1)::BIGINT"
    dtype = next(f.dtype for f in view.schema if f.name == view.event_id)
    column = f'{prefix}"{view.event_id}"'
    if dtype.name in ("Int32", "Int64"):
        return f"CAST({column} AS BIGINT)"
    return f"(hash({column}) >> 1)::BIGINT"


def is_inexact(agg: Aggregation, view: FeatureView) -> bool:
    """Whether the two paths may differ by rounding (float sums, means, variances)."""
    return agg.function in INEXACT_FUNCTIONS and view.field(agg.output_name).dtype.name == "Float64"
