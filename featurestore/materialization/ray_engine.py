"""Materialization on a Ray cluster: the local engine's compute and writes, per hash partition.

Per view, in three waves of tasks:

1. **read and split**: one task per group of source files (a Parquet source's files, or the
   push log's) reads them and splits the rows by a hash of the view's join keys;
2. **compute and write history**: task *p* gathers part *p* from every reader, applies the
   view's transformation and ``compute`` (typing, identity, rejects: the local code), drops
   rows history already holds, and writes the new ones as Parquet files in the Delta table's
   folders, uncommitted. The driver then commits every task's files in **one transaction**;
3. **online**: task *p* writes its rows to Redis (latest row per entity, or the events of
   windowed views) with the local engine's scripts. An entity's rows all lie in one partition,
   so its latest row is the whole answer.

History is committed before anything goes online, under the same ``online_synced`` mark as
the local engine, so a crash anywhere leaves the stores consistent and a re-run converges
(files not committed are invisible; history dedupes by ``_row_id``, Redis writes are
idempotent). Transformations run per partition: a SQL or Python transformation may relate
rows of one entity (window functions, GROUP BY the join keys) but not rows of different
entities; a view whose join keys are not source columns, or whose source is a SQL query or
CSV, is materialized by the local engine, as the run's log says.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from featurestore.definitions import FeatureView, FileSource, PushSource
from featurestore.materialization.compute import compute
from featurestore.materialization.online_write import key_expiry, write_online
from featurestore.materialization.protocol import ComputedRun, max_event_iso
from featurestore.online.base import OnlineStoreSettings
from featurestore.ray_cluster import connect, fit_to_task, gather, hash_split, local_path, partitions
from featurestore.registry import Definitions, RegistryStore
from featurestore.registry.snapshot import applied_definitions
from featurestore.sources import open_push_log, run_python_transformation
from featurestore.storage import Location
from featurestore.types import duckdb_type

log = logging.getLogger("featurestore.materialize")


class RayEngine:
    """Materialization's ``DistributedEngine`` on a Ray cluster (``address``; None: a local one):
    each view it can split by entity is computed in ``partitions`` hash partitions (0: one per
    cluster CPU, at least 2)."""

    def __init__(
        self,
        defs: Definitions,
        registry: RegistryStore,
        offline: Location,
        online: OnlineStoreSettings,
        repo_path: Path,
        push_logs: Location,
        future_tolerance: timedelta,
        event_retention: timedelta,
        expire_after_ttl: bool = False,
        address: str | None = None,
        partitions: int = 0,
        progress: bool = False,
    ):
        self.defs, self.registry, self.offline, self.online = defs, registry, offline, online
        self.repo_path, self.push_logs = repo_path, push_logs
        self.future_tolerance, self.event_retention = future_tolerance, event_retention
        self.expire_after_ttl = expire_after_ttl
        self.address, self.partitions, self.progress = address, partitions, progress

    def executor_for(self, view: FeatureView) -> RayExecutor | None:
        files, storage, why_local = self._source_files(view)
        if why_local:
            log.info("view %s: materialized locally (%s)", view.name, why_local)
            return None
        ray = connect(self.address)
        return RayExecutor(self, ray, files, storage, partitions(ray, self.partitions))

    def _source_files(self, view: FeatureView) -> tuple[list[str], Location | None, str | None]:
        """The files a view's rows come from and where they are (None: local paths), or why the
        view runs locally."""
        source = view.source
        storage = None
        if isinstance(source, PushSource):
            log = open_push_log(self.push_logs, source.name)
            files, storage = (log.file_uris() if log is not None else []), self.push_logs
            columns = [f.name for f in source.schema]
        elif isinstance(source, FileSource) and source.format == "parquet":
            path = Path(source.path) if Path(source.path).is_absolute() else self.repo_path / source.path
            files = [str(p) for p in sorted(path.rglob("*.parquet"))] if path.is_dir() else [str(path)]
            import pyarrow.parquet as pq

            columns = pq.read_schema(files[0]).names if files else []
        else:
            why = f"its source is {type(source).__name__} ({getattr(source, 'format', 'sql')}), read in one piece"
            return [], None, why
        missing = [k for k in view.join_keys if k not in columns]
        if missing and files:
            why = f"join key(s) {missing} are made by its transformation, so rows cannot be split by entity first"
            return [], None, why
        return files, storage, None


@dataclass(frozen=True)
class ViewJob:
    """What each task of one view's run is given: the applied registry state it rebuilds the view
    from (workers cannot import the repo), the run's identity and bounds, and where to write."""

    state: dict[str, Any]
    view: str
    transformation: Any  # SQL text, a function (pickled by value), or None
    run_id: int
    now: datetime
    start: datetime | None
    end: datetime | None
    future_tolerance: timedelta
    event_retention: timedelta
    expire_after_ttl: bool
    online: OnlineStoreSettings
    offline: Location
    write_offline: bool
    history_version: int | None  # what partitions deduplicate against (the driver's commit expects it)


@dataclass(frozen=True)
class PartitionSummary:
    """What one partition's compute task reports back (its rows stay in the object store)."""

    computed: int
    new: int
    actions: list[Any]  # the history files it wrote, uncommitted
    rejects: pa.Table
    max_event: str | None


class RayExecutor:
    """One view on the cluster: read and split by entity, then per partition compute and write
    history files (uncommitted), then per partition write online."""

    def __init__(self, engine: RayEngine, ray: Any, files: list[str], storage: Location | None, parts: int):
        self.engine, self.ray, self.files, self.storage, self.parts = engine, ray, files, storage, parts
        self._job: ViewJob | None = None

    def compute(
        self,
        view: FeatureView,
        run_id: int,
        now: datetime,
        start: datetime | None,
        end: datetime | None,
        to_history: bool,
        history_version: int | None,
    ) -> ComputedRun:
        engine, ray, parts = self.engine, self.ray, self.parts
        current = engine.registry.current()  # what a task rebuilds the views from (services are not needed)
        state = {
            **current,
            "objects": {k: v for k, v in current["objects"].items() if k in ("entity", "push_source", "feature_view")},
        }
        key_types = {k: duckdb_type(t) for k, t in engine.defs.key_types[view.name].items()}
        transformation = view.transformation
        if callable(transformation):  # user code travels by value: workers cannot import the repo's modules
            import ray.cloudpickle as cloudpickle

            cloudpickle.register_pickle_by_value(sys.modules[transformation.__module__])
        split = ray.remote(num_returns=parts)(_read_split)
        units = _row_groups(self.files, self.storage)  # a large file is read by several tasks, a row group each
        groups = [units[g::parts] for g in range(min(parts, len(units)))]
        pieces = [split.remote(group, key_types, parts, self.storage) for group in groups]
        self._job = job = ViewJob(
            state=state,
            view=view.name,
            transformation=transformation,
            run_id=run_id,
            now=now,
            start=start,
            end=end,
            future_tolerance=engine.future_tolerance,
            event_retention=engine.event_retention,
            expire_after_ttl=engine.expire_after_ttl,
            online=engine.online,
            offline=engine.offline,
            write_offline=to_history,
            history_version=history_version,
        )
        compute_write = ray.remote(num_returns=2)(_compute_write)
        results = [compute_write.remote(job, *[piece[p] for piece in pieces]) for p in range(parts)]
        summaries = gather(
            ray, [r[0] for r in results], f"{view.name}: computing {parts} partitions on Ray", engine.progress
        )
        newest = [s.max_event for s in summaries if s.max_event]
        return ComputedRun(
            computed_rows=sum(s.computed for s in summaries),
            rejects=pa.concat_tables([s.rejects for s in summaries], promote_options="default"),
            max_event=max(newest) if newest else None,
            new_rows=sum(s.new for s in summaries),
            files=[a for s in summaries for a in s.actions],
            partitions=[r[1] for r in results],
        )

    def write_online(self, view: FeatureView, run: ComputedRun, now: datetime) -> int:
        """Each partition's rows, straight from the object store, by a task."""
        write = self.ray.remote(_write_online)
        refs = [write.remote(self._job, rows) for rows in run.partitions]
        return sum(gather(self.ray, refs, f"{view.name}: writing online", self.engine.progress))

    def rows(self, run: ComputedRun) -> pa.Table:
        return pa.concat_tables(self.ray.get(run.partitions))


def _parquet(uri: str, storage: Location | None) -> Any:
    """A Parquet file by its URI: a local path, or on object storage read through pyarrow's client."""
    import pyarrow.parquet as pq

    if storage is None or storage.is_local:
        return pq.ParquetFile(local_path(uri))
    fs, _ = storage.filesystem()
    return pq.ParquetFile(fs.open_input_file(uri.split("://", 1)[1]))


def _row_groups(files: list[str], storage: Location | None) -> list[tuple[str, int]]:
    return [(uri, group) for uri in files for group in range(_parquet(uri, storage).num_row_groups)]


def _read_split(units: list[tuple[str, int]], key_types: dict[str, str], parts: int, storage: Location | None) -> Any:
    """Row groups of source files, read and split by a hash of the join keys (cast to their declared types)."""
    fit_to_task()
    tables = [_parquet(uri, storage).read_row_group(group) for uri, group in units]
    table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    return hash_split(table, key_types, parts)


def _view_rows(con: duckdb.DuckDBPyConnection, source: pa.Table, transformation: Any) -> None:
    con.register("source", source)
    if transformation is None:
        con.execute("CREATE OR REPLACE TEMP VIEW view_rows AS SELECT * FROM source")
    elif isinstance(transformation, str):
        con.execute(f"CREATE OR REPLACE TEMP VIEW view_rows AS {transformation}")
    else:
        con.register("view_rows", run_python_transformation(transformation, source))


def _compute_write(job: ViewJob, *pieces: pa.Table) -> tuple[PartitionSummary, pa.Table]:
    """One partition: compute the view's rows, write the new ones as uncommitted history files."""
    from featurestore.offline.delta import DeltaOfflineStore

    defs = applied_definitions(job.state)
    view = defs.view(job.view)
    con = duckdb.connect()
    fit_to_task(con)
    _view_rows(con, pa.concat_tables(pieces, promote_options="default"), job.transformation)
    computed = compute(
        con,
        view,
        defs.key_types[view.name],
        defs.history_schema(view),
        job.run_id,
        job.now,
        job.start,
        job.end,
        job.future_tolerance,
    )
    actions, new = [], 0
    if job.write_offline and computed.rows.num_rows:
        store, table = DeltaOfflineStore(job.offline), defs.layout(view).history_table
        fresh = store.new_rows(table, computed.rows, job.history_version)
        actions, new = store.write_files(table, fresh), fresh.num_rows
    summary = PartitionSummary(computed.rows.num_rows, new, actions, computed.rejects, max_event_iso(computed.rows))
    return summary, computed.rows


def _write_online(job: ViewJob, rows: pa.Table) -> int:
    """One partition's rows online, as the local engine writes them."""
    from featurestore.online.base import open_online_store

    fit_to_task()
    defs = applied_definitions(job.state)
    online = open_online_store(job.online)
    view = defs.view(job.view)
    expire_after = key_expiry(defs, view) if job.expire_after_ttl else None
    try:
        return write_online(
            online,
            view,
            defs.layout(view),
            rows,
            job.now,
            event_retention=job.event_retention,
            expire_after=expire_after,
        )
    finally:
        online.close()
