"""The interface a history store implements. A second backend is a new file beside delta.py.

Tables are named by ``history_table`` (one per view version); ``drop`` takes the
view's name and deletes all its versions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import duckdb
import pyarrow as pa

if TYPE_CHECKING:
    from featurestore.storage import Location

# Columns every history table has besides join keys and features.
#   event_timestamp    when the fact happened (UTC)
#   created_timestamp  when it was known: the source's created column, else the ingest time
#   _run_id            the write run that stored the row (later run = later ingest); for a push its
#                      ingest time in µs (``materialization.engine.push_run_id``)
#   _row_id            the row's identity, used to make re-runs idempotent and to order ties within
#                      a run: a 63-bit hash of keys, event time, source created time and values; for
#                      pushed rows the push's own row id (``sources.PUSH_ID``), kept in the push log
HISTORY_COLUMNS: dict[str, pa.DataType] = {
    "event_timestamp": pa.timestamp("us", tz="UTC"),
    "created_timestamp": pa.timestamp("us", tz="UTC"),
    "_run_id": pa.int64(),
    "_row_id": pa.int64(),
}
# Stores may partition history by the event's UTC date under this column name.
PARTITION_COLUMN = "event_date"


def history_table(view: str, version: int) -> str:
    """``txn`` for version 1 (tables from before versions existed stay where they are), ``txn@v2`` after."""
    return view if version == 1 else f"{view}@v{version}"


class HistoryReads(Protocol):
    """What a point-in-time join reads: a table's version and its rows in DuckDB."""

    def version(self, view: str) -> int | None:
        """Current table version, None when nothing was ever written."""
        ...

    def register(
        self, con: duckdb.DuckDBPyConnection, view: str, name: str, schema: pa.Schema, version: int | None = None
    ) -> int | None:
        """Expose the view's history (at ``version``) in ``con`` as ``name``; return the version read."""
        ...


class HistoryFiles(HistoryReads, Protocol):
    """What distributed joins and the catalogue also read: a table's files and log statistics."""

    location: Location  # where the files are: a task elsewhere reads them with its file system

    def files(self, view: str, version: int | None = None) -> tuple[int | None, list[str]]:
        """(version, data file URIs) of the table at ``version`` (default latest), for scans elsewhere."""
        ...

    def stats(self, view: str) -> dict[str, int | None]:
        """Rows, files and version of the table, from its log (no data read)."""
        ...

    def rejected_rows(self, view: str) -> int:
        """How many rejected source rows are kept for the view."""
        ...


class HistoryWriter(Protocol):
    """The two-phase write the materialization protocol drives (``materialization/protocol.py``):
    under ``writer``, the rows history lacks are written as files nobody reads yet, then committed
    in one transaction. Files are plain values, so an executor may write them on another machine."""

    def new_rows(self, view: str, rows: pa.Table, version: int | None) -> pa.Table:
        """The rows (with the partition column) whose ``_row_id`` the table at ``version`` lacks."""
        ...

    def write_files(self, view: str, rows: pa.Table) -> list[Any]:
        """Write rows as data files, uncommitted; returns what ``commit`` takes."""
        ...

    def commit(self, view: str, files: list[Any], schema: pa.Schema, read_version: int | None) -> int | None:
        """Make the files one new version of the table (adding columns the schema gained).

        Optimistic, with no lock: ``read_version`` is the version ``new_rows`` deduplicated
        against; rows that commits since then added (another writer, another machine) are
        taken out of the files before the commit is retried on the newer version."""
        ...

    def append(self, view: str, rows: pa.Table) -> pa.Table:
        """``new_rows`` + ``write_files`` + ``commit``; returns the rows that were new."""
        ...

    def write_rejects(self, view: str, rejects: pa.Table) -> None:
        """Keep source rows that broke the schema, with the reason."""
        ...


class HistoryMaintenance(Protocol):
    def drop(self, view: str) -> None:
        """Delete every version of the view's history (after the user confirmed removal)."""
        ...

    def file_count(self, view: str) -> int:
        """How many data files the current version reads."""
        ...

    def compact(self, view: str) -> dict:
        """Merge small files (keeps older versions readable)."""
        ...

    def vacuum(self, view: str, retention_hours: int) -> int:
        """Delete files older versions of more than ``retention_hours`` used."""
        ...


class OfflineStore(HistoryFiles, HistoryWriter, HistoryMaintenance, Protocol):
    """A history store: every capability above (``offline/delta.py`` is the one in the box)."""


def history_schema(view_keys: dict[str, pa.DataType], features: list[tuple[str, pa.DataType]]) -> pa.Schema:
    """Schema of a view's history table (without the partition column)."""
    return pa.schema([*view_keys.items(), *HISTORY_COLUMNS.items(), *features])
