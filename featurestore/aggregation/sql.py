"""Offline windowed aggregation in DuckDB: the CTEs ``retrieval.historical`` joins per view.

Each CTE yields one row per entity row (``__fs_row``) that has events, with one column per
requested aggregate; the caller left-joins it and fills the empty values (0 for counts and
sums, ``[]`` for last-N, null otherwise).

``as_of="event"``: entity rows are put in the same stream as the view's events (UNION ALL),
partitioned by the join keys and ordered by time; every window is a RANGE frame
``[t - window + 1 µs, t]`` (= ``(t - window, t]`` on microsecond times) that includes the
events at exactly t (RANGE peers). Entity rows carry null values, so aggregates see events
only. DuckDB evaluates each frame with a segment tree: O(n log n) over entity rows + events.

``as_of="created"``: events must also have ``created_timestamp <= t``; a range join over the
longest window, grouped per entity row, with one FILTER per window.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from featurestore.aggregation import event_id_sql
from featurestore.definitions import Aggregation, FeatureView
from featurestore.sources import ident, quote
from featurestore.types import DType, duckdb_type

ROW, TS = "__fs_row", "__fs_ts"


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return quote(value)
    raise TypeError(f"where-values must be numbers, strings or booleans, not {type(value).__name__}")


def where_sql(where: tuple[str, str, Any] | None, prefix: str = "") -> str | None:
    if where is None:
        return None
    column, op, value = where
    col = prefix + ident(column)
    if op in ("in", "not in"):
        items = ", ".join(_literal(v) for v in value)
        return f"COALESCE({col} {op.upper()} ({items}), FALSE)"
    return f"COALESCE({col} {'=' if op == '==' else op} {_literal(value)}, FALSE)"


def _value(agg: Aggregation, prefix: str) -> str:
    """The aggregated expression: the column (or the event id, for a column-less count), filtered."""
    target = prefix + (ident(agg.column) if agg.column else "__eid")
    cond = where_sql(agg.where, prefix)
    return f"CASE WHEN {cond} THEN {target} END" if cond else target


def aggregate_sql(agg: Aggregation, output: DType, prefix: str, ev: str, over: str) -> str:
    """The SQL aggregate of one ``Aggregation``, ``over`` (an OVER or FILTER clause) applied."""
    sql = f"{_call(agg, prefix, ev, output.name == 'Float64')} {over}"
    if agg.function == "mean":  # fsum / count, as online
        return f"({sql} / NULLIF(count({_value(agg, prefix)}) {over}, 0))"
    return f"CAST({sql} AS {duckdb_type(output)})" if agg.function == "sum" else sql


def _call(agg: Aggregation, prefix: str, ev: str, float_input: bool) -> str:
    v = _value(agg, prefix)
    order = f"CASE WHEN {v} IS NOT NULL THEN {{'t': {prefix}{ev}, 'i': {prefix}__eid}} END"
    f = agg.function
    if f == "count":
        return f"count({v})"
    if f == "count_distinct":
        return f"count(DISTINCT {v})"
    if f == "sum":  # compensated for floats, like math.fsum online: the two agree to the bit in practice
        return f"fsum({v})" if float_input else f"sum({v})"
    if f == "mean":
        return f"fsum(CAST({v} AS DOUBLE))"
    if f == "stddev":
        return f"stddev_samp({v})"
    if f == "variance":
        return f"var_samp({v})"
    if f in ("min", "max"):
        return f"{f}({v})"
    if f == "last":
        return f"arg_max({v}, {order})"
    if f == "last_n":
        return f"max_by({v}, {order}, {int(agg.n or 1)})"
    raise ValueError(f"unknown aggregation function {f!r}")


def empty_value(agg: Aggregation, output: DType) -> str | None:
    """What a window without events yields, as SQL (None: null)."""
    if agg.function in ("count", "count_distinct", "sum"):
        return f"CAST(0 AS {duckdb_type(output)})"
    if agg.function == "last_n":
        return f"CAST([] AS {duckdb_type(output)})"
    return None


def _micros(agg: Aggregation) -> int:
    return agg.window // timedelta(microseconds=1)


def events_cte(view: FeatureView, hist: str, name: str) -> str:
    """The view's events, one per event id (the first stored wins, as online)."""
    keys = ", ".join(ident(k) for k in view.join_keys)
    columns = ", ".join(ident(f.name) for f in view.schema)
    return f"""{name} AS (SELECT {keys}, CAST(event_timestamp AS TIMESTAMP) AS __ev, CAST(created_timestamp AS TIMESTAMP) AS __created,
        {event_id_sql(view)} AS __eid, {columns} FROM {hist}
        QUALIFY row_number() OVER (PARTITION BY {keys}, __eid ORDER BY _run_id, _row_id) = 1)"""


def view_ctes(
    view: FeatureView, aggs: list[Aggregation], hist: str, alias: str, key_types: dict[str, DType], as_of: str,
) -> list[str]:
    """CTEs ending in ``alias(__fs_row, <aggregate columns named by output name>)``."""
    outputs = {a.output_name: view.field(a.output_name).dtype for a in aggs}
    events = f"{alias}_ev"
    ctes = [events_cte(view, hist, events)]
    keys = view.join_keys
    if as_of == "event":
        entity_keys = ", ".join(f"CAST({ident(k)} AS {duckdb_type(key_types[k])}) AS {ident(k)}" for k in keys)
        ctes.append(
            f"""{alias}_u AS (SELECT {entity_keys}, {TS} AS __ev, {ROW} FROM __entities
            UNION ALL BY NAME SELECT *, NULL::BIGINT AS {ROW} FROM {events})"""
        )
        windows = sorted({_micros(a) for a in aggs})
        partition = ", ".join(ident(k) for k in keys)
        frames = ", ".join(
            f"w{w} AS (PARTITION BY {partition} ORDER BY __ev RANGE BETWEEN INTERVAL ({w - 1}) MICROSECONDS PRECEDING AND CURRENT ROW)"
            for w in windows
        )
        selects = ", ".join(
            f"{aggregate_sql(a, outputs[a.output_name], '', '__ev', f'OVER w{_micros(a)}')} AS {ident(a.output_name)}" for a in aggs
        )
        ctes.append(f"""{alias} AS (SELECT {ROW}, {selects} FROM {alias}_u WINDOW {frames} QUALIFY {ROW} IS NOT NULL)""")
    else:
        longest = max(_micros(a) for a in aggs)
        on = " AND ".join(
            [f"e.{ident(k)} = h.{ident(k)}" for k in keys]
            + [f"h.__ev <= e.{TS}", f"h.__ev > e.{TS} - INTERVAL ({longest}) MICROSECONDS", f"h.__created <= e.{TS}"]
        )
        selects = ", ".join(
            aggregate_sql(a, outputs[a.output_name], "h.", "__ev", f"FILTER (WHERE h.__ev > e.{TS} - INTERVAL ({_micros(a)}) MICROSECONDS)")
            + f" AS {ident(a.output_name)}"
            for a in aggs
        )
        ctes.append(f"{alias} AS (SELECT e.{ROW}, {selects} FROM __entities e JOIN {events} h ON {on} GROUP BY e.{ROW})")
    return ctes


def output_sql(agg: Aggregation, output: DType, alias: str) -> str:
    """The result column for one aggregate, with the empty value where the row had no events."""
    column = f"{alias}.{ident(agg.output_name)}"
    empty = empty_value(agg, output)
    return f"COALESCE({column}, {empty})" if empty else column
