"""Statistics of a Delta table, kept beside it: each commit's rows summarized per time bucket
(history tables per event day, with how late each row was known, ``HISTORY``; served-vector logs
per hour served, ``SERVED``).

The statistics are a function of the table, maintained incrementally and exactly once per
commit: ``catch_up`` reads the commits the statistics table does not cover yet (from the Delta
log: the files each one added with ``dataChange``, so compactions, which move rows, count
nothing), summarizes the rows those files hold, and appends the summaries tagged with the
commit's version. Writers call it after they commit; a crash in between leaves a commit
uncovered, which the next call (any writer's, or a read) covers. Two processes catching up at once
may both cover a version: readers keep one catch-up's rows per version.

Statistics tables live at ``_statistics/<table>`` under the tables' location (local or S3).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import write_deltalake

from featurestore.object_requests import FileSystem
from featurestore.offline.base import HISTORY_COLUMNS, PARTITION_COLUMN
from featurestore.offline.compaction import compact
from featurestore.offline.tables import Tables
from featurestore.statistics import DAY, HOUR, STATISTICS_SCHEMA, Kind, Summary, from_table, merged_by, summarize

log = logging.getLogger(__name__)
FOLDER = "_statistics"
LAG_COLUMN = "_known_after_s"  # seconds from a row's event time to when it was known (created time)
COMPACT_AFTER_FILES = 64  # a drain appends a small file each time: merged past this many
PARSED_KEPT = 16  # statistics tables kept parsed in memory (by version: a new commit is read anew)
_PARSED: OrderedDict[tuple[str, str], list[tuple[datetime, str, Summary]]] = OrderedDict()
_PARSED_LOCK = threading.Lock()  # (reads run in server threads)
SETTLE_SECONDS = 2.0  # the background catch-up starts once the writes have paused this long,
MOST_DELAY_SECONDS = 60.0  # or this long after it was asked for (a log flushed every second never pauses)


@dataclass(frozen=True)
class Summarized:
    """How a kind of table is summarized: its time column, the buckets' width, the columns left
    out (bookkeeping), and which columns count as text whatever their type (keys: top values)."""

    time_column: str
    width: timedelta
    skipped: frozenset[str]
    keys: Callable[[list[str]], list[str]]
    lag_from: str | None = None  # a column of when each row was known: its delay summarized as ``LAG_COLUMN``


HISTORY = Summarized(
    "event_timestamp",
    DAY,
    frozenset(HISTORY_COLUMNS) | {PARTITION_COLUMN},
    lambda columns: columns[: columns.index("event_timestamp")],  # (``history_schema``: keys first)
    lag_from="created_timestamp",
)
SERVED = Summarized(
    "served_at", HOUR, frozenset({"request_id", "replayed", "model_name", "model_version"}), lambda columns: []
)


EXIT_WAIT_SECONDS = 60.0  # a catch-up under way when the interpreter exits is waited for this long at most


class CommitStatistics:
    """The statistics tables of the Delta tables under ``tables``' location, summarized as ``how``."""

    def __init__(self, tables: Tables, how: Summarized = HISTORY):
        self.tables, self.how = tables, how
        self.location = tables.location
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._pending: set[str] = set()
        self._busy = self._stopping = False
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    def uri(self, name: str) -> str:
        return self.location.child(FOLDER, name).url

    def covered(self, name: str) -> set[int]:
        table = self.tables.open(self.uri(name))
        if table is None:
            return set()
        return set(pc.unique(table.to_pyarrow_table(columns=["version"])["version"]).to_pylist())

    def catch_up(self, name: str) -> int:
        """Summarize the commits of the table ``name`` not covered yet; returns how many."""
        source = self.tables.open(self.location.child(name).url)
        if source is None:
            return 0
        missing = sorted(set(range(source.version() + 1)) - self.covered(name))
        if not missing:
            return 0
        fs, root = self.location.filesystem()
        writer = uuid.uuid4().hex
        found = []
        for version in missing:
            added = _added_files(fs, f"{root}/{name}", version)
            # a file at a time: memory stays bounded by a file (and a history file holds one event day)
            parts = []
            for path in added:
                try:
                    with fs.open_input_file(f"{root}/{name}/{path}") as file:
                        parts.append(self._summaries(pq.read_table(file)))
                except FileNotFoundError:  # (vacuumed since: the commit was merged away long ago)
                    log.warning("statistics of %s: %s is gone (vacuumed); its rows go unsummarized", name, path)
            summaries = pa.concat_tables(parts) if parts else _marker()
            found.append(_tagged(summaries, version, writer))
        write_deltalake(self.uri(name), pa.concat_tables(found), mode="append", storage_options=self.tables.options)
        table = self.tables.open(self.uri(name))
        if table is not None and len(table.file_uris()) > COMPACT_AFTER_FILES:
            compact(self.location.child(FOLDER, name))
        return len(missing)

    def soon(self, name: str) -> None:
        """Catch ``name`` up in this process's background thread once writes pause (writers call
        it after a commit: the write does not wait; what a process leaves undone at exit, the next
        catch-up does: any writer's, or the first read's)."""
        with self._lock:
            self._pending.add(name)
            self._stopping = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="statistics", daemon=True)
                self._thread.start()
            self._wake.set()

    def stop(self) -> None:
        """Drop the background work not started yet (a closed store: the next catch-up, any
        process's, covers those commits); a catch-up under way finishes."""
        with self._lock:
            self._pending.clear()
            self._stopping = True
            self._wake.set()

    def finish(self, timeout: float) -> None:
        """``stop``, then wait up to ``timeout`` for a catch-up under way."""
        self.stop()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def idle(self, timeout: float) -> bool:
        """Wait until the background thread has nothing left to do; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._busy:
                    return True
            time.sleep(0.02)
        return False

    def _work(self) -> None:
        while True:
            began = time.monotonic()  # each commit restarts the wait (a burst of writes goes first), up to a bound
            while (
                self._wake.wait(SETTLE_SECONDS) and not self._stopping and time.monotonic() - began < MOST_DELAY_SECONDS
            ):
                self._wake.clear()
            with self._lock:
                tables, self._pending = self._pending, set()
                if not tables:
                    self._thread = None
                    return
                self._busy = True
            for name in sorted(tables):
                if self._stopping:  # (the rest waits for the next catch-up)
                    break
                try:
                    self.catch_up(name)
                except Exception as exc:  # (an outage, a full disk: the next commit or read catches up)
                    log.warning("statistics of %s not brought up to date (%s); the next commit or read does", name, exc)
            with self._lock:
                self._busy = False

    def read(
        self, name: str, since: datetime | None = None, until: datetime | None = None
    ) -> list[tuple[datetime, str, Summary]]:
        """Every (bucket, column, summary) of the table, in ``[since, until)`` by bucket start
        (one per bucket and column), commits not covered yet summarized first."""
        return self.versioned(name, since, until)[1]

    def versioned(
        self, name: str, since: datetime | None = None, until: datetime | None = None
    ) -> tuple[str | None, list[tuple[datetime, str, Summary]]]:
        """``read``, with which statistics it read: the table's id and version (None: no statistics
        yet). A table dropped and made again has a new id, so its version 0 is not the old one's."""
        self.catch_up(name)
        table = self.tables.open(self.uri(name))
        if table is None:
            return None, []
        key = (self.uri(name), f"{table.metadata().id}@{table.version()}")
        with _PARSED_LOCK:
            found = _PARSED.get(key)
            if found is not None:
                _PARSED.move_to_end(key)
        if found is None:
            found = _per_bucket(table.to_pyarrow_table())
            with _PARSED_LOCK:
                _PARSED[key] = found
                while len(_PARSED) > PARSED_KEPT:
                    _PARSED.popitem(last=False)
        return key[1], [x for x in found if (since is None or x[0] >= since) and (until is None or x[0] < until)]

    def drop(self, name: str) -> None:
        fs, root = self.location.filesystem()
        try:
            fs.delete_dir(f"{root}/{FOLDER}/{name}")
        except (FileNotFoundError, OSError):
            pass

    def _summaries(self, rows: pa.Table) -> pa.Table:
        how = self.how
        if how.lag_from is not None and how.lag_from in rows.column_names:  # how late the rows were known
            micros = pc.subtract(rows[how.lag_from].cast(pa.int64()), rows[how.time_column].cast(pa.int64()))
            rows = rows.append_column(LAG_COLUMN, pc.divide(micros.cast(pa.float64()), 1e6))
        columns = [c for c in rows.column_names if c not in how.skipped and c != how.time_column]
        keys: dict[str, Kind] = {k: "text" for k in how.keys(rows.column_names)}
        return summarize(rows, columns, how.time_column, how.width, keys)


def _per_bucket(rows: pa.Table) -> list[tuple[datetime, str, Summary]]:
    """A statistics table's rows as one summary per (bucket, column), in bucket order."""
    # one catch-up's rows per commit: two processes catching up at once may both have covered one
    first = rows.group_by("version").aggregate([("writer", "min")])
    rows = rows.join(first, keys=["version", "writer"], right_keys=["version", "writer_min"], join_type="inner")
    rows = rows.filter(pc.is_valid(rows["bucket"]))  # (commits that added no rows)
    found = merged_by(((at, column), s) for at, column, s in from_table(rows))
    return [(at, column, s) for (at, column), s in sorted(found.items(), key=lambda item: item[0][0])]


def _marker() -> pa.Table:
    """A commit that added no rows (a schema change): covered, with nothing to say (no bucket)."""
    return pa.table({name: [None] for name in STATISTICS_SCHEMA.names}, schema=STATISTICS_SCHEMA)


def _tagged(summaries: pa.Table, version: int, writer: str) -> pa.Table:
    n = summaries.num_rows
    return summaries.add_column(0, "writer", pa.array([writer] * n, pa.string())).add_column(
        0, "version", pa.array([version] * n, pa.int64())
    )


_LIVE: weakref.WeakSet[CommitStatistics] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """Background catch-ups end before the interpreter does, even in a process that never closed
    its store: one still inside an object store's native read when the interpreter finalizes
    aborts the process (``PyGILState_Release``), and exits with a crash instead of 0."""
    for statistics in list(_LIVE):
        statistics.finish(EXIT_WAIT_SECONDS)


def _added_files(fs: FileSystem, table_root: str, version: int) -> list[str]:
    """Data files the commit ``version`` added with a data change (compactions add none)."""
    path = f"{table_root}/_delta_log/{version:020d}.json"
    try:
        with fs.open_input_stream(path) as stream:
            text = stream.read().decode()
    except (FileNotFoundError, OSError):
        log.warning(
            "statistics of %s: commit %d is no longer in the Delta log; its rows go unsummarized", table_root, version
        )
        return []
    added = []
    for line in text.splitlines():
        action = json.loads(line) if line.strip() else {}
        add = action.get("add")
        if add and add.get("dataChange", True):
            added.append(unquote(add["path"]))
    return added
