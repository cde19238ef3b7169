"""The assembly of an online lookup: Redis replies decoded into the response.

Latest values get their statuses (``NOT_FOUND``, also for a value stamped after a lookup's
``at``, which a historical query at that time cannot see; ``OUTSIDE_MAX_AGE`` past the view's
ttl, ``NULL_VALUE``); windowed aggregates are evaluated at the lookup time from the events read, or
for a heavy entity from its tile summaries and edge events (whose whole tiles it summarizes for
the next lookups: ``query.seals``); request-time features are computed last.
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime
from itertools import repeat
from typing import Any

from featurestore.aggregation import tiles
from featurestore.online.codec import micros_to_datetime
from featurestore.retrieval.on_demand import finish_columns
from featurestore.retrieval.online.plan import OnlineQuery, _ViewPlan, _WindowPlan, is_tiled
from featurestore.retrieval.online.response import NULL_VALUE, PRESENT, OnlineResponse


def assemble(query: OnlineQuery, raw: list) -> OnlineResponse:
    """Decode what ``read(query.lookups, query.ranges)`` returned (heavy ranges: their tile reads) into the response."""
    now_us, template = query.now_us, query.template
    n = len(query.key_columns[0])
    values: list[list[Any]] = []
    statuses: list[list[str]] = []
    times: list[list[datetime | None]] = []
    for plan in template.views:
        v, st, t = _view_columns(query, plan, raw, now_us)
        values += v
        statuses += st
        times += t
    if template.windows:
        events = raw[len(query.lookups) :]  # per range: its events, or [summaries, events]
        for window, slots in zip(template.windows, query.range_slots):
            v, st, t = _window_columns(query, window, slots, events, now_us)
            values += v
            statuses += st
            times += t
    order = template.order
    if order is not None:
        values, statuses, times = (
            [values[i] for i in order],
            [statuses[i] for i in order],
            [times[i] for i in order],
        )
    keys = len(query.key_columns)
    no_times: list[list[datetime | None]] = list(map(list, repeat([None] * n, keys)))  # join keys have no event time
    response = OnlineResponse(
        list(template.names),
        list(map(list, query.key_columns)) + values,
        list(map(list, repeat([PRESENT] * n, keys))) + statuses,
        no_times + times,
    )
    return _with_on_demand(query, response) if query.on_demand is not None else response


def _with_on_demand(query: OnlineQuery, base: OnlineResponse) -> OnlineResponse:
    """The requested columns: stored ones from ``base``, request-time ones computed from it."""
    plan, keys = query.on_demand, len(query.key_names)
    assert plan is not None
    n = len(query.key_columns[0])
    by_name = {name: i for i, name in enumerate(base.feature_names)}
    computed = plan.compute(
        {**(query.request_columns or {}), **{name: base.values[i] for name, i in by_name.items()}}, n
    )
    response = OnlineResponse(
        base.feature_names[:keys], base.values[:keys], base.statuses[:keys], base.event_timestamps[:keys]
    )
    for name, column in finish_columns(plan, lambda full: by_name[full], computed):
        if isinstance(column, int):  # a stored feature: its values, statuses and times as read
            response.feature_names.append(name)
            response.values.append(base.values[column])
            response.statuses.append(base.statuses[column])
            response.event_timestamps.append(base.event_timestamps[column])
        else:
            values = column.to_pylist()
            response.feature_names.append(name)
            response.values.append(values)
            response.statuses.append([PRESENT if v is not None else NULL_VALUE for v in values])
            response.event_timestamps.append([None] * n)
    return response


def _window_columns(query: OnlineQuery, plan: _WindowPlan, slots: list[int], events: list, now_us: int):
    evaluate = plan.evaluator.evaluate
    results: dict[int, tuple[list[Any], list[str], datetime | None]] = {}
    row_values: list[Any] = []
    row_statuses: list[Any] = []
    row_times: list[datetime | None] = []
    low = now_us - plan.evaluator.longest_us
    for pos in slots:
        result = results.get(pos)
        if result is None:
            reply = events[pos]
            if is_tiled(reply):  # a heavy entity: [summaries, runs of events]
                result = results[pos] = _tiled(query, plan, query.ranges[pos][0], reply, low, now_us)
            else:
                limit = query.ranges[pos][3]
                if limit is not None and len(reply) >= limit:  # (a partial read: never evaluate it)
                    raise RuntimeError("a heavy entity's window reads tile summaries: answer queries with OnlineReader")
                times, columns = plan.events(reply, low, now_us)
                vals, stats = evaluate(times, columns, now_us)
                result = results[pos] = (vals, stats, micros_to_datetime(times[-1]) if times else None)
        row_values.append(result[0])
        row_statuses.append(result[1])
        row_times.append(result[2])
    width = len(plan.evaluator.aggregations)
    return (
        list(map(list, zip(*row_values))),
        list(map(list, zip(*row_statuses))),
        list(map(list, repeat(row_times, width))),
    )


def _tiled(query: OnlineQuery, plan: _WindowPlan, key: bytes, reply: list, low: int, now_us: int):
    """One heavy entity's aggregates from its tile summaries and edge events; the tiles it read
    whole are summarized for the next lookups (``seals``)."""
    tiled = plan.tiled
    assert tiled is not None
    flat, runs = reply
    members = list(itertools.chain.from_iterable(runs))
    summaries = dict(zip(map(int, flat[::2]), tiled.decode(flat[1::2])))
    times, columns = plan.events(
        members, low, now_us, skip_tiles=summaries.keys()
    )  # (blocks hold summarized tiles too)
    vals, stats = tiles.evaluate_tiled(
        tiled,
        plan.wanted,
        plan.evaluator.windows_us,
        {t: s[1] for t, s in summaries.items()},
        times,
        columns,
        now_us,
    )
    newest = max(([times[-1]] if times else []) + [s[0] for s in summaries.values()], default=None)
    size = tiled.spec.tile_us
    cut = {c // size for c in plan.cuts(now_us)}
    sealed = tiles.seals(tiled, times, columns, cut, time.time_ns() // 1000)
    if sealed:
        query.seals.append((key, size, sealed))
    return vals, stats, micros_to_datetime(newest) if newest is not None else None


def _view_columns(query: OnlineQuery, plan: _ViewPlan, raw: list, now_us: int):
    width, decode, ttl_us, position = plan.width, plan.decode, plan.ttl_us, plan.position
    cutoff = now_us - ttl_us if ttl_us is not None else None
    blank, not_found, outside, present = plan.blank, plan.not_found, plan.outside, plan.present
    row_values: list[Any] = []
    row_statuses: list[Any] = []
    row_times: list[datetime | None] = []
    for pos in query.slots[plan.group]:
        blob = raw[pos][position]
        if blob is not None:
            event_us, decoded = decode(blob)
        # never written, or stamped after a replay's `at`: not known then (at now, a row stamped
        # ahead within future_tolerance, the clocks' skew, is served)
        if blob is None or (query.replayed and event_us > now_us):
            row_values.append(blank)
            row_statuses.append(not_found)
            row_times.append(None)
            continue
        row_times.append(micros_to_datetime(event_us))
        if cutoff is not None and event_us < cutoff:
            row_values.append(blank)
            row_statuses.append(outside)
        else:
            row_values.append(decoded)
            row_statuses.append(
                present if None not in decoded else [NULL_VALUE if v is None else PRESENT for v in decoded]
            )
    # rows -> columns in C (zip, map), not value by value in Python
    return (
        list(map(list, zip(*row_values))),
        list(map(list, zip(*row_statuses))),
        list(map(list, repeat(row_times, width))),
    )
