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

import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import duckdb
import pyarrow as pa

from featurestore.config import RepoConfig
from featurestore.definitions import FeatureView, FileSource, PushSource
from featurestore.materialization.compute import compute
from featurestore.materialization.engine import MaterializationReport, Materializer, ViewReport, _max_iso
from featurestore.ray_cluster import connect, fit_to_task, gather, hash_split, local_path, partitions
from featurestore.registry.snapshot import applied_definitions
from featurestore.sources import push_log_path, run_python_transformation
from featurestore.types import duckdb_type

log = logging.getLogger("featurestore.materialize")


class RayMaterializer(Materializer):
    """``Materializer`` whose ``run`` fans views out to a Ray cluster (pushes stay local)."""

    def __init__(self, *args: Any, address: str | None = None, partitions: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.address, self.partitions = address, partitions

    def run(
        self,
        views: Sequence[str] | None,
        *,
        start: datetime | None,
        end: datetime | None,
        online: bool = True,
        offline: bool = True,
        on_bad_rows: Literal["reject", "fail"] = "reject",
    ) -> MaterializationReport:
        ray = connect(self.address)
        parts = partitions(ray, self.partitions)
        selected = [self.defs.view(v) for v in views] if views else list(self.defs.feature_views.values())
        end = end or datetime.now(UTC)
        report = MaterializationReport()
        for view in selected:
            began = time.perf_counter()
            files, why_local = self._source_files(view)
            if why_local:
                log.info("view %s: materialized locally (%s)", view.name, why_local)
                report.views.append(
                    super()
                    .run([view.name], start=start, end=end, online=online, offline=offline, on_bad_rows=on_bad_rows)
                    .views[0]
                )
            else:
                report.views.append(self._run_view(ray, view, files, parts, start, end, online, offline, on_bad_rows))
            report.views[-1].seconds = time.perf_counter() - began
        return report

    def _source_files(self, view: FeatureView) -> tuple[list[str], str | None]:
        """The files a view's rows come from, or why the view runs locally."""
        source = view.source
        if isinstance(source, PushSource):
            from deltalake import DeltaTable

            log_path = push_log_path(self.config.data_dir, source.name)
            files = DeltaTable(str(log_path)).file_uris() if (log_path / "_delta_log").exists() else []
            columns = [f.name for f in source.schema]
        elif isinstance(source, FileSource) and source.format == "parquet":
            path = Path(source.path) if Path(source.path).is_absolute() else self.config.repo_path / source.path
            files = [str(p) for p in sorted(path.rglob("*.parquet"))] if path.is_dir() else [str(path)]
            import pyarrow.parquet as pq

            columns = pq.read_schema(files[0]).names if files else []
        else:
            return [], f"its source is {type(source).__name__} ({getattr(source, 'format', 'sql')}), read in one piece"
        missing = [k for k in view.join_keys if k not in columns]
        if missing and files:
            return [], f"join key(s) {missing} are made by its transformation, so rows cannot be split by entity first"
        return files, None

    def _run_view(
        self,
        ray: Any,
        view: FeatureView,
        files: list[str],
        parts: int,
        start: datetime | None,
        end: datetime,
        online: bool,
        offline: bool,
        on_bad_rows: str,
    ) -> ViewReport:
        registry, store = self.registry, self.offline
        run_id, now = registry.next_run_id(), datetime.now(UTC)
        current = registry.current()  # what a task rebuilds the views from (services are not needed)
        state = {
            **current,
            "objects": {k: v for k, v in current["objects"].items() if k in ("entity", "push_source", "feature_view")},
        }
        key_types = {k: duckdb_type(t) for k, t in self.defs.key_types[view.name].items()}
        transformation = view.transformation
        if callable(transformation):  # user code travels by value: workers cannot import the repo's modules
            import ray.cloudpickle as cloudpickle

            cloudpickle.register_pickle_by_value(sys.modules[transformation.__module__])
        write_offline, write_online = offline and view.offline, online and view.online
        synced = self.begin_history_write(view, write_offline)
        split = ray.remote(num_returns=parts)(_read_split)
        units = _row_groups(files)  # a large file is read by several tasks, a row group each
        groups = [units[g::parts] for g in range(min(parts, len(units)))]
        pieces = [split.remote(group, key_types, parts) for group in groups]
        config = dataclasses.replace(self.config, online_url=getattr(self.online, "url", self.config.online_url))
        job = dict(
            state=state,
            view=view.name,
            transformation=transformation,
            run_id=run_id,
            now=now,
            start=start,
            end=end,
            config=config,
            offline_path=str(getattr(store, "path", "")),
            write_offline=write_offline,
        )
        compute_write = ray.remote(num_returns=2)(_compute_write)
        with store.writer(view.history_table):  # one writer per history table, across processes, until committed
            results = [compute_write.remote(job, *[piece[p] for piece in pieces]) for p in range(parts)]
            summaries = gather(
                ray, [r[0] for r in results], f"{view.name}: computing {parts} partitions on Ray", self.progress
            )
            report = ViewReport(view.name, computed_rows=sum(s["computed"] for s in summaries))
            self.keep_rejects(
                view,
                pa.concat_tables([s["rejects"] for s in summaries], promote_options="default"),
                report,
                on_bad_rows,
            )
            if write_offline:
                store.commit(
                    view.history_table, [a for s in summaries for a in s["actions"]], self.defs.history_schema(view)
                )  # type: ignore[attr-defined]
                report.new_offline_rows = sum(s["new"] for s in summaries)
        if write_online:
            if synced:  # each partition's rows, straight from the object store
                write = ray.remote(_write_online)
                report.online_rows = sum(
                    gather(
                        ray, [write.remote(job, r[1]) for r in results], f"{view.name}: writing online", self.progress
                    )
                )
            else:  # history may hold rows Redis lacks: send the whole history (the local engine's recovery)
                computed = pa.concat_tables(ray.get([r[1] for r in results]))
                report.online_rows = self.write_online(
                    view, self._whole_history(view, computed, written=write_offline), now, whole_history=True
                )
        newest = [s["max_event"] for s in summaries if s["max_event"]]
        self.finish_run(view, run_id, now, end, write_online, write_offline, max(newest) if newest else None)
        return report


def _row_groups(files: list[str]) -> list[tuple[str, int]]:
    import pyarrow.parquet as pq

    return [(uri, group) for uri in files for group in range(pq.ParquetFile(local_path(uri)).num_row_groups)]


def _read_split(units: list[tuple[str, int]], key_types: dict[str, str], parts: int) -> Any:
    """Row groups of source files, read and split by a hash of the join keys (cast to their declared types)."""
    import pyarrow.parquet as pq

    fit_to_task()
    tables = [pq.ParquetFile(local_path(uri)).read_row_group(group) for uri, group in units]
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


def _compute_write(job: dict[str, Any], *pieces: pa.Table) -> tuple[dict[str, Any], pa.Table]:
    """One partition: compute the view's rows, write the new ones as uncommitted history files."""
    from featurestore.offline.delta import DeltaOfflineStore

    defs = applied_definitions(job["state"])
    view = defs.view(job["view"])
    config: RepoConfig = job["config"]
    con = duckdb.connect()
    fit_to_task(con)
    _view_rows(con, pa.concat_tables(pieces, promote_options="default"), job["transformation"])
    computed = compute(
        con,
        view,
        defs.key_types[view.name],
        defs.history_schema(view),
        job["run_id"],
        job["now"],
        job["start"],
        job["end"],
        config.future_tolerance,
    )
    actions, new = [], 0
    if job["write_offline"] and computed.rows.num_rows:
        store = DeltaOfflineStore(Path(job["offline_path"]))
        fresh = store.new_rows(view.history_table, computed.rows)
        actions, new = store.write_files(view.history_table, fresh), fresh.num_rows
    summary = {
        "computed": computed.rows.num_rows,
        "new": new,
        "actions": actions,
        "rejects": computed.rejects,
        "max_event": _max_iso(computed.rows) if computed.rows.num_rows else None,
    }
    return summary, computed.rows


def _write_online(job: dict[str, Any], rows: pa.Table) -> int:
    """One partition's rows to Redis, as the local engine writes them."""
    from featurestore.online.base import open_online_store

    fit_to_task()
    defs = applied_definitions(job["state"])
    online = open_online_store(job["config"].online_store_settings)
    try:
        return Materializer(defs, None, None, online, job["config"]).write_online(
            defs.view(job["view"]), rows, job["now"]
        )  # type: ignore[arg-type]
    finally:
        online.close()
