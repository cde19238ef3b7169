"""Feature logging: every served feature vector, written to a Delta table off the request path.

``log()`` appends to an in-memory buffer (no I/O, never raises); a background thread
flushes it every second to ``<data_dir>/feature_logs/<name>``. While the table cannot be
written (a read-only or missing folder, a full disk), rows wait in the buffer up to its bound and
the thread keeps trying every second (a cheap probe first, so an outage costs no merging), so
rows flow again within a second of the folder being writable. Past the bound the oldest entries
are dropped: counted (``dropped_rows``, and in the servers' ``/metrics``) and logged. Serving
never blocks or fails on logging.

A flush a second is a file a second (86,400 a day, each a Delta commit): every
``COMPACT_EVERY`` flushes the thread merges the table's small files (``offline.compaction``;
the servers' appends wait meanwhile, ``WRITERS_LOCK``) and deletes the files merged away ``VACUUM_HOURS`` before, so the
folder holds what the log holds and reading it (``check-consistency``, ``monitor``, the UI's
served statistics) does not slow down day after day; ``featurestore compact`` does the same for
every log.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from featurestore.errors import FeatureStoreError
from featurestore.files import file_lock
from featurestore.offline.compaction import compact
from featurestore.offline.statistics import SERVED, CommitStatistics
from featurestore.offline.tables import Tables
from featurestore.online.codec import micros_to_datetime
from featurestore.storage import Location

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore
    from featurestore.retrieval.online import OnlineQuery, OnlineResponse
    from featurestore.statistics import Summary

MODEL_COLUMNS = ("model_name", "model_version", "score")
COMPACT_EVERY = 600  # flushes between merges of a log's small files (a flush a second: ten minutes)
VACUUM_HOURS = 24  # how long files merged away stay (for readers of an older version, a late statistics catch-up)
WRITERS_LOCK = ".writers.lock"  # held shared by each append, exclusive by a merge (a hidden file: Delta ignores it)
log = logging.getLogger(__name__)


def log_path(data_dir: Path, name: str) -> Path:
    """Where a model's log lives (``service:<name>`` for a feature service's lookups)."""
    if name.startswith("service:"):
        return Path(data_dir) / "feature_logs" / "services" / name.split(":", 1)[1]
    return Path(data_dir) / "feature_logs" / name


def vector_schema(
    store: FeatureStore, service_name: str, request_inputs: Sequence[str] = (), with_model: bool = False
) -> pa.Schema:
    """Columns of a served-vector log: time, request, keys, inputs, each feature and its status (and the score)."""
    defs = store.definitions
    refs = store.get_feature_service(service_name).feature_refs()
    fields = [
        pa.field("served_at", pa.timestamp("us", tz="UTC")),
        pa.field("request_id", pa.string()),
        pa.field("replayed", pa.bool_()),
    ]  # served at a time the caller gave (``at``): checked as of event time
    if with_model:
        fields += [pa.field("model_name", pa.string()), pa.field("model_version", pa.int32())]
    keys: dict[str, pa.DataType] = {}
    for ref in refs:
        odfv = defs.on_demand_feature_views.get(ref.split(":")[0])
        for view in [r.split(":")[0] for r in odfv.input_refs] if odfv else [ref.split(":")[0]]:
            keys.update({k: t.arrow for k, t in defs.key_types[view].items()})
    fields += [pa.field(k, t) for k, t in keys.items()]
    fields += [pa.field(i, pa.float64()) for i in request_inputs]
    for ref in refs:  # request fields of on-demand features: logged, so the offline recomputation gets them
        odfv = defs.on_demand_feature_views.get(ref.split(":")[0])
        for f in odfv.request_fields if odfv else []:
            if f.name not in [x.name for x in fields]:
                fields.append(pa.field(f.name, f.dtype.arrow))
    for ref in refs:
        feature = ref.split(":")[1]
        fields += [pa.field(feature, defs.feature_type(ref).arrow), pa.field(f"{feature}__status", pa.string())]
    if with_model:
        fields.append(pa.field("score", pa.float32()))
    return pa.schema(fields)


def vector_entry(query: OnlineQuery, response: OnlineResponse, **extra: list[Any]) -> dict[str, list[Any]]:
    """One request's served vectors as log columns (``extra``: inputs, model fields, scores), at the
    time the lookup was evaluated at."""
    n = len(query.key_columns[0])
    entry: dict[str, list[Any]] = {
        "served_at": [micros_to_datetime(query.now_us)] * n,
        "request_id": [uuid.uuid4().hex] * n,
        "replayed": [query.replayed] * n,
        **dict(zip(query.key_names, query.key_columns)),
        **(query.request_columns or {}),
        **extra,
    }
    keys = len(query.key_names)
    for name, values, statuses in zip(response.feature_names[keys:], response.values[keys:], response.statuses[keys:]):
        entry[name], entry[f"{name}__status"] = values, statuses
    return entry


Counts = Callable[[str, int], None]  # (outcome: "logged", "dropped" or "failed flush", how many)


class FeatureLogger:
    """Buffers logged feature vectors and appends them to Delta off the request path.

    Bounded: past ``max_buffered_rows`` the oldest entries are dropped, counted
    (``dropped_rows``; ``count``, if given, hears every outcome) and logged, so a log store that
    is down costs memory up to the bound, never serving latency."""

    def __init__(
        self,
        path: Path,
        schema: pa.Schema,
        flush_interval: float = 1.0,
        max_buffered_rows: int = 100_000,
        count: Counts | None = None,
    ):
        self.path, self.schema = Path(path), schema
        self.interval, self.max_rows = flush_interval, max_buffered_rows
        self._buffer: deque[dict[str, list[Any]]] = deque()
        self._rows = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.logged_rows = 0
        self.dropped_rows = 0
        self.failed_flushes = 0
        self._flushes = 0
        self._reported_drops = 0
        self._count = count or (lambda outcome, n: None)
        # the log's statistics per hour served, caught up in the background after flushes
        self.statistics = CommitStatistics(Tables(Location(str(self.path.parent.resolve()))), SERVED)
        self._thread = threading.Thread(target=self._run, name="feature-logger", daemon=True)
        self._thread.start()

    def log(self, columns: dict[str, list[Any]]) -> None:
        with self._lock:
            self._buffer.append(columns)
            self._rows += _rows(columns)
            self._trim()

    def flush(self) -> int:
        """Write what is buffered; returns the rows written (0 when the table cannot be written now:
        they stay buffered, within the bound)."""
        with self._lock:
            if not self._buffer:
                return 0
        problem = self._unwritable()
        if problem is not None:
            self._failed(problem)
            return 0
        with self._lock:
            pending, self._buffer, self._rows = list(self._buffer), deque(), 0
        try:
            merged: dict[str, list[Any]] = {f.name: [] for f in self.schema}
            for entry in pending:  # one Arrow array per column, not per request: short GIL holds
                for name, column in merged.items():
                    column.extend(entry[name])
            table = pa.table({f.name: pa.array(merged[f.name], f.type) for f in self.schema}, schema=self.schema)
            held = self._table_to_append()
            with file_lock(self.path / WRITERS_LOCK, shared=True):  # (a merge waits for appends in flight)
                write_deltalake(
                    held if held is not None else str(self.path), table, mode="append", schema_mode="merge"
                )  # (logs from before a column was added)
        except Exception as exc:  # never let logging hurt serving; keep the rows (within the bound) for the next try
            with self._lock:
                for entry in reversed(pending):
                    self._buffer.appendleft(entry)
                self._rows += sum(_rows(c) for c in pending)
                self._trim()
            self._failed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return 0
        if self.failed_flushes:
            log.warning(
                "feature log %s: written again after %d failed flushes (%d rows dropped in all)",
                self.path,
                self.failed_flushes,
                self.dropped_rows,
            )
            self.failed_flushes = 0
        self.logged_rows += table.num_rows
        self._count("logged", table.num_rows)
        self.statistics.soon(self.path.name)
        self._flushes += 1
        if self._flushes % COMPACT_EVERY == 0:
            try:  # (a merge that fails waits for the next turn)
                compact_log(self.path)
            except Exception as exc:  # noqa: BLE001 - merging saves reads and files; logging goes on
                log.warning("feature log %s: merging its small files failed (%s); retried later", self.path, exc)
        return table.num_rows

    def _table_to_append(self) -> DeltaTable | None:
        """The log's table (None: none yet), opened once for the check and the append. Raises where
        it holds a column of this logger's under another type: Delta would cast the values (a
        float to an integer: a wrong value logged) or refuse them. A logger's first flush, that of
        definitions applied since, moves that table aside (``<name>.until-<time>``) and starts the
        log anew; a later one's rows wait (bounded) until its server has reloaded the definitions."""
        held = self._opened()
        changed = self._changed_columns(held)
        if not changed:
            return held
        if self._flushes == 0:
            with file_lock(self.path / WRITERS_LOCK):  # (another worker may have moved it already)
                if self._changed_columns(self._opened()):
                    aside = self.path.with_name(f"{self.path.name}.until-{datetime.now(UTC):%Y%m%dT%H%M%S%f}")
                    self.path.rename(aside)
                    self.path.mkdir()
                    log.warning(
                        "feature log %s: columns %s changed type; the log so far moved to %s, a new one starts",
                        self.path,
                        changed,
                        aside,
                    )
            return self._opened()
        raise FeatureStoreError(
            f"the log's columns {changed} hold another type since a newer server wrote them; "
            "these rows wait until this server reloads the definitions"
        )

    def _opened(self) -> DeltaTable | None:
        return DeltaTable(str(self.path)) if (self.path / "_delta_log").exists() else None

    def _changed_columns(self, table: DeltaTable | None) -> list[str]:
        """This logger's columns ``table`` holds under another type."""
        if table is None:
            return []
        held = {f.name: _plain(f.type) for f in pa.schema(table.schema().to_arrow())}
        return [f.name for f in self.schema if f.name in held and held[f.name] != _plain(f.type)]

    def _unwritable(self) -> str | None:
        """Why the table's folder cannot be written now (a file made and removed there), or None."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            return f"{self.path} is not writable ({exc.strerror or exc})"
        return None

    def _failed(self, reason: str) -> None:
        self.failed_flushes += 1
        self._count("failed flush", 1)
        if self.failed_flushes == 1:
            log.warning(
                "feature log %s: flush failed (%s); rows wait in memory (at most %d) and are retried every %.0f s",
                self.path,
                reason,
                self.max_rows,
                self.interval,
            )
        new_drops = self.dropped_rows - self._reported_drops
        if new_drops:
            self._reported_drops = self.dropped_rows
            log.warning(
                "feature log %s: dropped %d logged rows, the oldest (the buffer holds at most %d while flushes fail)",
                self.path,
                new_drops,
                self.max_rows,
            )

    def _trim(self) -> None:
        """Drop the oldest entries past the bound (the lock is held)."""
        while self._rows > self.max_rows and self._buffer:
            dropped = _rows(self._buffer.popleft())
            self._rows -= dropped
            self.dropped_rows += dropped
            self._count("dropped", dropped)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()
        self.statistics.stop()  # (what is not summarized yet, the next read of the statistics is)


class FollowedLog:
    """A server's log at ``path`` whose columns follow what it serves under: the same
    ``FeatureLogger`` while the ``key`` given (the definitions, the model version) is equal, a
    new one once it changes and the columns with it (the previous one closed first: its rows go
    into the log as it was, and the new one's first flush starts a new one where columns changed
    type)."""

    def __init__(self, path: Path, count: Counts | None = None):
        self.path, self.count = path, count
        self._key: object = None
        self._logger: FeatureLogger | None = None

    def logger(self, key: object, schema: Callable[[], pa.Schema]) -> FeatureLogger:
        if self._logger is not None and key == self._key:
            return self._logger
        columns = schema()
        if self._logger is None or columns != self._logger.schema:
            if self._logger is not None:
                self._logger.close()
            self._logger = FeatureLogger(self.path, columns, count=self.count)
        self._key = key
        return self._logger

    def close(self) -> None:
        if self._logger is not None:
            self._logger.close()


def _plain(dtype: pa.DataType) -> pa.DataType:
    """A type as compared across Arrow and Delta: large and view variants as the plain one."""
    if pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return pa.string()
    if pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype):
        return pa.binary()
    if pa.types.is_large_list(dtype) or pa.types.is_list_view(dtype) or pa.types.is_list(dtype):
        return pa.list_(_plain(dtype.value_type))
    if pa.types.is_timestamp(dtype):
        return pa.timestamp("us", tz="UTC" if dtype.tz else None)
    return dtype


def _rows(columns: dict[str, list[Any]]) -> int:
    return len(next(iter(columns.values())))


def served_statistics(
    data_dir: Path, name: str, since: datetime | None = None, until: datetime | None = None
) -> list[tuple[datetime, str, Summary]]:
    """(hour served, column, summary) of a log (``log_path``'s names), in ``[since, until)``:
    each feature, its ``__status`` (NOT_FOUND and the rest, counted) and the keys."""
    return served_statistics_versioned(data_dir, name, since, until)[1]


def served_statistics_versioned(
    data_dir: Path, name: str, since: datetime | None = None, until: datetime | None = None
) -> tuple[str | None, list[tuple[datetime, str, Summary]]]:
    """``served_statistics``, with which statistics it read (``CommitStatistics.versioned``)."""
    path = log_path(data_dir, name)
    return _log_statistics(str(path.parent.resolve())).versioned(path.name, since, until)


@functools.lru_cache(maxsize=32)
def _log_statistics(folder: str) -> CommitStatistics:
    """One per folder of logs: its table handles follow their logs (read only the commits since)."""
    return CommitStatistics(Tables(Location(folder)), SERVED)


def compact_log(path: Path) -> dict[str, int]:
    """Merge a log's small files (``offline.compaction``) and delete those merged away over
    ``VACUUM_HOURS`` ago: ``files_before``, ``files_after``, ``files_vacuumed``."""
    where = Location(str(Path(path).resolve()))
    with file_lock(Path(path) / WRITERS_LOCK):  # (the servers' appends wait: none overtakes the merge's plan)
        before = len(DeltaTable(where.url).file_uris())
        compact(where)
    table = DeltaTable(where.url)
    vacuumed = table.vacuum(retention_hours=VACUUM_HOURS, dry_run=False, enforce_retention_duration=False)
    return {"files_before": before, "files_after": len(table.file_uris()), "files_vacuumed": len(vacuumed)}


def logs(data_dir: Path) -> list[Path]:
    """Every feature log under ``data_dir`` (models' and services')."""
    root = Path(data_dir) / "feature_logs"
    return sorted(p.parent for p in [*root.glob("*/_delta_log"), *root.glob("services/*/_delta_log")])


def read_log(path: Path) -> pa.Table:
    if not (Path(path) / "_delta_log").exists():
        raise FileNotFoundError(f"no feature log at {path}; serve some predictions first")
    return DeltaTable(str(path)).to_pyarrow_table()
