"""The crash-safe order of a view's write, written once; executors (local, Ray) only compute.

1. **mark**: before history changes, the view is marked ``online_synced: false`` (history may now
   hold rows the online store lacks);
2. **compute** (the executor, ``ViewExecutor.compute``): the view's rows, split into rejects and
   valid rows; with history to write, those the table's current version lacks are written as
   files, uncommitted;
3. **commit**: the files in one history transaction, expecting the version they were
   deduplicated against (another writer's commit meanwhile: its rows are taken out of the files
   and the commit retried, ``HistoryWriter.commit``; no lock, so writers on other machines are
   safe too); a crash before it leaves files no version lists: invisible, and a re-run writes
   them again;
4. **online**: when the mark was true and the online store still holds the token the last run
   left there, each partition's rows (the executor); otherwise (history changed meanwhile, or the
   online store was emptied, replaced or restored from an older copy) the latest of the view's
   *whole history* (plus what was computed), as authority, whatever the run's window;
5. **finish**: a new token left in the online store, then the mark set true with it, the
   history watermark moved.

Both writes are idempotent (history dedupes by ``_row_id``; the online store keeps the larger
order key or the first event id), so whatever ran in between (a crash, offline-only pushes,
windowed runs), a re-run converges.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from featurestore.definitions import FeatureView
from featurestore.errors import BadRowsError
from featurestore.materialization.compute import latest_sql
from featurestore.offline.base import OfflineStore
from featurestore.online.base import OnlineWrites
from featurestore.registry import Definitions, RegistryStore
from featurestore.sources import connection

# (view, rows, now, whole_history) -> rows written online
OnlineWrite = Callable[[FeatureView, pa.Table, datetime, bool], int]


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
class ComputedRun:
    """What an executor computed for a view: counts, rejects, history files to commit, and its own
    handle on the rows (a table locally, object references on Ray)."""

    computed_rows: int
    rejects: pa.Table
    max_event: str | None  # the newest event time computed (ISO 8601)
    new_rows: int  # rows history lacked, written as ``files``
    files: list[Any]  # ``OfflineStore.write_files``' results, uncommitted
    partitions: Any


class ViewExecutor(Protocol):
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
        """Compute the view's rows; with ``to_history``, write those the history table lacks at
        ``history_version`` (None: no table yet) as uncommitted files."""
        ...

    def write_online(self, view: FeatureView, run: ComputedRun, now: datetime) -> int:
        """Send the run's rows online (each entity's rows lie in one partition); returns the rows written."""
        ...

    def rows(self, run: ComputedRun) -> pa.Table:
        """Every row the run computed, in one table."""
        ...


@dataclass
class Stores:
    """What the protocol writes to: the registry's marks, history, the online write, and the
    online store's sync tokens."""

    defs: Definitions
    registry: RegistryStore
    offline: OfflineStore
    write_online: OnlineWrite
    online: OnlineWrites


def write_view(
    stores: Stores,
    executor: ViewExecutor,
    view: FeatureView,
    *,
    start: datetime | None,
    end: datetime | None,
    online: bool,
    offline: bool,
    on_bad_rows: str = "reject",
    run_id: int | None = None,
) -> ViewReport:
    """Compute a view (``executor``) and write it to the selected stores, in the crash-safe order."""
    registry, history = stores.registry, stores.offline
    run_id = registry.next_run_id() if run_id is None else run_id
    now = datetime.now(UTC)
    write_offline, write_online = offline and view.offline, online and view.online
    synced = begin_history_write(stores, view, write_offline, write_online)
    table = stores.defs.layout(view).history_table
    read = history.version(table) if write_offline else None
    run = executor.compute(view, run_id, now, start, end, write_offline, read)
    report = ViewReport(view.name, computed_rows=run.computed_rows)
    keep_rejects(stores, view, run.rejects, report, on_bad_rows)
    if write_offline:
        history.commit(table, run.files, stores.defs.history_schema(view), read)
        report.new_offline_rows = run.new_rows
    if write_online:
        if synced:
            report.online_rows = executor.write_online(view, run, now)
        else:  # the whole history, as authority: the online store is made to match it
            rows = whole_history(stores, view, executor.rows(run), written=write_offline)
            report.online_rows = stores.write_online(view, rows, now, True)
    finish_run(stores, view, run_id, now, end, write_online, write_offline, run.max_event)
    return report


def keep_rejects(stores: Stores, view: FeatureView, rejects: pa.Table, report: ViewReport, on_bad_rows: str) -> None:
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
    stores.offline.write_rejects(view.name, rejects)


def begin_history_write(stores: Stores, view: FeatureView, write_offline: bool, write_online: bool) -> bool:
    """Whether the online store holds the view's whole history now (else the next online write
    sends it all); marks it not so before history changes."""
    layout = stores.defs.layout(view)
    mark = stores.registry.watermark(view.name)
    # a new storage layout starts with nothing online: everything is re-sent, as it is to an online
    # store without the token the last write left (emptied, another one, an older copy); with no
    # history yet, this run's rows are the whole of it
    synced = mark.synced_under(layout.storage_id)
    synced = synced and (not write_online or mark.token_kept(stores.online.sync_token(view.name)))
    synced = synced or stores.offline.version(layout.history_table) is None
    if view.online and write_offline:
        stores.registry.set_watermark(view.name, online_synced=False)
    return synced


def finish_run(
    stores: Stores,
    view: FeatureView,
    run_id: int,
    now: datetime,
    end: datetime | None,
    wrote_online: bool,
    wrote_offline: bool,
    max_event: str | None,
) -> None:
    """Record what the run wrote: the online store in sync, history up to ``end``."""
    marks: dict[str, Any] = {}
    if wrote_online:
        token = secrets.token_hex(8)
        stores.online.set_sync_token(view.name, token)  # (a crash before the mark: a re-run re-sends)
        marks.update(online_synced=True, online_layout=stores.defs.layout(view).storage_id, online_token=token)
    if wrote_offline:
        marks.update(last_run_id=run_id, materialized_at=now.isoformat())
        if end is not None:
            marks["end"] = end.isoformat()
        if max_event:
            marks["max_event_timestamp"] = max_event
    if marks:
        stores.registry.set_watermark(view.name, **marks)


def whole_history(stores: Stores, view: FeatureView, computed: pa.Table, written: bool) -> pa.Table:
    """What the online store must hold from every stored row of the view (and the computed ones,
    if not stored): each entity's latest row, or for an aggregated view every event."""
    con = connection()
    stores.offline.register(con, stores.defs.layout(view).history_table, "history", computed.schema)
    rows = "SELECT * FROM history"
    if not written:
        con.register("computed", computed)
        rows += " UNION ALL SELECT * FROM computed"
    query = rows if view.is_aggregated else latest_sql(f"({rows})", view.join_keys, computed.schema.names)
    return con.sql(query).to_arrow_table().cast(computed.schema)


def max_event_iso(rows: pa.Table) -> str | None:
    """The newest event time of ``rows`` (ISO 8601), None without rows."""
    return pc.max(rows["event_timestamp"]).as_py().isoformat() if rows.num_rows else None
