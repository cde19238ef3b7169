"""Point-in-time-correct joins in DuckDB over the views' history tables.

For each entity row at time t and each requested view, the result holds the view's row
with the same join keys and the largest (event time, created time, run, row id) among
rows with ``event_timestamp <= t`` (and, with a ttl, ``>= t - ttl``; both inclusive).
No match gives nulls. Every input row comes out exactly once, in input order.

Plan: each view's history is first reduced to one row per (keys, event time), keeping
the tie-break winner; an ASOF LEFT JOIN then finds the latest row at or before t. With
``as_of="created"`` rows also need ``created_timestamp <= t`` (what the online store
could have known at t), which an ASOF join cannot express: a range join ranked per
entity row is used instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from featurestore.aggregation import AggregationOverflow
from featurestore.aggregation import sql as aggregation_sql
from featurestore.aggregation.exact_sum import sum_scale
from featurestore.definitions import FeatureService
from featurestore.errors import RequestError
from featurestore.offline.base import HistoryReads
from featurestore.registry.loader import Definitions
from featurestore.retrieval.on_demand import OnDemandPlan, finish_columns
from featurestore.retrieval.refs import ViewRequest, resolve
from featurestore.sources import ident, is_nanoseconds, quote, utc_micros_sql
from featurestore.types import castable

if TYPE_CHECKING:
    import pandas as pd

# what a training row may know: facts that happened by t, or facts also recorded by t
AsOf = Literal["event", "created"]

ROW = "__fs_row"
TS = "__fs_ts"
BATCH_ROWS = 256 * 1024


JoinBuilder = Callable[
    ..., Any
]  # RetrievalJob.build's signature: (defs, offline, entity_df, features, service, full_names, as_of, versions)


@dataclass
class RetrievalJob:
    """A prepared join; nothing runs until ``to_arrow``/``to_df``/``to_parquet``/``batches``."""

    con: duckdb.DuckDBPyConnection
    sql: str
    table_versions: dict[str, int | None]  # table version read per view (for manifests)
    history_tables: dict[str, str]  # history table (view version) read per view
    feature_types: dict[str, pa.DataType]  # output feature column -> declared Arrow type
    on_demand: OnDemandPlan | None = None  # request-time features computed on each joined batch
    entity_columns: list[str] | None = None

    @classmethod
    def build(
        cls,
        defs: Definitions,
        offline: HistoryReads,
        entity_df: Any,
        features: Sequence[str] | None,
        feature_service: str | FeatureService | None,
        full_feature_names: bool,
        as_of: AsOf = "event",
        versions: dict[str, int | None] | None = None,
    ) -> RetrievalJob:
        """Prepare the join of ``defs``' views' histories in ``offline`` (at ``versions``, default latest)."""
        if as_of not in get_args(AsOf):
            raise RequestError(f"as_of must be 'event' or 'created', not {as_of!r}")
        on_demand = OnDemandPlan.build(defs, features, feature_service, full_feature_names)
        if on_demand is not None:  # join the stored features it needs, under full names
            features, feature_service, full_feature_names = on_demand.base_refs, None, True
        requests = resolve(defs, features, feature_service, full_feature_names)
        con = duckdb.connect()
        con.execute("SET TimeZone = 'UTC'")
        entity_columns, ts_column = _register_entities(con, entity_df)
        table_versions: dict[str, int | None] = {}
        for i, req in enumerate(requests):
            missing = [k for k in req.view.join_keys if k not in entity_columns]
            if missing:
                raise RequestError(
                    f"entity rows lack join key(s) {missing} needed by view {req.view.name!r}; "
                    f"entity columns are {entity_columns}"
                )
            for key, declared in defs.key_types[req.view.name].items():  # no silent casts: 1 never matches '01'
                given = con.sql(f"SELECT {ident(key)} FROM __entities LIMIT 0").to_arrow_table().schema.field(0).type
                if not castable(given, declared) and not pa.types.is_null(given):
                    raise RequestError(
                        f"join key {key!r} is {declared!r} but the entity rows give {given}; "
                        f"convert the column to {declared!r}"
                    )
            clash = [n for n in req.output_names if n in entity_columns]
            if clash:
                raise RequestError(
                    f"output column(s) {clash} of view {req.view.name!r} clash with entity columns; "
                    "rename those or use full_feature_names=True"
                )
            schema = defs.history_schema(req.view)
            if versions is not None and versions.get(req.view.name) is None:
                con.register(f"__hist{i}", schema.empty_table())  # pinned to "nothing written yet"
                table_versions[req.view.name] = None
            else:
                wanted = versions.get(req.view.name) if versions is not None else None
                table_versions[req.view.name] = offline.register(
                    con, req.layout.history_table, f"__hist{i}", schema, version=wanted
                )
        sql = _join_sql(requests, entity_columns, ts_column, as_of, defs.key_types, _sum_scales(con, requests))
        types = {n: r.view.field(f).dtype.arrow for r in requests for f, n in zip(r.features, r.output_names)}
        if (
            not ts_column
        ):  # the entity rows' time in nanoseconds: returned UTC (naive input is UTC), its nanoseconds kept
            types[_time_column(entity_columns, con)] = pa.timestamp("ns", tz="UTC")
        job = cls(con, sql, table_versions, {r.view.name: r.layout.history_table for r in requests}, types)
        if on_demand is not None:
            missing = [f for f in on_demand.request_fields if f not in entity_columns]
            if missing:
                raise RequestError(
                    f"the on-demand features need request field(s) {missing} as entity_df columns; got {entity_columns}"
                )
            clash = [n for n in on_demand.output_names() if n in entity_columns]
            if clash:
                raise RequestError(
                    f"output column(s) {clash} clash with entity columns; rename those or use full_feature_names=True"
                )
            job.on_demand, job.entity_columns = on_demand, entity_columns
        return job

    def _fix_types(self, batch: pa.RecordBatch | pa.Table):
        schema = pa.schema([pa.field(f.name, self.feature_types.get(f.name, f.type)) for f in batch.schema])
        batch = batch.cast(schema) if schema != batch.schema else batch
        return self._with_on_demand(batch) if self.on_demand is not None else batch

    def _with_on_demand(self, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
        """The requested columns: entity columns, then stored and request-time features in request order."""
        plan, entities = self.on_demand, self.entity_columns or []
        assert plan is not None
        computed = plan.compute({name: batch.column(name) for name in batch.schema.names}, batch.num_rows)
        columns = [(name, batch.column(name)) for name in entities]
        columns += finish_columns(plan, batch.column, computed)
        make = pa.RecordBatch.from_arrays if isinstance(batch, pa.RecordBatch) else pa.Table.from_arrays
        return make([c for _, c in columns], names=[n for n, _ in columns])

    def batches(self, rows_per_batch: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """Stream the result in input order, memory bounded by DuckDB."""
        with _entity_type_errors():
            reader = self.con.sql(self.sql).to_arrow_reader(rows_per_batch)
            for batch in reader:
                yield self._fix_types(batch)

    def to_arrow(self) -> pa.Table:
        with _entity_type_errors():
            return self._fix_types(self.con.sql(self.sql).to_arrow_table())

    def to_df(self) -> pd.DataFrame:
        return self.to_arrow().to_pandas()

    def to_parquet(self, path: str | Path, on_batch: Any = None) -> int:
        """Write the result to one Parquet file (deterministic bytes for the same rows); return rows."""
        return write_parquet(self.batches(), path, on_batch)


def write_parquet(batches: Iterator[pa.RecordBatch], path: str | Path, on_batch: Any = None) -> int:
    """Batches to one Parquet file, a row group per ``BATCH_ROWS``; returns rows written."""
    rows = 0
    writer: pq.ParquetWriter | None = None
    try:
        for batch in batches:
            if writer is None:
                writer = pq.ParquetWriter(str(path), batch.schema, compression="zstd")
            writer.write_batch(batch, row_group_size=BATCH_ROWS)
            rows += batch.num_rows
            if on_batch:
                on_batch(batch.num_rows)
    finally:
        if writer is not None:
            writer.close()
    return rows


@contextlib.contextmanager
def _entity_type_errors() -> Iterator[None]:
    """A join key of the wrong type in the entity rows is the caller's mistake: say so. An
    aggregate the declared type cannot hold is the definition's: ``AggregationOverflow``."""
    try:
        yield
    except duckdb.InvalidInputException as exc:
        text = str(exc).splitlines()[0]
        if "leaves Int64's range" in text:
            raise AggregationOverflow(text.split(": ", 1)[-1]) from None
        raise
    except (duckdb.ConversionException, duckdb.BinderException) as exc:
        raise RequestError(
            f"entity rows do not fit the views' join keys ({str(exc).splitlines()[0]}); "
            "give each join key the entity's type"
        ) from exc


ENTITY_FILES = {".parquet": None, ".csv": "read_csv_auto", ".json": "read_json_auto", ".jsonl": "read_json_auto"}


def entity_input(value: str | Path) -> pa.Table | Path:
    """Entity rows named by a string or path: a Parquet file (returned as a Path, read in place),
    a CSV or JSON file, or a DuckDB SELECT. Every mistake is a RequestError naming the fix."""
    text = str(value).strip()
    suffix = Path(text).suffix.lower()
    if isinstance(value, Path) or suffix in ENTITY_FILES:
        path = Path(text)
        if not path.exists():
            raise RequestError(f"entity file {path} does not exist; pass a Parquet, CSV or JSON file of entity rows")
        reader = ENTITY_FILES.get(suffix, "read_parquet")
        if reader is None:
            return path
        try:
            return _query(f"SELECT * FROM {reader}({quote(str(path))})")
        except duckdb.Error as exc:
            raise RequestError(f"reading entity rows from {path} failed: {str(exc).splitlines()[0]}") from exc
    try:
        return _query(text)
    except duckdb.Error as exc:
        raise RequestError(
            f"entity_df {text[:80]!r} is neither a .parquet/.csv/.json path nor a valid SQL SELECT: {str(exc).splitlines()[0]}"
        ) from exc


def entity_table(entity_df: Any) -> pa.Table:
    """Entity rows as one Arrow table, from a table, a pandas frame, a file or a SELECT."""
    if isinstance(entity_df, pa.Table):
        return entity_df
    if isinstance(entity_df, (str, Path)):
        rows = entity_input(entity_df)
        return pq.read_table(rows) if isinstance(rows, Path) else rows
    return frame_to_arrow(entity_df)


def frame_to_arrow(frame: pd.DataFrame) -> pa.Table:
    """A pandas frame as Arrow, NaN kept as NaN in float columns (pandas' conversion makes it null,
    which online lookups, given the same NaN, would not): None and ``pd.NA`` stay null."""
    import numpy as np

    table = pa.Table.from_pandas(frame, preserve_index=False)
    for i, name in enumerate(table.column_names):
        column = frame[name] if name in frame.columns else None
        if (
            column is not None
            and column.dtype.kind == "f"
            and isinstance(column.dtype, np.dtype)
            and column.isna().any()
        ):
            table = table.set_column(
                i, name, pa.array(column.to_numpy(), type=table.schema.field(i).type, from_pandas=False)
            )
    return table


def _time_column(columns: list[str], con: duckdb.DuckDBPyConnection) -> str:
    """The entity rows' nanosecond time column (the one ``_register_entities`` joins at)."""
    schema = con.sql("SELECT * FROM __raw LIMIT 0").to_arrow_table().schema
    return (
        "event_timestamp"
        if "event_timestamp" in columns
        else next(c for c in columns if is_nanoseconds(schema.field(c).type))
    )


def entity_time_column(schema: pa.Schema) -> str:
    """The entity rows' time column: ``event_timestamp``, else their one timestamp (or date) column."""
    timestamps = [f.name for f in schema if pa.types.is_timestamp(f.type) or pa.types.is_date(f.type)]
    if "event_timestamp" in schema.names:
        return "event_timestamp"
    if len(timestamps) == 1:
        return timestamps[0]
    raise RequestError(
        f"entity rows need an 'event_timestamp' column (or exactly one timestamp column); found timestamp columns {timestamps}"
    )


def _register_entities(con: duckdb.DuckDBPyConnection, entity_df: Any) -> tuple[list[str], str]:
    """Expose entity rows as ``__entities`` with ``__fs_row`` (input order) and ``__fs_ts`` (naive UTC)."""
    if isinstance(entity_df, (str, Path)):
        entity_df = entity_input(entity_df)
    if isinstance(entity_df, Path):  # Parquet: read in place, in file order
        con.execute(
            f"CREATE TEMP VIEW __raw AS SELECT * FROM read_parquet({quote(str(entity_df))}, file_row_number=true)"
        )
        row_expr = "file_row_number"
    else:
        if isinstance(entity_df, pa.Table):
            table = entity_df
        else:
            try:
                table = frame_to_arrow(entity_df)
            except Exception as exc:
                raise RequestError(
                    f"entity_df must be a pandas DataFrame, pyarrow Table, .parquet path or SQL string, not {type(entity_df).__name__}"
                ) from exc
        import numpy as np

        con.register("__raw", table.append_column(ROW, pa.array(np.arange(table.num_rows, dtype=np.int64))))
        row_expr = ROW
    schema = con.sql("SELECT * FROM __raw LIMIT 0").to_arrow_table().schema
    columns = [n for n in schema.names if n not in (ROW, "file_row_number")]
    ts = entity_time_column(pa.schema([schema.field(n) for n in columns]))
    ts_type = schema.field(ts).type
    if not (pa.types.is_timestamp(ts_type) or pa.types.is_date(ts_type)):
        raise RequestError(f"entity column {ts!r} is {ts_type}, not a timestamp; convert it (pd.to_datetime)")
    (nulls,) = con.execute(f"SELECT count(*) FROM __raw WHERE {ident(ts)} IS NULL").fetchall()[0]
    if nulls:
        raise RequestError(f"{nulls} entity rows have a null {ts!r}; every row needs a time to join at")
    select = ", ".join(ident(c) for c in columns)
    con.execute(
        f"""CREATE TEMP VIEW __entities AS SELECT {select},
            {utc_micros_sql(ident(ts), is_nanoseconds(ts_type))} AS {TS}, {row_expr} AS {ROW} FROM __raw"""
    )
    return columns, ts if not is_nanoseconds(
        ts_type
    ) else ""  # "": the caller's column, its nanoseconds kept (see build)


def _wanted(req: ViewRequest) -> list:
    by_name = {a.output_name: a for a in req.view.aggregations}
    return [by_name[f] for f in req.features]


def _sum_scales(con: duckdb.DuckDBPyConnection, requests: list[ViewRequest]) -> dict[int, dict]:
    """Per request (by index), how each float column it sums is summed exactly (``aggregation.exact_sum.SumScale``):
    a scan of the column's magnitudes in the history it joins."""
    scales: dict[int, dict] = {}
    for i, req in enumerate(requests):
        if req.view.is_aggregated:
            scales[i] = {
                column: sum_scale(*con.sql(aggregation_sql.scale_scan_sql(column, f"__hist{i}")).fetchall()[0])
                for column in aggregation_sql.needs_scale(req.view, _wanted(req))
            }
    return scales


def _join_sql(
    requests: list[ViewRequest],
    entity_columns: list[str],
    ts_column: str,
    as_of: str,
    key_types: dict,
    scales: dict[int, dict],
) -> str:
    ctes, joins, outputs = [], [], []
    for i, req in enumerate(requests):
        view, alias = req.view, f"v{i}"
        if view.is_aggregated:
            wanted = _wanted(req)
            ctes += aggregation_sql.view_ctes(view, wanted, f"__hist{i}", alias, key_types[view.name], as_of, scales[i])
            joins.append(f"LEFT JOIN {alias} ON e.{ROW} = {alias}.{ROW}")
            outputs += [
                (pos, f"{aggregation_sql.output_sql(view, a, alias)} AS {ident(name)}")
                for a, name, pos in zip(wanted, req.output_names, req.positions)
            ]
            continue
        keys = ", ".join(ident(k) for k in view.join_keys)
        feats = ", ".join(ident(f) for f in req.features)
        ranked = "ORDER BY created_timestamp DESC, _run_id DESC, _row_id DESC"
        if as_of == "event":
            ctes.append(
                f"""{alias} AS (SELECT {keys}, CAST(event_timestamp AS TIMESTAMP) AS __ev, {feats} FROM __hist{i}
                QUALIFY row_number() OVER (PARTITION BY {keys}, event_timestamp {ranked}) = 1)"""
            )
            on = " AND ".join(
                [f"e.{ident(k)} = {alias}.{ident(k)}" for k in view.join_keys] + [f"e.{TS} >= {alias}.__ev"]
            )
            joins.append(f"ASOF LEFT JOIN {alias} ON {on}")
        else:
            on = " AND ".join(
                [f"e.{ident(k)} = h.{ident(k)}" for k in view.join_keys]
                + [
                    f"CAST(h.event_timestamp AS TIMESTAMP) <= e.{TS}",
                    f"CAST(h.created_timestamp AS TIMESTAMP) <= e.{TS}",
                ]
            )
            ctes.append(
                f"""{alias} AS (SELECT e.{ROW}, CAST(h.event_timestamp AS TIMESTAMP) AS __ev,
                {", ".join("h." + ident(f) for f in req.features)}
                FROM __entities e JOIN __hist{i} h ON {on}
                QUALIFY row_number() OVER (PARTITION BY e.{ROW} ORDER BY h.event_timestamp DESC, h.created_timestamp DESC,
                    h._run_id DESC, h._row_id DESC) = 1)"""
            )
            joins.append(f"LEFT JOIN {alias} ON e.{ROW} = {alias}.{ROW}")
        ttl = view.ttl
        for feature, name, pos in zip(req.features, req.output_names, req.positions):
            value = f"{alias}.{ident(feature)}"
            if ttl is not None:
                micros = ttl // timedelta(microseconds=1)  # exact: a float product can lose 1 µs
                value = f"CASE WHEN {alias}.__ev >= e.{TS} - INTERVAL ({micros}) MICROSECONDS THEN {value} END"
            outputs.append((pos, f"{value} AS {ident(name)}"))
    entity_select = ", ".join(
        f"CAST(e.{TS} AS TIMESTAMPTZ) AS {ident(c)}" if c == ts_column else f"e.{ident(c)}" for c in entity_columns
    )
    return (
        f"WITH e AS (SELECT * FROM __entities), {', '.join(ctes)} "
        f"SELECT {entity_select}, {', '.join(sql for _, sql in sorted(outputs))} FROM e {' '.join(joins)} ORDER BY e.{ROW}"
    )


def _query(sql: str) -> pa.Table:
    """A statement's result (DuckDB's default connection), as Arrow."""
    relation = duckdb.sql(sql)
    if relation is None:
        raise RequestError(f"{sql!r} returns no rows; pass a query that selects entity rows")
    return relation.to_arrow_table()
