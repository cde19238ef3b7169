"""Windowed aggregations: one rule, two evaluators.

The value of an ``Aggregation`` at time t aggregates the entity's events with event time in
``(t - window, t]``, each event counted once. **Event ids**: a write of an event id is a
duplicate, and is dropped, when an earlier write of the same id for the entity lies less than
the view's dedup window away in event time (``dedup_us``); the first write wins. By default
that is its longest window: two writes of one id further apart can never fall in one window, so
no window counts an id twice, and an id reused after that long is a new event on both paths
(online keeps the write times of ids that long beyond its events for this). A shorter
``dedup_window`` (retries and corrections arrive within it) keeps fewer past writes online; an
id written again further apart counts in a window holding both. Writes are ordered by run,
then row id: a push's run is its ingest time, kept when its rows are rewritten (backfills, new
versions, compaction, Ray).

- offline (``sql.py``): DuckDB over the view's event history. ``as_of="event"`` puts entity rows
  and events in one stream per entity and evaluates each window as a RANGE frame ending at the
  row (O(n log n), no per-row Python); ``as_of="created"`` also needs ``created <= t`` and uses
  a range join grouped per entity row.
- online (``evaluate.py``): Redis keeps each entity's events of the last ``longest window +
  retention`` in a sorted set by event time (added once per event id, first write wins, in one
  Lua call per batch), the events of ended tiles packed into blocks (``online.packed``); a lookup
  reads its window in the same round trip as the other views and aggregates it in Python. A
  heavy entity reads tile summaries and the events at the window's edges instead (``tiles.py``),
  with the same result.

Counts, min, max, last, last-N and distinct counts agree exactly; integer sums too (a sum
past Int64's range is an ``AggregationOverflow`` naming the aggregation, on both paths). Float
sums and means are the exact sum rounded once on both paths (``math.fsum`` online; offline a
128-bit integer sum of the values scaled by a power of two, see ``sql.py``): the same bits,
whenever a column's nonzero magnitudes lie within a factor of 2^40 of each other (up to 2^32
rows); beyond that offline falls back to DuckDB's compensated ``fsum``. A zero sum, min or max
is +0.0. Variances and standard deviations are computed in two passes on both paths (the exact
mean, then the compensated sum of squared deviations in (time, id) order) and agree within
``FLOAT_TOLERANCE`` relative, which the consistency check applies and reports.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from featurestore.aggregation.functions import FUNCTIONS
from featurestore.errors import FeatureStoreError

if TYPE_CHECKING:  # definitions import this package's functions
    from featurestore.definitions import Aggregation, FeatureView

FLOAT_TOLERANCE = 1e-9


class AggregationOverflow(FeatureStoreError):
    """An integer sum left Int64's range (both paths raise it, naming the aggregation)."""


def overflow_message(view: str, agg: Aggregation) -> str:
    return (
        f"aggregation {agg.output_name!r} of view {view!r}: the sum of {agg.column!r} leaves Int64's range; "
        "sum a Float64 column instead (cast it in the source or a transformation)"
    )


def dedup_us(view: FeatureView) -> int:
    """How far apart (µs of event time) two writes of one event id must be to be two events: the
    view's ``dedup_window``, by default its longest window."""
    return (view.dedup_window or view.longest_window) // timedelta(microseconds=1)


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
    return FUNCTIONS[agg.function].sums and view.field(agg.output_name).dtype.name == "Float64"
