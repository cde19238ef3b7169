"""Offline windowed aggregation in DuckDB: the CTEs ``retrieval.historical`` joins per view.

Each CTE yields one row per entity row (``__fs_row``) that has events, with the *parts* of
each requested aggregate (``<output>__<part>``); ``output_sql`` turns the parts into the
feature (the empty value where the row had no events: 0 for counts and sums, ``[]`` for
last-N, null otherwise).

``as_of="event"``: entity rows are put in the same stream as the view's events (UNION ALL),
partitioned by the join keys and ordered by time; every window is a RANGE frame
``[t - window + 1 µs, t]`` (= ``(t - window, t]`` on microsecond times) that includes the
events at exactly t (RANGE peers). Entity rows carry null values, so aggregates see events
only. DuckDB evaluates each frame with a segment tree: O(n log n) over entity rows + events.

``as_of="created"``: events must also have ``created_timestamp <= t``; a range join over the
longest window, grouped per entity row, with one FILTER per window.

Variances and standard deviations are computed in two passes over a range join in both modes
(the window's mean, then the compensated sum of squared deviations in (time, id) order), as
online: one pass over sums of squares loses the variance at a large offset, and its result
depended on the evaluation order.

Each function's SQL is its class's (``aggregation.functions``); float sums and means are exact,
from a scan of the column (``scale_scan_sql``, then ``exact_sum``).
"""

from __future__ import annotations

from datetime import timedelta

from featurestore.aggregation import dedup_us, event_id_sql, overflow_message
from featurestore.aggregation.exact_sum import SumScale, float_sum
from featurestore.aggregation.functions import FUNCTIONS, OnePass, SqlInput, SqlOutput, TwoPass
from featurestore.aggregation.where import where_sql
from featurestore.definitions import Aggregation, FeatureView
from featurestore.sources import ident, quote
from featurestore.types import DType, duckdb_type

ROW, TS = "__fs_row", "__fs_ts"


def scale_scan_sql(column: str, relation: str) -> str:
    """One row: (rows, smallest and largest binary exponent of the nonzero finite values, non-finite
    count), what ``exact_sum.sum_scale`` takes."""
    c = f"CAST({ident(column)} AS DOUBLE)"
    finite = f"{c} <> 0 AND isfinite({c})"
    return (
        f"SELECT count(*), min(floor(log2(abs({c})))) FILTER (WHERE {finite}), "
        f"max(floor(log2(abs({c})))) FILTER (WHERE {finite}), count(*) FILTER (WHERE NOT isfinite({c})) FROM {relation}"
    )


def _value(agg: Aggregation, prefix: str, stored: dict[str, DType]) -> str:
    """The aggregated expression: the column (or the event id, for a column-less count), filtered."""
    target = prefix + (ident(agg.column) if agg.column else "__eid")
    if agg.column and stored[agg.column].name == "Bool" and FUNCTIONS[agg.function].numeric:
        target = f"CAST({target} AS INTEGER)"
    cond = where_sql(agg.where, stored[agg.where[0]] if agg.where else None, prefix)
    return f"CASE WHEN {cond} THEN {target} END" if cond else target


def _is_float(agg: Aggregation, stored: dict[str, DType]) -> bool:
    return agg.column is not None and stored[agg.column].name in ("Float32", "Float64")


def parts(
    agg: Aggregation, stored: dict[str, DType], scales: dict[str, SumScale | None], prefix: str, ev: str, over: str
) -> list[tuple[str, str]]:
    """``(part, SQL aggregate)`` of a one-pass ``Aggregation``, ``over`` (an OVER or FILTER clause) applied."""
    function = FUNCTIONS[agg.function]
    assert isinstance(function, OnePass), agg.function
    value = _value(agg, prefix, stored)
    order = f"CASE WHEN {value} IS NOT NULL THEN {{'t': {prefix}{ev}, 'i': {prefix}__eid}} END"
    return function.sql_parts(
        SqlInput(value, order, over, _is_float(agg, stored), scales.get(agg.column or ""), int(agg.n or 1))
    )


def output_sql(view: FeatureView, agg: Aggregation, alias: str) -> str:
    """The feature column of one aggregate from its parts in ``alias``, with the empty value
    where the row had no events."""
    stored = {f.name: f.dtype for f in view.schema}
    return FUNCTIONS[agg.function].sql_output(
        SqlOutput(
            part=lambda part: f"{alias}.{ident(f'{agg.output_name}__{part}')}",
            is_float=_is_float(agg, stored),
            output_type=duckdb_type(view.field(agg.output_name).dtype),
            overflow=quote(overflow_message(view.name, agg)),
        )
    )


def _micros(agg: Aggregation) -> int:
    return agg.window // timedelta(microseconds=1)


def events_cte(view: FeatureView, hist: str, name: str) -> str:
    """The view's events as both stores count them: a write of an event id is a duplicate, and
    dropped, when an earlier write (by run, then row id) of the same id for the entity is less
    than the longest window away in event time (``aggregation.dedup_us``). Only ids written more
    than once are compared (a hash aggregate finds them): the usual history has none. A row is
    its ``_row_id`` (unique in a history table)."""
    keys = ", ".join(ident(k) for k in view.join_keys)
    columns = ", ".join(ident(f.name) for f in view.schema)
    same = " AND ".join(f"b.{ident(k)} = a.{ident(k)}" for k in view.join_keys)
    within = dedup_us(view)
    eid = event_id_sql(view)
    # each CTE below is read once (DuckDB keeps a CTE read twice in memory): the history is scanned
    # three times instead, the last time for the events themselves
    return f"""{name}_ids AS (SELECT {keys}, {eid} AS __eid FROM {hist} GROUP BY ALL HAVING count(*) > 1),
    {name}_twice AS MATERIALIZED (SELECT * FROM (SELECT {keys}, {eid} AS __eid, _run_id AS __run, _row_id AS __rid,
        epoch_us(event_timestamp) AS __us FROM {hist}) SEMI JOIN {name}_ids USING ({keys}, __eid)),
    {name}_dropped AS (SELECT DISTINCT a.__rid FROM {name}_twice a JOIN {name}_twice b ON {same} AND b.__eid = a.__eid
        AND (b.__run < a.__run OR (b.__run = a.__run AND b.__rid < a.__rid)) AND b.__us > a.__us - {within} AND b.__us < a.__us + {within}),
    {name} AS (SELECT {keys}, CAST(event_timestamp AS TIMESTAMP) AS __ev, CAST(created_timestamp AS TIMESTAMP) AS __created,
        {eid} AS __eid, {columns} FROM {hist} h ANTI JOIN {name}_dropped d ON h._row_id = d.__rid)"""


def _variance_ctes(
    view: FeatureView,
    aggs: list[Aggregation],
    events: str,
    alias: str,
    as_of: str,
    stored: dict[str, DType],
    scales: dict[str, SumScale | None],
) -> list[str]:
    """``alias(__fs_row, <output>__v ...)``: each variance (or its root) in two passes over the
    events of the entity row's window (a range join), as ``aggregation.evaluate`` computes it."""
    longest = max(_micros(a) for a in aggs)
    on = " AND ".join(
        [f"e.{ident(k)} = h.{ident(k)}" for k in view.join_keys]
        + [f"h.__ev <= e.{TS}", f"h.__ev > e.{TS} - INTERVAL ({longest}) MICROSECONDS"]
        + ([f"h.__created <= e.{TS}"] if as_of == "created" else [])
    )
    means, finals = [], []
    for k, agg in enumerate(aggs):
        v = f"CAST({_value(agg, 'h.', stored)} AS DOUBLE)"
        in_window = f"FILTER (WHERE h.__ev > e.{TS} - INTERVAL ({_micros(agg)}) MICROSECONDS)"
        over = f"{in_window} OVER (PARTITION BY e.{ROW})"  # the mean as online: the window's exact sum over its count
        means.append(f"{float_sum(v, scales.get(agg.column or ''), over)} / count({v}) {over} AS __m{k}")
        finals.append((agg, f"power(__v{k} - __m{k}, 2)", f"FILTER (WHERE __in{k})"))
    flags = ", ".join(
        f"{_value(agg, 'h.', stored)} AS __v{k}, h.__ev > e.{TS} - INTERVAL ({_micros(agg)}) MICROSECONDS AS __in{k}"
        for k, agg in enumerate(aggs)
    )
    selects = []
    for k, (agg, square, where) in enumerate(finals):
        n = f"count(__v{k}) {where}"
        variance = f"CASE WHEN {n} >= 2 THEN fsum({square} ORDER BY __ev, __eid) {where} / ({n} - 1) END"
        function = FUNCTIONS[agg.function]
        assert isinstance(function, TwoPass), agg.function
        selects.append(f"{function.from_variance_sql(variance)} AS {ident(agg.output_name + '__v')}")
    return [
        f"""{alias}_vj AS (SELECT e.{ROW}, h.__ev, h.__eid, {flags}, {", ".join(means)}
            FROM __entities e JOIN {events} h ON {on})""",
        f"{alias} AS (SELECT {ROW}, {', '.join(selects)} FROM {alias}_vj GROUP BY {ROW})",
    ]


def view_ctes(
    view: FeatureView,
    aggs: list[Aggregation],
    hist: str,
    alias: str,
    key_types: dict[str, DType],
    as_of: str,
    scales: dict[str, SumScale | None] | None = None,
) -> list[str]:
    """CTEs ending in ``alias(__fs_row, <parts of each aggregate>)``."""
    scales = scales or {}
    stored = {f.name: f.dtype for f in view.schema}
    events = f"{alias}_ev"
    ctes = [events_cte(view, hist, events)]
    keys = view.join_keys
    variances = [a for a in aggs if isinstance(FUNCTIONS[a.function], TwoPass)]
    others = [a for a in aggs if not isinstance(FUNCTIONS[a.function], TwoPass)]
    built = []
    if variances:
        ctes += _variance_ctes(view, variances, events, f"{alias}_var", as_of, stored, scales)
        built.append(f"{alias}_var")
    if others and as_of == "event":
        entity_keys = ", ".join(f"CAST({ident(k)} AS {duckdb_type(key_types[k])}) AS {ident(k)}" for k in keys)
        ctes.append(
            f"""{alias}_u AS (SELECT {entity_keys}, {TS} AS __ev, {ROW} FROM __entities
            UNION ALL BY NAME SELECT *, NULL::BIGINT AS {ROW} FROM {events})"""
        )
        windows = sorted({_micros(a) for a in others})
        partition = ", ".join(ident(k) for k in keys)
        frames = ", ".join(
            f"w{w} AS (PARTITION BY {partition} ORDER BY __ev RANGE BETWEEN INTERVAL ({w - 1}) MICROSECONDS PRECEDING AND CURRENT ROW)"
            for w in windows
        )
        computed, named = _shared([(a, parts(a, stored, scales, "", "__ev", f"OVER w{_micros(a)}")) for a in others])
        ctes.append(
            f"""{alias}_parts AS (SELECT {ROW}, {computed} FROM {alias}_u WINDOW {frames} QUALIFY {ROW} IS NOT NULL)"""
        )
        ctes.append(f"{alias}_win AS (SELECT {ROW}, {named} FROM {alias}_parts)")
        built.append(f"{alias}_win")
    elif others:
        longest = max(_micros(a) for a in others)
        on = " AND ".join(
            [f"e.{ident(k)} = h.{ident(k)}" for k in keys]
            + [f"h.__ev <= e.{TS}", f"h.__ev > e.{TS} - INTERVAL ({longest}) MICROSECONDS", f"h.__created <= e.{TS}"]
        )
        computed, named = _shared(
            [
                (
                    a,
                    parts(
                        a,
                        stored,
                        scales,
                        "h.",
                        "__ev",
                        f"FILTER (WHERE h.__ev > e.{TS} - INTERVAL ({_micros(a)}) MICROSECONDS)",
                    ),
                )
                for a in others
            ]
        )
        ctes.append(
            f"{alias}_parts AS (SELECT e.{ROW}, {computed} FROM __entities e JOIN {events} h ON {on} GROUP BY e.{ROW})"
        )
        ctes.append(f"{alias}_win AS (SELECT {ROW}, {named} FROM {alias}_parts)")
        built.append(f"{alias}_win")
    if len(built) == 1:
        ctes.append(f"{alias} AS (SELECT * FROM {built[0]})")
    else:
        ctes.append(f"{alias} AS (SELECT * FROM {built[0]} FULL JOIN {built[1]} USING ({ROW}))")
    return ctes


def _shared(by_aggregation: list[tuple[Aggregation, list[tuple[str, str]]]]) -> tuple[str, str]:
    """Each distinct part computed once (a mean and a sum of one column and window share their sum,
    a mean and a count their count), then named per aggregation: (computing select, naming select)."""
    columns: dict[str, str] = {}
    names = []
    for agg, agg_parts in by_aggregation:
        for part, sql in agg_parts:
            column = columns.setdefault(sql, f"__p{len(columns)}")
            names.append(f"{column} AS {ident(f'{agg.output_name}__{part}')}")
    return ", ".join(f"{sql} AS {column}" for sql, column in columns.items()), ", ".join(names)


def needs_scale(view: FeatureView, aggs: list[Aggregation]) -> list[str]:
    """The float columns whose exact sums (sums, means, the means of variances) need a ``SumScale``."""
    stored = {f.name: f.dtype for f in view.schema}
    return sorted({a.column for a in aggs if FUNCTIONS[a.function].sums and a.column and _is_float(a, stored)})
