"""Statistics of a history table, kept beside it: each commit's rows summarized per event day.

The statistics are a function of the history, maintained incrementally and exactly once per
commit: ``catch_up`` reads the commits the statistics table does not cover yet (from the Delta
log: the files each one added with ``dataChange``, so compactions, which move rows, count
nothing), summarizes the rows those files hold, and appends the summaries tagged with the
commit's version. Writers call it after they commit; a crash in between leaves a commit
uncovered, which the next call (any writer's, or a read) covers. Two processes catching up at once
may both cover a version: readers keep one copy per version.

Tables live at ``_statistics/<history table>`` under the history location (local or S3).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import write_deltalake

from featurestore.object_requests import FileSystem
from featurestore.offline.base import HISTORY_COLUMNS, PARTITION_COLUMN
from featurestore.offline.compaction import compact
from featurestore.offline.tables import Tables
from featurestore.statistics import DAY, STATISTICS_SCHEMA, Summary, from_table, summarize

log = logging.getLogger(__name__)
FOLDER = "_statistics"
NOT_SUMMARIZED = set(HISTORY_COLUMNS) | {PARTITION_COLUMN}  # bookkeeping, not features (event time is the bucket)
COMPACT_AFTER_FILES = 64  # a drain appends a small file each time: merged past this many
SCHEMA = pa.schema([pa.field("version", pa.int64()), *STATISTICS_SCHEMA])


class HistoryStatistics:
    """The statistics tables of the history tables under ``tables``' location."""

    def __init__(self, tables: Tables):
        self.tables = tables
        self.location = tables.location

    def uri(self, history_table: str) -> str:
        return self.location.child(FOLDER, history_table).url

    def covered(self, history_table: str) -> set[int]:
        table = self.tables.open(self.uri(history_table))
        if table is None:
            return set()
        return set(pc.unique(table.to_pyarrow_table(columns=["version"])["version"]).to_pylist())

    def catch_up(self, history_table: str) -> int:
        """Summarize the commits of ``history_table`` not covered yet; returns how many."""
        history = self.tables.open(self.location.child(history_table).url, fresh=True)
        if history is None:
            return 0
        missing = sorted(set(range(history.version() + 1)) - self.covered(history_table))
        if not missing:
            return 0
        fs, root = self.location.filesystem()
        found = []
        for version in missing:
            added = _added_files(fs, f"{root}/{history_table}", version)
            rows = None
            if added:
                parts = [pq.read_table(f"{root}/{history_table}/{path}", filesystem=fs) for path in added]
                rows = pa.concat_tables(parts, promote_options="default")
            found.append(self._summaries(version, rows))
        write_deltalake(
            self.uri(history_table), pa.concat_tables(found), mode="append", storage_options=self.tables.options
        )
        table = self.tables.open(self.uri(history_table), fresh=True)
        if table is not None and len(table.file_uris()) > COMPACT_AFTER_FILES:
            compact(self.location.child(FOLDER, history_table))
        return len(missing)

    def read(
        self, history_table: str, since: datetime | None = None, until: datetime | None = None
    ) -> list[tuple[datetime, str, Summary]]:
        """Every (bucket, feature, summary) of the table's history, in ``[since, until)`` by event
        time (whole days), commits not covered yet summarized first."""
        self.catch_up(history_table)
        table = self.tables.open(self.uri(history_table))
        if table is None:
            return []
        rows = table.to_pyarrow_table()
        rows = rows.filter(pc.is_valid(rows["bucket"]))  # (commits that added no rows)
        if since is not None:
            rows = rows.filter(pc.greater_equal(rows["bucket"], pa.scalar(since, rows.schema.field("bucket").type)))
        if until is not None:
            rows = rows.filter(pc.less(rows["bucket"], pa.scalar(until, rows.schema.field("bucket").type)))
        # one copy per (version, bucket, feature): two catch-ups may both have covered a commit
        seen: set[tuple[int, datetime, str]] = set()
        keep = []
        for i, key in enumerate(zip(*(rows[c].to_pylist() for c in ("version", "bucket", "feature")), strict=True)):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        return from_table(rows.take(pa.array(keep, pa.int64())))

    def drop(self, history_table: str) -> None:
        fs, root = self.location.filesystem()
        try:
            fs.delete_dir(f"{root}/{FOLDER}/{history_table}")
        except (FileNotFoundError, OSError):
            pass

    def _summaries(self, version: int, rows: pa.Table | None) -> pa.Table:
        if rows is None or rows.num_rows == 0:  # a commit without rows: covered, nothing to say
            marker: dict[str, list] = {name: [None] for name in SCHEMA.names}
            marker["version"] = [version]
            return pa.table(marker, schema=SCHEMA)
        features = [c for c in rows.column_names if c not in NOT_SUMMARIZED]
        summaries = summarize(rows, features, "event_timestamp", DAY)
        return summaries.add_column(0, "version", pa.array([version] * summaries.num_rows, pa.int64()))


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
