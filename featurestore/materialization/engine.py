"""Run materialization: compute each view once, write history then the online store.

Crash safety: before history is written a view is marked ``online_synced: false`` (history
may now hold rows Redis lacks). The next write that goes online while the mark is false
sends the latest rows of the view's *whole history* (plus what it computed), whatever its
window, and only then marks it true: so a re-run converges whatever ran in between (a
crash, offline-only pushes, windowed runs). Both writes are idempotent (history dedupes by
``_row_id``, Redis keeps the larger order key or the first event id), so re-sending is
safe. Pushes go through the durable buffer instead (``offline/buffer.py``) and touch no
registry state."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.aggregation import dedup_us
from featurestore.aggregation.tiles import tile_us
from featurestore.config import RepoConfig
from featurestore.definitions import FeatureView
from featurestore.errors import BadRowsError
from featurestore.materialization.compute import compute, events_to_add, latest_per_entity, latest_sql, max_micros
from featurestore.offline.base import OfflineStore
from featurestore.offline.buffer import PushBuffer
from featurestore.online.base import OnlineWrites
from featurestore.online.codec import datetime_to_micros
from featurestore.progress import progress_bar, query_progress
from featurestore.registry import Definitions, RegistryStore
from featurestore.sources import connection, register_view_rows


def push_run_id(ingested: datetime) -> int:
    """A push's run id: its ingest time in µs. Later than every counted run and ordered by
    arrival (the event-id rule keeps the first), with no registry write on the push path."""
    return datetime_to_micros(ingested)


@dataclass
class ViewReport:
    view: str
    computed_rows: int = 0
    new_offline_rows: int = 0
    online_rows: int = 0
    rejected_rows: int = 0
    reject_sample: list[dict] = field(default_factory=list)
    seconds: float = 0.0


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


class Materializer:
    """Writes views' rows to the stores, under the applied definitions ``defs``."""

    def __init__(
        self,
        defs: Definitions,
        registry: RegistryStore,
        offline: OfflineStore,
        online: OnlineWrites,
        config: RepoConfig,
        progress: bool = False,
    ):
        self.defs, self.registry, self.offline, self.online, self.config = defs, registry, offline, online, config
        self.progress = progress

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
        with progress_bar("rows", self.progress, percent=True) as bar:
            for i, view in enumerate(selected, 1):
                # the compute query's own progress (DuckDB), then the writes
                task = bar.add_task(f"[{i}/{len(selected)}] {view.name}: computing", total=100)
                began = time.perf_counter()
                con = connection()
                register_view_rows(con, view, self.config.repo_path, self.config.data_dir)
                with query_progress(con, bar, task):
                    report.views.append(
                        self.write_view(
                            con, view, start=start, end=end, online=online, offline=offline, on_bad_rows=on_bad_rows
                        )
                    )
                report.views[-1].seconds = time.perf_counter() - began
                bar.update(task, completed=100, description=f"[{i}/{len(selected)}] {view.name}: done")
        return report

    def _expiry(self, view: FeatureView) -> timedelta | None:
        """Key expiry for this view's writes, when asked for and safe.

        All views keyed by the same join keys share one Redis hash, so the key may expire only
        if every one of them has a ttl; it then lives until the longest of them runs out.
        """
        if not self.config.expire_after_ttl:
            return None
        sharing = [
            v for v in self.defs.feature_views.values() if v.online and sorted(v.join_keys) == sorted(view.join_keys)
        ]
        if any(v.ttl is None for v in sharing):
            return None
        return max(v.ttl for v in sharing)

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
        defs, registry = self.defs, self.registry
        run_id = registry.next_run_id() if run_id is None else run_id
        now = datetime.now(UTC)
        computed = compute(
            con,
            view,
            defs.key_types[view.name],
            defs.history_schema(view),
            run_id,
            now,
            start,
            end,
            self.config.future_tolerance,
        )
        report = ViewReport(view.name, computed_rows=computed.rows.num_rows)
        self.keep_rejects(view, computed.rejects, report, on_bad_rows)
        write_offline, write_online = offline and view.offline, online and view.online
        if buffer is not None:
            report.online_rows = self.write_pushed(view, computed.rows, now, write_online, write_offline, buffer)
            return report
        synced = self.begin_history_write(view, write_offline)
        fresh = computed.rows
        if write_offline:
            fresh = self.offline.append(view.history_table, computed.rows)
            report.new_offline_rows = fresh.num_rows
        if write_online:
            if synced:
                report.online_rows = self.write_online(view, fresh, now)
            else:  # the whole history, as authority: Redis is made to match it
                report.online_rows = self.write_online(
                    view, self._whole_history(view, computed.rows, written=write_offline), now, whole_history=True
                )
        self.finish_run(
            view,
            run_id,
            now,
            end,
            write_online,
            write_offline,
            _max_iso(computed.rows) if computed.rows.num_rows else None,
        )
        return report

    def keep_rejects(self, view: FeatureView, rejects: pa.Table, report: ViewReport, on_bad_rows: str) -> None:
        """Count and sample rejected rows into ``report``, then keep them (or fail, if asked to)."""
        report.rejected_rows = rejects.num_rows
        if not rejects.num_rows:
            return
        report.reject_sample = rejects.slice(0, 5).to_pylist()
        if on_bad_rows == "fail":
            raise BadRowsError(
                f"view {view.name!r}: {rejects.num_rows} source rows break the schema, e.g. "
                f"{report.reject_sample[:3]}; fix the source or materialize with on_bad_rows='reject'"
            )
        self.offline.write_rejects(view.name, rejects)

    def begin_history_write(self, view: FeatureView, write_offline: bool) -> bool:
        """Whether Redis holds the view's whole history now (else the next online write sends it
        all); marks it not so before history changes."""
        mark = self.registry.watermarks().get(view.name, {})
        # a new storage layout starts with nothing online: everything is re-sent; with no history
        # yet, this run's rows are the whole of it
        synced = (
            mark.get("online_synced", False) and mark.get("online_layout") == view.storage_id
        ) or self.offline.version(view.history_table) is None
        if view.online and write_offline:
            self.registry.set_watermark(view.name, online_synced=False)
        return synced

    def finish_run(
        self,
        view: FeatureView,
        run_id: int,
        now: datetime,
        end: datetime | None,
        wrote_online: bool,
        wrote_offline: bool,
        max_event: str | None,
    ) -> None:
        """Record what the run wrote: Redis in sync, history up to ``end``."""
        marks: dict = {}
        if wrote_online:
            marks.update(online_synced=True, online_layout=view.storage_id)
        if wrote_offline:
            marks.update(last_run_id=run_id, materialized_at=now.isoformat())
            if end is not None:
                marks["end"] = end.isoformat()
            if max_event:
                marks["max_event_timestamp"] = max_event
        if marks:
            self.registry.set_watermark(view.name, **marks)

    def write_pushed(
        self, view: FeatureView, rows: pa.Table, now: datetime, online: bool, offline: bool, buffer: PushBuffer
    ) -> int:
        """Pushed history rows: Redis synchronously, history through the durable buffer (no
        registry state); returns the rows written online."""
        written = 0

        def write_online() -> None:
            nonlocal written
            written = self.write_online(view, rows, now)

        if offline:
            buffer.append(f"view:{view.history_table}", rows, meanwhile=write_online if online else None)
        elif online:
            write_online()
        return written

    def _whole_history(self, view: FeatureView, computed: pa.Table, written: bool) -> pa.Table:
        """What Redis must hold from every stored row of the view (and the computed ones, if not
        stored): each entity's latest row, or for an aggregated view every event."""
        con = connection()
        self.offline.register(con, view.history_table, "history", computed.schema)
        rows = "SELECT * FROM history"
        if not written:
            con.register("computed", computed)
            rows += " UNION ALL SELECT * FROM computed"
        query = rows if view.is_aggregated else latest_sql(f"({rows})", view.join_keys, computed.schema.names)
        return con.sql(query).to_arrow_table().cast(computed.schema)

    def write_online(self, view: FeatureView, rows: pa.Table, now: datetime, whole_history: bool = False) -> int:
        """Send history rows online: each entity's latest row, or for aggregated views the events
        (``whole_history``: ``rows`` are all of the view's history, whose verdicts on duplicate
        event ids Redis then takes over its own)."""
        if rows.num_rows == 0:
            return 0
        stored = [(f.name, f.dtype) for f in view.schema]
        newest = (view.name, max_micros(rows["event_timestamp"]))  # per-view freshness
        if view.is_aggregated:
            horizon = view.longest_window + self.config.event_retention
            cutoff_us = datetime_to_micros(now - horizon)
            writes = events_to_add(rows, view, cutoff_us, verdicts=whole_history)
            return self.online.write_events(
                view.online_field,
                writes.rows,
                view.join_keys,
                stored,
                writes.ids,
                cutoff_us,
                horizon,
                tile_us(view),
                dedup_us(view),
                accepted=writes.accepted,
                newest=newest,
            )
        latest = latest_per_entity(rows, view.join_keys)
        self.online.write_latest(view.online_field, latest, view.join_keys, stored, self._expiry(view), newest)
        return latest.num_rows


def _max_iso(rows: pa.Table) -> str:
    return pc.max(rows["event_timestamp"]).as_py().isoformat()
