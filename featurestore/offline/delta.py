"""History store on Delta Lake: one table per view, partitioned by event date, on local disk or
object storage (``storage.Location``).

Appends are Delta commits: a crash mid-write leaves uncommitted files that no reader sees, the
previous version stays readable, and a re-run (deduplicated by ``_row_id``) completes the job.
Writers take no lock: each deduplicates against the version it read and commits expecting the
next one; a writer that finds it taken (a concurrent run, another machine) takes out of its files
the rows committed since, and commits on the newer version (``commit``). DuckDB reads local
Parquet files itself; files on object storage through local copies (``file_cache``) or, with no
cache, pyarrow datasets.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

from featurestore.errors import FeatureStoreError
from featurestore.object_requests import CountedFileSystem, FileSystem, count_delta
from featurestore.offline.base import PARTITION_COLUMN as PARTITION
from featurestore.offline.compaction import compact
from featurestore.offline.file_cache import FileCache
from featurestore.offline.statistics import CommitStatistics
from featurestore.offline.tables import Tables
from featurestore.sources import connection, ident, quote
from featurestore.storage import Location

log = logging.getLogger(__name__)
UPLOAD_THREADS = 16  # new history files uploaded at once
COMMIT_ATTEMPTS = 50  # commits retried on a newer version before giving up (each one lost a race)


def _require_files(view: str, version: int, gone: list[str]) -> None:
    """A pinned version's files are all there (a vacuum deletes those only old versions use)."""
    if gone:
        raise FeatureStoreError(
            f"the history of {view!r} at version {version} lost {len(gone)} file(s) to a vacuum (offline_store.vacuum_after_hours, "
            f"`featurestore compact --vacuum-hours`), e.g. {gone[0]}; rows as of that version cannot be read back, so "
            "this export cannot be reproduced: export again from the current version"
        )


class DeltaOfflineStore:
    def __init__(self, location: Location | Path, cache: FileCache | None = None, statistics: bool = True):
        """History tables under ``location``; on object storage, data files read and written are
        kept in ``cache`` (local copies: joins read local disk) when one is given. ``statistics``:
        commits bring their statistics up to date (else only reads of them do)."""
        self.location = location if isinstance(location, Location) else Location(str(Path(location).resolve()))
        self.options = self.location.delta_options()
        self.cache = cache if not self.location.is_local else None
        self._fs: tuple[FileSystem, str] | None = None
        self._tables = Tables(self.location)  # followed, not reopened (``tables``)
        self.statistics = CommitStatistics(self._tables)
        self.summarize_commits = statistics

    @property
    def filesystem(self) -> tuple[FileSystem, str]:
        """The pyarrow file system holding the tables, and the root's path in it."""
        if self._fs is None:
            self._fs = self.location.filesystem()
        return self._fs

    def table_uri(self, view: str) -> str:
        return self.location.child(view).url

    def table_path(self, view: str) -> Path:
        """The table's folder (local disk only)."""
        return self.location.path / view

    def _delta_commit(self) -> None:
        count_delta("delta commit", self.location.is_local)

    def _open(self, uri: str, version: int | None = None) -> DeltaTable | None:
        return self._tables.open(uri, version)

    def _table(self, view: str, version: int | None = None) -> DeltaTable | None:
        return self._open(self.table_uri(view), version)

    def version(self, view: str) -> int | None:
        table = self._table(view)
        return table.version() if table is not None else None

    def append(self, view: str, rows: pa.Table) -> pa.Table:
        """Append rows not already stored; return those (without the partition column)."""
        if rows.num_rows == 0:
            return rows
        # the write path reads a table opened anew, never a followed handle (reads follow the log):
        # what it deduplicates against is what its commit builds on
        snapshot = self._tables.open(self.table_uri(view), fresh=True)
        read = snapshot.version() if snapshot is not None else None
        fresh = self.new_rows(view, rows, read)  # (the snapshot: this thread's handle at ``read``)
        if fresh.num_rows:
            self.commit(view, self.write_files(view, fresh), rows.schema, read, snapshot)
        return fresh.drop_columns([PARTITION])

    def new_rows(self, view: str, rows: pa.Table, version: int | None) -> pa.Table:
        """``rows`` (with the partition column added) that the table at ``version`` does not hold, by
        ``_row_id``: read-only, so distributed tasks can run it; ``commit`` takes out what was
        committed after ``version``."""
        rows = rows.append_column(PARTITION, pc.cast(rows["event_timestamp"], pa.date32()))
        con = connection()
        con.register("batch", rows)
        # within-batch duplicates (identical rows) are one fact; counting first spares the usual
        # duplicate-free batch a ranking of every row
        unique = con.execute("SELECT count(DISTINCT _row_id) FROM batch").fetchall()[0][0] == rows.num_rows
        new = "SELECT * FROM batch" + ("" if unique else " QUALIFY row_number() OVER (PARTITION BY _row_id) = 1")
        table = self._table(view, version) if version is not None else None
        files = []
        if table is not None:
            dates = [str(d) for d in pc.unique(rows[PARTITION]).to_pylist()]
            files = table.file_uris(file_pruning_predicate=[(PARTITION, "in", dates)])
        if files:
            stored = self._scan(con, "stored", files, pa.schema([("_row_id", pa.int64())]))
            new = f"SELECT * FROM ({new}) ANTI JOIN (SELECT _row_id FROM {stored}) USING (_row_id)"
        elif unique:
            return rows
        return con.sql(new).to_arrow_table().cast(rows.schema)

    def _scan(self, con: duckdb.DuckDBPyConnection, name: str, files: list[str], schema: pa.Schema) -> str:
        """A DuckDB relation over data files, by column name (files written before a column was added
        read it as null): DuckDB's own reader on local disk, a pyarrow dataset on object storage."""
        if self.cache is not None:
            files = [str(p) for p in self.cache.fetch([_fs_path(f) for f in files], self.filesystem[0])]
        if self.location.is_local or self.cache is not None:
            return f"read_parquet([{', '.join(quote(f) for f in files)}], union_by_name = true)"
        fs, _ = self.filesystem
        # streamed by pyarrow's own client (its reads are not in the request counts; with the
        # cache on, the default, joins read local copies)
        native = fs.native if isinstance(fs, CountedFileSystem) else fs
        dataset = pads.dataset([_fs_path(f) for f in files], schema=schema, format="parquet", filesystem=native)
        con.register(f"{name}__files", dataset)
        return ident(f"{name}__files")

    def write_files(self, view: str, rows: pa.Table) -> list[AddAction]:
        """Write ``new_rows``' result as Parquet files in the table's partition folders, uncommitted
        (invisible until ``commit``; a failed run leaves only files no version lists). DuckDB
        writes them, on every core, one file per partition; on object storage into a local
        folder first, then uploaded."""
        local = self.location.is_local
        root = self.table_path(view) if local else Path(tempfile.mkdtemp(prefix="featurestore-write-"))
        try:
            root.mkdir(parents=True, exist_ok=True)
            con = connection()
            con.register("fresh", rows)
            written = con.execute(
                f"""COPY fresh TO {quote(str(root))} (FORMAT parquet, COMPRESSION snappy, PARTITION_BY ({PARTITION}),
                    FILENAME_PATTERN 'part-{{uuid}}', APPEND, RETURN_STATS)"""
            ).fetchall()
            now_ms = int(time.time() * 1000)
            actions = [
                AddAction(
                    Path(filename).relative_to(root).as_posix(),
                    size,
                    {PARTITION: partition[PARTITION]},
                    now_ms,
                    True,
                    json.dumps({"numRecords": count}),
                )
                for filename, count, size, _, _, partition, _ in written
            ]
            if not local:
                self._upload(view, root, actions)
            return actions
        finally:
            if not local:
                shutil.rmtree(root, ignore_errors=True)

    def _upload(self, view: str, root: Path, actions: list[AddAction]) -> None:
        """Files written under ``root`` to the table's folder on object storage, in parallel (each
        request waits on the network, not on this machine)."""
        fs, base = self.filesystem

        def upload(action: AddAction) -> None:
            target = f"{base}/{view}/{action.path}"
            with open(root / action.path, "rb") as source, fs.open_output_stream(target) as out:
                shutil.copyfileobj(source, out, 8 << 20)
            if self.cache is not None:  # read back by this run's joins and the next run's dedup
                self.cache.keep(target, root / action.path)

        with ThreadPoolExecutor(min(UPLOAD_THREADS, len(actions) or 1)) as pool:
            list(pool.map(upload, actions))
        if self.cache is not None:
            self.cache.trim()

    def commit(
        self,
        view: str,
        actions: list[AddAction],
        schema: pa.Schema,
        read_version: int | None,
        snapshot: DeltaTable | None = None,
    ) -> int | None:
        """``_commit``, then the statistics of what it added brought up to date in the background
        (``offline.statistics``: the write never waits for them or fails on them)."""
        version = self._commit(view, actions, schema, read_version, snapshot)
        if actions and self.summarize_commits:
            self.statistics.soon(view)
        return version

    def _commit(
        self,
        view: str,
        actions: list[AddAction],
        schema: pa.Schema,
        read_version: int | None,
        snapshot: DeltaTable | None = None,
    ) -> int | None:
        """Add files written by ``write_files`` (anywhere) to the table in one transaction; returns the
        version. A column the view gained is added to the table's schema first (older rows read null).

        The commit expects the version after ``read_version``: when another writer committed first
        it fails, and the rows those commits added are taken out of these files before it is
        tried again on the newer version (so two writers never store a row twice). ``snapshot``:
        the table opened anew at ``read_version``, which the first attempt builds on."""
        full = schema.append(pa.field(PARTITION, pa.date32()))
        delta_schema = DeltaSchema.from_arrow(full)
        base = read_version
        for attempt in range(COMMIT_ATTEMPTS):
            if not actions:
                return self.version(view)
            # a commit builds on a table opened anew (a lost race makes it fail and open the table
            # again), never on a followed handle: one CI run stored a commit twice under
            # concurrent S3 writers while the write path used one (not reproduced since)
            table: DeltaTable | None = None
            if attempt == 0 and snapshot is not None and snapshot.version() == read_version:
                table = snapshot
            else:
                table = self._tables.open(self.table_uri(view), fresh=True)
            if table is None:
                self._delta_commit()
                try:
                    create_table_with_add_actions(
                        self.table_uri(view),
                        delta_schema,
                        actions,
                        mode="error",
                        partition_by=[PARTITION],
                        storage_options=self.options,
                        # deltalake retries a creation that lost the race as the next version: both
                        # creations would land, every row of both twice
                        commit_properties=CommitProperties(max_commit_retries=0),
                    )
                    return self.version(view)
                except DeltaError:
                    if self._table(view) is None:
                        raise
                    continue  # created meanwhile by another writer: resolve against it
            if table.version() != base:
                before = sum(_records(a) for a in actions)
                actions = self._without_rows_since(view, actions, base, table)
                log.info(
                    "history of %s: other writers committed up to version %d since version %s was read; "
                    "%d of this commit's %d rows were among theirs, committing the rest",
                    view,
                    table.version(),
                    base,
                    before - sum(_records(a) for a in actions),
                    before,
                )
                base = table.version()
                continue
            known = {f.name for f in table.schema().fields}
            added = [f for f in delta_schema.fields if f.name not in known]
            if added:
                self._delta_commit()
                table.alter.add_columns(added)
                # ``base`` stays: the next attempt takes out of these files the rows of whatever was
                # committed since it besides this alteration (which added none)
                continue
            expected = table.version() + 1
            self._delta_commit()
            try:
                table.create_write_transaction(
                    list[AddAction | RemoveAction](actions),
                    mode="append",
                    schema=delta_schema,
                    partition_by=[PARTITION],
                    commit_properties=CommitProperties(max_commit_retries=0),  # conflicts are resolved here
                )
                return expected
            except CommitFailedError:
                continue
        raise FeatureStoreError(
            f"history of {view!r}: {COMMIT_ATTEMPTS} other writers committed first, one after another; run again"
        )

    def _without_rows_since(
        self, view: str, actions: list[AddAction], since: int | None, table: DeltaTable
    ) -> list[AddAction]:
        """``actions`` without the rows that commits after version ``since`` stored (their files
        rewritten, or dropped when nothing of them is left)."""
        before = set(self._table(view, since).file_uris()) if since is not None else set()  # type: ignore[union-attr]
        dates = sorted({str(a.partition_values[PARTITION]) for a in actions if a.partition_values})
        added = [u for u in table.file_uris(file_pruning_predicate=[(PARTITION, "in", dates)]) if u not in before]
        if not added:
            return actions
        con = connection()
        scan = self._scan(con, "since", added, pa.schema([("_row_id", pa.int64())]))
        taken = con.sql(f"SELECT DISTINCT _row_id FROM {scan}").to_arrow_table()["_row_id"].combine_chunks()
        fs, base = self.filesystem
        landed = {_fs_path(u) for u in added}  # this writer's own files, when its commit landed unheard
        kept = []
        for action in actions:
            path = f"{base}/{view}/{action.path}"
            if path in landed:
                continue  # committed already: neither kept nor deleted
            with fs.open_input_file(path) as f:
                rows = pq.read_table(f)
            left = rows.filter(pc.invert(pc.is_in(rows["_row_id"], value_set=taken)))
            if left.num_rows == rows.num_rows:
                kept.append(action)
                continue
            fs.delete_file(path)  # never committed: nobody reads it
            if left.num_rows:
                folder, _, _ = action.path.rpartition("/")
                name = f"{folder}/part-{uuid.uuid4()}.parquet" if folder else f"part-{uuid.uuid4()}.parquet"
                with fs.open_output_stream(f"{base}/{view}/{name}") as out:
                    pq.write_table(left, out, compression="snappy")
                size = fs.get_file_info(f"{base}/{view}/{name}").size
                stats = json.dumps({"numRecords": left.num_rows})
                kept.append(AddAction(name, size, action.partition_values, action.modification_time, True, stats))
        return kept

    def register(
        self, con: duckdb.DuckDBPyConnection, view: str, name: str, schema: pa.Schema, version: int | None = None
    ) -> int | None:
        table = self._table(view, version)
        files = table.file_uris() if table is not None else []
        if version is not None:
            _require_files(view, version, self._missing(files))
        if table is None or not files:
            con.register(name, schema.empty_table())
            return table.version() if table is not None else None
        columns = ", ".join(ident(c) for c in schema.names)
        stored = {f.name for f in table.schema().fields}
        rows = self._scan(con, name, files, pa.schema([f for f in schema if f.name in stored]))
        if not set(schema.names) <= stored:  # a column added but never written yet: typed nulls
            con.register(f"{name}__typed", schema.empty_table())
            rows = f"(SELECT * FROM {rows} UNION ALL BY NAME SELECT * FROM {ident(name + '__typed')})"
        con.execute(f"CREATE OR REPLACE TEMP VIEW {ident(name)} AS SELECT {columns} FROM {rows}")
        return table.version()

    def _missing(self, files: list[str]) -> list[str]:
        fs, _ = self.filesystem
        infos = fs.get_file_info([_fs_path(f) for f in files])
        return [f for f, info in zip(files, infos) if info.type == pafs.FileType.NotFound]

    def files(self, view: str, version: int | None = None) -> tuple[int | None, list[str]]:
        """(version, data file URIs) of the history table at ``version`` (default latest)."""
        table = self._table(view, version)
        return (table.version(), table.file_uris()) if table is not None else (None, [])

    def stats(self, view: str) -> dict[str, int | None]:
        """Rows, files and version of the history table, from the Delta log (no data read)."""
        table = self._table(view)
        if table is None:
            return {"history_rows": 0, "history_files": 0, "table_version": None}
        rows, files = _logged_rows(table)
        return {"history_rows": rows, "history_files": files, "table_version": table.version()}

    def _rejects_uri(self, view: str) -> str:
        return self.location.child("_rejects", view).url

    def rejected_rows(self, view: str) -> int:
        """How many rejected source rows the view keeps, from the Delta log (no data read)."""
        table = self._open(self._rejects_uri(view))
        return _logged_rows(table)[0] if table is not None else 0

    def file_count(self, view: str) -> int:
        table = self._table(view)
        return len(table.file_uris()) if table is not None else 0

    def compact(self, view: str) -> dict:
        """Rewrite small files into large ones (a new version; older versions stay readable)."""
        if self._table(view) is None:
            return {}
        return compact(self.location.child(view))

    def vacuum(self, view: str, retention_hours: int) -> int:
        """Delete files no version of the last ``retention_hours`` uses; returns how many.
        Exports made from older versions can no longer be reproduced byte for byte."""
        table = self._table(view)
        if table is None:
            return 0
        self._delta_commit()
        return len(table.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False))

    def write_rejects(self, view: str, rejects: pa.Table) -> None:
        """Append rejected rows not already kept (re-runs see the same bad rows again)."""
        table = self._open(self._rejects_uri(view))
        if table is not None:
            seen = table.to_pyarrow_table(columns=["reject_id"])["reject_id"]
            rejects = rejects.filter(pc.invert(pc.is_in(rejects["reject_id"], value_set=seen.combine_chunks())))
        if rejects.num_rows:
            self._delta_commit()
            write_deltalake(self._rejects_uri(view), rejects, mode="append", storage_options=self.options)

    def rejects(self, view: str) -> pa.Table:
        table = self._open(self._rejects_uri(view))
        return table.to_pyarrow_table() if table is not None else pa.table({})

    def drop(self, view: str) -> None:
        """Delete every version's history of the view."""
        fs, base = self.filesystem
        try:
            names = [
                info.base_name
                for info in fs.get_file_info(pafs.FileSelector(base))
                if info.type == pafs.FileType.Directory
            ]
        except FileNotFoundError:
            return
        for name in names:
            if name == view or name.startswith(f"{view}@v"):
                fs.delete_dir(f"{base}/{name}")
                self.statistics.drop(name)


def _records(action: AddAction) -> int:
    return int(json.loads(action.stats or "{}").get("numRecords", 0))


def _fs_path(uri: str) -> str:
    """A data file URI as a path in its pyarrow file system."""
    for scheme in ("file://", "s3://"):
        if uri.startswith(scheme):
            return uri[len(scheme) :]
    return uri


def _logged_rows(table: DeltaTable) -> tuple[int, int]:
    """(rows, files) of a table's current version, as its log records them."""
    actions = table.get_add_actions(flatten=True)
    rows: list[int | None] = (
        list(actions.column("num_records").to_pylist()) if "num_records" in actions.column_names else []
    )
    return int(sum(r or 0 for r in rows)), len(rows)
