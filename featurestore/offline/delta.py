"""History store on Delta Lake: one table per view, partitioned by event date.

Appends are Delta commits: a crash mid-write leaves uncommitted files that no reader
sees, the previous version stays readable, and a re-run (deduplicated by ``_row_id``)
completes the job. DuckDB reads the tables' Parquet files directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions

from featurestore.errors import FeatureStoreError
from featurestore.files import file_lock
from featurestore.offline.base import PARTITION_COLUMN as PARTITION
from featurestore.sources import connection, ident, quote


def _require_files(view: str, version: int, uris: list[str]) -> None:
    """A pinned version's files are all on disk (a vacuum deletes those only old versions use)."""
    gone = [u for u in uris if "://" not in u.removeprefix("file://") and not os.path.exists(u.removeprefix("file://"))]
    if gone:
        raise FeatureStoreError(
            f"the history of {view!r} at version {version} lost {len(gone)} file(s) to a vacuum (offline_store.vacuum_after_hours, "
            f"`featurestore compact --vacuum-hours`), e.g. {gone[0]}; rows as of that version cannot be read back, so "
            "this export cannot be reproduced: export again from the current version"
        )


class DeltaOfflineStore:
    def __init__(self, path: Path):
        self.path = Path(path)

    def table_path(self, view: str) -> Path:
        return self.path / view

    def _table(self, view: str, version: int | None = None) -> DeltaTable | None:
        path = self.table_path(view)
        if not (path / "_delta_log").exists():
            return None
        return DeltaTable(str(path), version=version) if version is not None else DeltaTable(str(path))

    def version(self, view: str) -> int | None:
        table = self._table(view)
        return table.version() if table is not None else None

    @contextlib.contextmanager
    def writer(self, view: str) -> Iterator[None]:
        """One writer per view's history at a time (across processes): the read-dedupe-append of
        two concurrent runs would otherwise both see the old version and append the same rows."""
        locks = self.path / "_locks"
        locks.mkdir(parents=True, exist_ok=True)
        with file_lock(locks / f"{view}.lock"):
            yield

    def append(self, view: str, rows: pa.Table) -> pa.Table:
        """Append rows not already stored; return those (without the partition column)."""
        if rows.num_rows == 0:
            return rows
        with self.writer(view):
            return self._append(view, rows)

    def _append(self, view: str, rows: pa.Table) -> pa.Table:
        fresh = self.new_rows(view, rows)
        if fresh.num_rows:
            self.commit(view, self.write_files(view, fresh), rows.schema)
        return fresh.drop_columns([PARTITION])

    def new_rows(self, view: str, rows: pa.Table) -> pa.Table:
        """``rows`` (with the partition column added) that the table does not hold yet, by ``_row_id``:
        read-only, so distributed tasks can run it; writers hold ``writer`` around it and the commit."""
        rows = rows.append_column(PARTITION, pc.cast(rows["event_timestamp"], pa.date32()))
        con = connection()
        con.register("batch", rows)
        # within-batch duplicates (identical rows) are one fact; counting first spares the usual
        # duplicate-free batch a ranking of every row
        unique = con.execute("SELECT count(DISTINCT _row_id) FROM batch").fetchall()[0][0] == rows.num_rows
        new = "SELECT * FROM batch" + ("" if unique else " QUALIFY row_number() OVER (PARTITION BY _row_id) = 1")
        table = self._table(view)
        files = []
        if table is not None:
            dates = [str(d) for d in pc.unique(rows[PARTITION]).to_pylist()]
            files = table.file_uris(file_pruning_predicate=[(PARTITION, "in", dates)])
        if files:
            file_list = "[" + ", ".join(quote(f) for f in files) + "]"
            new = f"SELECT * FROM ({new}) ANTI JOIN (SELECT _row_id FROM read_parquet({file_list})) USING (_row_id)"
        elif unique:
            return rows
        return con.sql(new).to_arrow_table().cast(rows.schema)

    def write_files(self, view: str, rows: pa.Table) -> list[AddAction]:
        """Write ``new_rows``' result as Parquet files in the table's partition folders, uncommitted
        (invisible until ``commit``; a failed run leaves only files no version lists). DuckDB
        writes them, on every core, one file per partition."""
        root = self.table_path(view)
        root.mkdir(parents=True, exist_ok=True)
        con = connection()
        con.register("fresh", rows)
        written = con.execute(
            f"""COPY fresh TO {quote(str(root))} (FORMAT parquet, COMPRESSION snappy, PARTITION_BY ({PARTITION}),
                FILENAME_PATTERN 'part-{{uuid}}', APPEND, RETURN_STATS)"""
        ).fetchall()
        now_ms = int(time.time() * 1000)
        return [
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

    def commit(self, view: str, actions: list[AddAction], schema: pa.Schema) -> int | None:
        """Add files written by ``write_files`` (anywhere) to the table in one transaction; returns the
        version. A column the view gained is added to the table's schema first (older rows read null)."""
        if not actions:
            return self.version(view)
        table = self._table(view)
        full = schema.append(pa.field(PARTITION, pa.date32()))
        if table is None:
            create_table_with_add_actions(
                str(self.table_path(view)),
                DeltaSchema.from_arrow(full),
                actions,
                mode="append",
                partition_by=[PARTITION],
            )
            return self.version(view)
        known = {f.name for f in table.schema().fields}
        added = [f for f in DeltaSchema.from_arrow(full).fields if f.name not in known]
        if added:
            table.alter.add_columns(added)
        table.create_write_transaction(
            list[AddAction | RemoveAction](actions),
            mode="append",
            schema=DeltaSchema.from_arrow(full),
            partition_by=[PARTITION],
        )
        return self.version(view)

    def register(
        self, con: duckdb.DuckDBPyConnection, view: str, name: str, schema: pa.Schema, version: int | None = None
    ) -> int | None:
        table = self._table(view, version)
        files = table.file_uris() if table is not None else []
        if version is not None:
            _require_files(view, version, files)
        if table is None or not files:
            con.register(name, schema.empty_table())
            return table.version() if table is not None else None
        columns = ", ".join(ident(c) for c in schema.names)
        # by name: files written before a column was added lack it (read as null)
        rows = f"read_parquet([{', '.join(quote(f) for f in files)}], union_by_name = true)"
        stored = {f.name for f in table.schema().fields}
        if not set(schema.names) <= stored:  # a column added but never written yet: typed nulls
            con.register(f"{name}__typed", schema.empty_table())
            rows = f"(SELECT * FROM {rows} UNION ALL BY NAME SELECT * FROM {ident(name + '__typed')})"
        con.execute(f"CREATE OR REPLACE TEMP VIEW {ident(name)} AS SELECT {columns} FROM {rows}")
        return table.version()

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

    def rejected_rows(self, view: str) -> int:
        """How many rejected source rows the view keeps, from the Delta log (no data read)."""
        path = self.path / "_rejects" / view
        return _logged_rows(DeltaTable(str(path)))[0] if (path / "_delta_log").exists() else 0

    def file_count(self, view: str) -> int:
        table = self._table(view)
        return len(table.file_uris()) if table is not None else 0

    def compact(self, view: str) -> dict:
        """Rewrite small files into large ones (a new version; older versions stay readable)."""
        table = self._table(view)
        return table.optimize.compact() if table is not None else {}

    def vacuum(self, view: str, retention_hours: int) -> int:
        """Delete files no version of the last ``retention_hours`` uses; returns how many.
        Exports made from older versions can no longer be reproduced byte for byte."""
        table = self._table(view)
        if table is None:
            return 0
        return len(table.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False))

    def write_rejects(self, view: str, rejects: pa.Table) -> None:
        """Append rejected rows not already kept (re-runs see the same bad rows again)."""
        path = self.path / "_rejects" / view
        if (path / "_delta_log").exists():
            seen = DeltaTable(str(path)).to_pyarrow_table(columns=["reject_id"])["reject_id"]
            rejects = rejects.filter(pc.invert(pc.is_in(rejects["reject_id"], value_set=seen.combine_chunks())))
        if rejects.num_rows:
            write_deltalake(str(path), rejects, mode="append")

    def rejects(self, view: str) -> pa.Table:
        path = self.path / "_rejects" / view
        if not (path / "_delta_log").exists():
            return pa.table({})
        return DeltaTable(str(path)).to_pyarrow_table()

    def drop(self, view: str) -> None:
        """Delete every version's history of the view."""
        for path in [self.table_path(view), *self.path.glob(f"{view}@v*")]:
            shutil.rmtree(path, ignore_errors=True)


def _logged_rows(table: DeltaTable) -> tuple[int, int]:
    """(rows, files) of a table's current version, as its log records them."""
    actions = table.get_add_actions(flatten=True)
    rows: list[int | None] = (
        list(actions.column("num_records").to_pylist()) if "num_records" in actions.column_names else []
    )
    return int(sum(r or 0 for r in rows)), len(rows)
