"""Turn a view's rows (registered in DuckDB as ``view_rows``) into typed history rows.

Rows that break the schema (null or mistyped key, null or unparseable timestamp, a value
that does not cast to the declared type) are split off with a reason, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.aggregation import dedup_us, event_id_sql
from featurestore.definitions import FeatureView
from featurestore.online.codec import datetime_to_micros, numpy_values
from featurestore.sources import INGESTED_AT, PUSH_ID, connection, ident, quote, utc_micros_sql
from featurestore.types import DType, duckdb_type


@dataclass
class Computed:
    rows: pa.Table  # history schema, every row valid
    rejects: pa.Table  # reason, raw row as JSON, event time if known


def utc_sql(ts: datetime) -> str:
    """A SQL literal of ``ts`` as naive UTC (naive input is taken as UTC)."""
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC).replace(tzinfo=None)
    return f"TIMESTAMP {quote(ts.isoformat(sep=' '))}"


def compute(
    con: duckdb.DuckDBPyConnection,
    view: FeatureView,
    key_types: dict[str, DType],
    history_schema: pa.Schema,
    run_id: int,
    ingest_time: datetime,
    start: datetime | None = None,
    end: datetime | None = None,
    future_tolerance: timedelta = timedelta(seconds=5),
) -> Computed:
    """Type and identify ``view_rows``; split off rows that break the schema, and rows whose event
    time is more than ``future_tolerance`` after ``ingest_time``: served now, such a row would show
    online what a historical query at now cannot see. Rejected, it is taken once it is due."""
    con.execute("SET TimeZone = 'UTC'")
    ts_col = ident(view.source.timestamp_field)
    created_col = view.source.created_timestamp_field
    types = dict(zip(con.view("view_rows").columns, con.view("view_rows").types))

    def as_ts(column: str) -> str:  # nanoseconds truncated to µs, as stored everywhere
        return utc_micros_sql(ident(column), str(types.get(column, "")).endswith("_NS"), strict=False)

    typed = [f"{as_ts(view.source.timestamp_field)} AS __event"]
    if created_col:
        typed.append(f"{as_ts(created_col)} AS __created")
    elif INGESTED_AT in types:  # a push source's rows know when they arrived: re-pushing a value is a new fact
        typed.append(f"{as_ts(INGESTED_AT)} AS __created")
    else:
        typed.append("NULL::TIMESTAMP AS __created")
    reasons: list[str] = []
    for key, dtype in key_types.items():
        k = ident(key)
        typed.append(f"TRY_CAST({k} AS {duckdb_type(dtype)}) AS __k_{key}")
        reasons += [
            f"WHEN {k} IS NULL THEN 'null join key {key}'",
            f"WHEN __k_{key} IS NULL THEN 'join key {key} is not {dtype.name}'",
        ]
    reasons += [
        f"WHEN {ts_col} IS NULL THEN 'null event timestamp'",
        "WHEN __event IS NULL THEN 'unparseable event timestamp'",
    ]
    if created_col:
        reasons.append(
            f"WHEN {ident(created_col)} IS NOT NULL AND __created IS NULL THEN 'unparseable created timestamp'"
        )
    latest = (ingest_time + future_tolerance).astimezone(UTC)
    reasons.append(
        f"WHEN __event > {utc_sql(latest)} THEN "
        f"'event time is in the future (after {latest.isoformat()}); push it when it is due'"
    )
    if view.event_id:
        reasons.append(f"WHEN {ident(view.event_id)} IS NULL THEN 'null event id {view.event_id}'")
    for f in view.schema:
        c = ident(f.name)
        typed.append(f"TRY_CAST({c} AS {duckdb_type(f.dtype)}) AS __f_{f.name}")
        reasons.append(f"WHEN {c} IS NOT NULL AND __f_{f.name} IS NULL THEN 'feature {f.name} is not {f.dtype.name}'")
    window = []
    if start is not None:
        window.append(f"__event >= {utc_sql(start)}")
    if end is not None:
        window.append(f"__event < {utc_sql(end)}")
    in_window = " AND ".join(window) or "TRUE"
    keys = [f"__k_{k}" for k in key_types]
    feats = [f"__f_{f.name}" for f in view.schema]
    identity = f"(hash({', '.join([*keys, '__event', '__created', *feats])}) >> 1)::BIGINT"
    if PUSH_ID in types and view.transformation is None:  # a push log read as is: the push's own ids
        identity = f"COALESCE({ident(PUSH_ID)}, {identity})"
    # a pushed row keeps its push's run (its ingest time, ``push_run_id``) whenever it is recomputed
    # (a backfill, a new version, Ray): the first write of an event id stays first
    run = f"COALESCE(epoch_us({ident(INGESTED_AT)}), {int(run_id)})" if INGESTED_AT in types else str(int(run_id))
    ingest = utc_sql(ingest_time)
    source_columns = [c for c in con.view("view_rows").columns if not c.startswith("__") and c != PUSH_ID]
    raw_row = "to_json({" + ", ".join(f"{quote(c)}: {ident(c)}" for c in source_columns) + "})::VARCHAR"
    # one query (a push pays DuckDB's per-query cost once): valid rows and rejects, split below
    table = con.sql(
        f"""SELECT {", ".join(f"__k_{k} AS {ident(k)}" for k in key_types)},
            __event AS event_timestamp,
            COALESCE(__created, {ingest}) AS created_timestamp,
            ({run})::BIGINT AS _run_id,
            {identity} AS _row_id,
            {", ".join(f"__f_{f.name} AS {ident(f.name)}" for f in view.schema)},
            __reason, CASE WHEN __reason IS NOT NULL THEN {raw_row} END AS __raw
        FROM (SELECT *, CASE {" ".join(reasons)} END AS __reason
              FROM (SELECT *, {", ".join(typed)} FROM view_rows)
              WHERE __event IS NULL OR ({in_window}))"""
    ).to_arrow_table()
    if table["__reason"].null_count == table.num_rows:  # every row valid (the usual case): no copy
        return Computed(
            table.drop_columns(["__reason", "__raw"]).cast(history_schema), _rejects(table.slice(0, 0), run_id)
        )
    valid = pc.is_null(table["__reason"])
    rows = table.filter(valid).drop_columns(["__reason", "__raw"]).cast(history_schema)
    return Computed(rows, _rejects(table.filter(pc.invert(valid)), run_id))


def pushed_rows(
    table: pa.Table,
    view: FeatureView,
    key_types: dict[str, DType],
    history_schema: pa.Schema,
    ingest_time: datetime,
    future_tolerance: timedelta,
) -> pa.Table | None:
    """``compute``'s result for pushed rows (typed to the push source, with ``INGESTED_AT`` and
    ``PUSH_ID``), in Arrow alone: a push then pays no query. None when a row needs ``compute``'s
    checks to be explained (a null key, time or event id; a future event) or a column needs a cast
    (or a null created time its ingest time)."""
    have = dict(zip(table.schema.names, table.schema.types))
    stored = dict(zip(history_schema.names, history_schema.types))
    for name in [*key_types, *(f.name for f in view.schema)]:
        if have.get(name) != stored[name]:
            return None
    time_column, created_column = view.source.timestamp_field, view.source.created_timestamp_field
    times = [time_column, *([created_column] if created_column else [])]
    must_be_set = [*key_types, *times, *([view.event_id] if view.event_id else [])]
    if any(have.get(c) != stored["event_timestamp"] for c in times) or any(table[c].null_count for c in must_be_set):
        return None
    if max_micros(table[time_column]) > datetime_to_micros(ingest_time + future_tolerance):
        return None
    # a pushed row's run is its ingest time (``push_run_id``), as ``compute`` reads it from the log
    runs = numpy_values(table[INGESTED_AT]).view(np.int64)
    columns = {
        "event_timestamp": table[time_column],
        "created_timestamp": table[created_column or INGESTED_AT],
        "_row_id": table[PUSH_ID],
        "_run_id": pa.array(runs, pa.int64()),
    }
    return pa.Table.from_arrays(
        [columns[name] if name in columns else table[name] for name in history_schema.names], schema=history_schema
    )


def _rejects(bad: pa.Table, run_id: int) -> pa.Table:
    """Reason, run, the raw row as JSON, and an id (hash of reason and row) that dedupes re-runs."""
    if bad.num_rows == 0:
        return pa.table(
            {
                "reason": pa.array([], pa.string()),
                "run_id": pa.array([], pa.int64()),
                "row": pa.array([], pa.string()),
                "reject_id": pa.array([], pa.int64()),
            }
        )
    con = connection()
    con.register("bad", bad.select(["__reason", "__raw"]))
    return con.sql(
        f"""SELECT __reason AS reason, {int(run_id)}::BIGINT AS run_id, __raw AS row,
            (hash(__reason, __raw) >> 1)::BIGINT AS reject_id FROM bad"""
    ).to_arrow_table()


# up to this many rows, ``latest_per_entity`` picks in Python: a query's set-up (a connection, a
# registration) costs more than a small push's whole write (``benchmarks/small_writes.py``)
FEW_ROWS = 256
ORDER = ("event_timestamp", "created_timestamp", "_run_id", "_row_id")  # the join's tie-break, in order


def latest_per_entity(rows: pa.Table, join_keys: list[str]) -> pa.Table:
    """Each entity's newest row by (event, created, run, row id): the join's tie-break order.
    The rows are taken from ``rows`` by position, so every value keeps its bits (a struct through
    DuckDB's ``arg_max`` came back with -0.0 as 0.0)."""
    if rows.num_rows == 0:
        return rows
    if (
        rows.num_rows <= FEW_ROWS
        and not any(pa.types.is_floating(rows.schema.field(k).type) for k in join_keys)  # (a query's key equality)
        and not any(rows[c].null_count for c in (*join_keys, *ORDER))
    ):
        return _latest_of_few(rows, join_keys)
    return _latest_by_query(rows, join_keys)


def _latest_by_query(rows: pa.Table, join_keys: list[str]) -> pa.Table:
    """``latest_per_entity`` through DuckDB's hash aggregate (any size, any key type)."""
    con = connection()
    con.register(
        "r",
        rows.select([*join_keys, *ORDER]).append_column("__i", pa.array(np.arange(rows.num_rows, dtype=np.int64))),
    )
    keys = ", ".join(ident(k) for k in join_keys)
    positions = con.sql(
        f"SELECT arg_max(__i, (event_timestamp, created_timestamp, _run_id, _row_id)) FROM r GROUP BY {keys}"
    )
    return rows.take(positions.to_arrow_table().column(0))


def _latest_of_few(rows: pa.Table, join_keys: list[str]) -> pa.Table:
    """``latest_per_entity`` of a few rows with neither nulls nor float keys, in Python; in the
    rows' order."""
    keys = list(zip(*(rows[k].to_pylist() for k in join_keys)))
    order = list(zip(*(numpy_values(rows[c]).view(np.int64).tolist() for c in ORDER)))
    newest: dict[tuple, int] = {}
    for i, key in enumerate(keys):
        if key not in newest or order[i] > order[newest[key]]:
            newest[key] = i
    return rows if len(newest) == rows.num_rows else rows.take(pa.array(sorted(newest.values())))


def latest_sql(relation: str, join_keys: list[str], columns: list[str]) -> str:
    """SQL for each entity's newest row of ``relation`` (history ``columns``): a hash aggregate, about
    3x faster than ranking every row with a window, one ``arg_max_null`` per column (through a struct,
    -0.0 came back as 0.0)."""
    keys = ", ".join(ident(k) for k in join_keys)
    order = "(event_timestamp, created_timestamp, _run_id, _row_id)"
    picked = ", ".join(
        ident(c) if c in join_keys else f"arg_max_null({ident(c)}, {order}) AS {ident(c)}" for c in columns
    )
    return f"SELECT {picked} FROM {relation} GROUP BY {keys}"


def max_micros(column: pa.ChunkedArray) -> int:
    """The largest µs of a null-free timestamp column, without a compute kernel (see ``codec.numpy_values``)."""
    return int(numpy_values(column).view(np.int64).max())


@dataclass
class EventWrites:
    """An aggregated view's writes to send online, in write order (run, row id): those recent
    enough to count (at or after the cutoff) and, before it, those within one dedup window
    (their ids' write times decide whether a later write of the id is a duplicate)."""

    rows: pa.Table
    ids: np.ndarray  # each write's event id
    accepted: np.ndarray | None = None  # per write, the offline rule's verdict (whole-history resends)


def events_to_add(rows: pa.Table, view: FeatureView, sent_from_us: int, verdicts: bool = False) -> EventWrites:
    """``rows``' writes to send online: those after ``sent_from_us`` less the dedup window (the
    duplicate rule needs no earlier). Redis applies the rule as they arrive, so they go in write order.
    ``verdicts``: ``rows`` are the view's whole history, and each write carries
    whether the rule keeps it (``aggregation.sql.events_cte``): Redis then makes its events match."""
    low = sent_from_us - dedup_us(view)
    ids = _plain_event_ids(rows, view) if view.event_id is not None else None
    if not verdicts and ids is not None and len(np.unique(ids)) == rows.num_rows:  # no id twice: any order, no query
        recent = numpy_values(rows["event_timestamp"]).view(np.int64) > low
        return EventWrites(rows, ids) if recent.all() else EventWrites(rows.filter(recent), ids[recent])
    con = connection()
    con.register("r", rows)
    keep = ""
    if verdicts:
        keys = " AND ".join(f"b.{ident(k)} = a.{ident(k)}" for k in view.join_keys)
        within = dedup_us(view)
        keep = f""", NOT EXISTS (SELECT 1 FROM w b WHERE {keys} AND b.__eid = a.__eid
            AND (b._run_id < a._run_id OR (b._run_id = a._run_id AND b._row_id < a._row_id))
            AND epoch_us(b.event_timestamp) > epoch_us(a.event_timestamp) - {within}
            AND epoch_us(b.event_timestamp) < epoch_us(a.event_timestamp) + {within}) AS __keep"""
    out = con.sql(
        f"""WITH w AS (SELECT *, {event_id_sql(view)} AS __eid FROM r)
        SELECT *{keep} FROM w a WHERE epoch_us(event_timestamp) > {int(low)} ORDER BY _run_id, _row_id"""
    ).to_arrow_table()
    accepted = out["__keep"].to_numpy(zero_copy_only=False) if verdicts else None
    return EventWrites(
        out.drop_columns([c for c in ("__eid", "__keep") if c in out.column_names]).cast(rows.schema),
        out["__eid"].to_numpy(),
        accepted,
    )


def _plain_event_ids(rows: pa.Table, view: FeatureView) -> np.ndarray | None:
    """The ids ``event_id_sql`` computes, when numpy can (an integer id column)."""
    if pa.types.is_integer(rows.schema.field(view.event_id).type):
        return numpy_values(rows[view.event_id]).astype(np.int64)
    return None
