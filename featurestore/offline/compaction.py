"""A Delta table's small files merged into large ones, committed on the version the merge was
planned on or not at all.

deltalake's own ``optimize.compact`` (1.6) commits over a concurrent compaction of the same
files, even with ``max_commit_retries=0``: both merged files stay in the table and every row in
them is stored twice (two machines' drains compacting one table, or ``featurestore compact``
beside a server). Here the removes and the adds are one transaction that expects the next
version; when any other commit came first, the merge is planned again on the newer version
(and the file it wrote, which nothing references, deleted).
"""

from __future__ import annotations

import json
import time
import uuid
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from featurestore.errors import FeatureStoreError
from featurestore.object_requests import FileSystem, count_delta
from featurestore.storage import Location

TARGET_BYTES = 128 << 20  # a merged file's size at most; files this big already are left as they are
ATTEMPTS = 10  # plans in a row overtaken by other writers' commits before giving up until the next time


def compact(where: Location) -> dict[str, int]:
    """Merge the small files of the table at ``where``, partition by partition; returns
    ``numFilesRemoved`` and ``numFilesAdded`` (zero when it has nothing to merge)."""
    fs, root = where.filesystem()
    for _ in range(ATTEMPTS):
        table = DeltaTable(where.url, storage_options=where.delta_options())
        partitions = table.metadata().partition_columns
        bins = _plan(pa.table(table.get_add_actions(flatten=True)).to_pylist(), partitions)
        if not bins:
            return {"numFilesRemoved": 0, "numFilesAdded": 0}
        data_schema = pa.schema([f for f in pa.schema(table.schema().to_arrow()) if f.name not in partitions])
        now = int(time.time() * 1000)
        actions: list[AddAction | RemoveAction] = []
        written = []
        for files in bins:
            merged = _merged(fs, root, files, data_schema)
            folder = files[0]["path"].rpartition("/")[0]
            name = (
                f"{folder}/part-{uuid.uuid4()}-compacted.parquet"
                if folder
                else f"part-{uuid.uuid4()}-compacted.parquet"
            )
            with fs.open_output_stream(f"{root}/{unquote(name)}") as out:
                pq.write_table(merged, out, compression="snappy")
            written.append(name)
            values = _partition_values(files[0], partitions)
            size = fs.get_file_info(f"{root}/{unquote(name)}").size
            actions.append(AddAction(name, size, values, now, False, json.dumps({"numRecords": merged.num_rows})))
            actions += [RemoveAction(f["path"], False, now, f["size_bytes"], values) for f in files]
        count_delta("delta commit", where.is_local)
        try:
            table.create_write_transaction(
                actions,
                mode="append",
                schema=table.schema(),
                partition_by=partitions or None,
                commit_properties=CommitProperties(max_commit_retries=0),  # this version or a new plan
            )
            return {"numFilesRemoved": sum(len(files) for files in bins), "numFilesAdded": len(bins)}
        except CommitFailedError:
            for name in written:
                fs.delete_file(f"{root}/{unquote(name)}")
    raise FeatureStoreError(f"{where}: {ATTEMPTS} other commits came first, one after another; compacting next time")


def _plan(files: list[dict], partitions: list[str]) -> list[list[dict]]:
    """Groups of two or more small files of one partition, each group under ``TARGET_BYTES``."""
    by_partition: dict[tuple, list[dict]] = {}
    for f in files:
        if f["size_bytes"] < TARGET_BYTES:
            by_partition.setdefault(tuple(str(f[f"partition.{p}"]) for p in partitions), []).append(f)
    bins: list[list[dict]] = []
    for group in by_partition.values():
        current: list[dict] = []
        for f in sorted(group, key=lambda f: (f["modification_time"], f["path"])):
            if current and sum(g["size_bytes"] for g in current) + f["size_bytes"] > TARGET_BYTES:
                bins.append(current)
                current = []
            current.append(f)
        bins.append(current)
    return [b for b in bins if len(b) > 1]


def _merged(fs: FileSystem, root: str, files: list[dict], schema: pa.Schema) -> pa.Table:
    """The files' rows under the table's schema (columns a file predates read null)."""
    tables = []
    for f in files:
        with fs.open_input_file(f"{root}/{unquote(f['path'])}") as source:
            tables.append(pq.read_table(source))
    whole = pa.concat_tables(tables, promote_options="default")
    return pa.table(
        [
            whole[f.name].cast(f.type) if f.name in whole.column_names else pa.nulls(whole.num_rows, f.type)
            for f in schema
        ],
        schema=schema,
    )


def _partition_values(file: dict, partitions: list[str]) -> dict[str, str | None]:
    values = {p: file[f"partition.{p}"] for p in partitions}
    return {p: None if v is None else v.isoformat() if hasattr(v, "isoformat") else str(v) for p, v in values.items()}
