"""Run materialization: compute each view once, write history then the online store.

The order of the writes, and why a crash anywhere leaves the stores consistent, is
``materialization.protocol``'s; this module runs it per view, on this process (``LocalExecutor``:
DuckDB over the view's source) or on a cluster (``distributed``: ``ray_engine``). Pushes go
through the durable buffer instead (``offline/buffer/``) and touch no registry state."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

import duckdb
import pyarrow as pa

from featurestore.config import RepoConfig
from featurestore.definitions import FeatureView
from featurestore.materialization import protocol
from featurestore.materialization.compute import Computed, compute
from featurestore.materialization.online_write import key_expiry, write_online
from featurestore.materialization.protocol import ComputedRun, Stores, ViewExecutor, ViewReport, max_event_iso
from featurestore.offline.base import PARTITION_COLUMN, OfflineStore
from featurestore.offline.buffer import PushBuffer
from featurestore.online.base import OnlineWrites
from featurestore.online.codec import datetime_to_micros
from featurestore.progress import progress_bar, query_progress
from featurestore.registry import Definitions, RegistryStore
from featurestore.sources import connection, register_view_rows

log = logging.getLogger("featurestore.materialize")


def push_run_id(ingested: datetime) -> int:
    """A push's run id: its ingest time in µs. Later than every counted run and ordered by
    arrival (the event-id rule keeps the first), with no registry write on the push path."""
    return datetime_to_micros(ingested)


@dataclass
class MaterializationReport:
    views: list[ViewReport] = field(default_factory=list)

    def describe(self) -> str:
        lines = []
        for v in self.views:
            lines.append(
                f"{v.view}: {v.computed_rows} rows computed, {v.new_offline_rows} new in history, "
                f"{v.online_rows} written online, {v.rejected_rows} rejected"
                + (f" in {v.seconds:.1f} s ({v.computed_rows / v.seconds:,.0f} rows/s)" if v.seconds else "")
            )
            lines += [f"    rejected: {r}" for r in v.reject_sample]
        return "\n".join(lines)


class DistributedEngine(Protocol):
    def executor_for(self, view: FeatureView) -> ViewExecutor | None:
        """The executor that computes ``view`` on the cluster, or None (said in the log) when it runs here."""
        ...


class LocalExecutor:
    """Computes a view in this process: DuckDB over ``view_rows`` registered in ``con``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, materializer: Materializer):
        self.con, self.materializer = con, materializer

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
        m = self.materializer
        computed = m.compute(self.con, view, run_id, now, start, end)
        rows, fresh = computed.rows, computed.rows
        files: list[Any] = []
        if to_history and rows.num_rows:
            table = m.defs.layout(view).history_table
            fresh = m.offline.new_rows(table, rows, history_version)
            files = m.offline.write_files(table, fresh) if fresh.num_rows else []
            fresh = fresh.drop_columns([PARTITION_COLUMN])
        new = fresh.num_rows if to_history else 0
        return ComputedRun(rows.num_rows, computed.rejects, max_event_iso(rows), new, files, (rows, fresh))

    def write_online(self, view: FeatureView, run: ComputedRun, now: datetime) -> int:
        return self.materializer.write_online(view, run.partitions[1], now)  # the rows history lacked

    def rows(self, run: ComputedRun) -> pa.Table:
        return run.partitions[0]


class Materializer:
    """Writes views' rows to the stores, under the applied definitions ``defs``; with
    ``distributed``, the views it accepts are computed on its cluster (pushes stay here)."""

    def __init__(
        self,
        defs: Definitions,
        registry: RegistryStore,
        offline: OfflineStore,
        online: OnlineWrites,
        config: RepoConfig,
        progress: bool = False,
        distributed: DistributedEngine | None = None,
    ):
        self.defs, self.registry, self.offline, self.online, self.config = defs, registry, offline, online, config
        self.progress, self.distributed = progress, distributed
        self.stores = Stores(defs, registry, offline, self.write_online, online)

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
        defs = self.defs
        selected = [defs.view(v) for v in views] if views else list(defs.feature_views.values())
        end = end or datetime.now(UTC)
        report = MaterializationReport()
        options: dict[str, Any] = dict(start=start, end=end, online=online, offline=offline, on_bad_rows=on_bad_rows)
        with progress_bar("rows", self.progress, percent=True) as bar:
            for i, view in enumerate(selected, 1):
                began = time.perf_counter()
                executor = self.distributed.executor_for(view) if self.distributed is not None else None
                if executor is not None:
                    report.views.append(protocol.write_view(self.stores, executor, view, **options))
                else:  # the compute query's own progress (DuckDB), then the writes
                    task = bar.add_task(f"[{i}/{len(selected)}] {view.name}: computing", total=100)
                    con = connection()
                    register_view_rows(con, view, self.config.repo_path, self.config.push_logs)
                    with query_progress(con, bar, task):
                        report.views.append(self.write_view(con, view, **options))
                    bar.update(task, completed=100, description=f"[{i}/{len(selected)}] {view.name}: done")
                report.views[-1].seconds = time.perf_counter() - began
        return report

    def write_view(
        self,
        con: duckdb.DuckDBPyConnection,
        view: FeatureView,
        *,
        start: datetime | None,
        end: datetime | None,
        online: bool,
        offline: bool,
        on_bad_rows: str = "reject",
        buffer: PushBuffer | None = None,
        run_id: int | None = None,
    ) -> ViewReport:
        """Compute ``view_rows`` registered in ``con`` and write them to the selected stores.

        ``buffer``: history rows go to this durable buffer (pushes) instead of straight to the
        history store. ``run_id``: the push's (``push_run_id``); by default the registry's next."""
        if buffer is None:
            return protocol.write_view(
                self.stores,
                LocalExecutor(con, self),
                view,
                start=start,
                end=end,
                online=online,
                offline=offline,
                on_bad_rows=on_bad_rows,
                run_id=run_id,
            )
        now = datetime.now(UTC)
        run_id = self.registry.next_run_id() if run_id is None else run_id
        computed = self.compute(con, view, run_id, now, start, end)
        report = ViewReport(view.name, computed_rows=computed.rows.num_rows)
        protocol.keep_rejects(self.stores, view, computed.rejects, report, on_bad_rows)
        report.online_rows = self.write_pushed(
            view, computed.rows, now, online and view.online, offline and view.offline, buffer
        )
        return report

    def compute(
        self,
        con: duckdb.DuckDBPyConnection,
        view: FeatureView,
        run_id: int,
        now: datetime,
        start: datetime | None,
        end: datetime | None,
    ) -> Computed:
        """The view's rows from ``view_rows`` in ``con``, typed and split from rejects (``compute``)."""
        return compute(
            con,
            view,
            self.defs.key_types[view.name],
            self.defs.history_schema(view),
            run_id,
            now,
            start,
            end,
            self.config.future_tolerance,
        )

    def write_pushed(
        self, view: FeatureView, rows: pa.Table, now: datetime, online: bool, offline: bool, buffer: PushBuffer
    ) -> int:
        """Pushed history rows: online synchronously, history through the durable buffer (no
        registry state); returns the rows written online."""
        written = 0

        def send() -> None:
            nonlocal written
            written = self.write_online(view, rows, now)

        if offline:
            buffer.append(f"view:{self.defs.layout(view).history_table}", rows, meanwhile=send if online else None)
        elif online:
            send()
        return written

    def write_online(self, view: FeatureView, rows: pa.Table, now: datetime, whole_history: bool = False) -> int:
        """Send history rows online (``online_write.write_online``, with this repo's retention and expiry)."""
        return write_online(
            self.online,
            view,
            self.defs.layout(view),
            rows,
            now,
            event_retention=self.config.online.event_retention,
            expire_after=self._expiry(view),
            whole_history=whole_history,
        )

    def _expiry(self, view: FeatureView) -> timedelta | None:
        return key_expiry(self.defs, view) if self.config.online.expire_after_ttl else None
