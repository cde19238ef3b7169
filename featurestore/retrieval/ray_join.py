"""Point-in-time joins on a Ray cluster: the local DuckDB kernel, run per hash partition.

Per requested view, the entity rows (its join keys, the row time, the row's number) and the
view's history are split into ``partitions`` parts by a hash of the join keys (DuckDB's
``hash`` of the keys cast to their declared types, the same in every process). History is
split where it lies: one task per Parquet file of the pinned Delta version, its parts left in
Ray's object store. Task *p* then joins entity part *p* to history part *p* with
``RetrievalJob``, the very SQL the local engine runs, over in-memory tables: every row of an
entity lands in one partition, so each partition's answer is the whole answer for its rows.
The driver puts each view's columns back in input order by row number.

What crosses the network: each history row once (file task → partition task), each entity
row once per view, and the joined columns back to the driver. Results equal the local
engine's row for row and, written by ``to_parquet``, byte for byte (a test checks both).
Workers import ``featurestore``: install the same version on every node.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa

from featurestore.errors import RequestError
from featurestore.ray_cluster import connect, fit_to_task, hash_split, read_split
from featurestore.ray_cluster import partitions as partitions_of
from featurestore.registry.loader import Definitions
from featurestore.registry.snapshot import applied_definitions
from featurestore.retrieval.historical import BATCH_ROWS, AsOf, RetrievalJob, entity_table, write_parquet
from featurestore.retrieval.on_demand import OnDemandPlan
from featurestore.retrieval.refs import ViewRequest, resolve

if TYPE_CHECKING:
    import pandas as pd

    from featurestore.offline.base import HistoryFiles
    from featurestore.storage import Location

ROW = "__ray_row"  # the entity row's number: input order, restored at the end


@dataclass
class RayJoinJob:
    """A point-in-time join run on Ray; the same interface as ``RetrievalJob``."""

    table: pa.Table
    table_versions: dict[str, int | None]
    history_tables: dict[str, str]

    @classmethod
    def build(
        cls,
        defs: Definitions,
        offline: HistoryFiles,
        entity_df: Any,
        features: Sequence[str] | None,
        feature_service: Any,
        full_feature_names: bool,
        as_of: AsOf = "event",
        versions: dict[str, int | None] | None = None,
        *,
        address: str | None = None,
        partitions: int = 0,
    ) -> RayJoinJob:
        if OnDemandPlan.build(defs, features, feature_service, full_feature_names) is not None:
            raise RequestError(
                "on-demand features are computed by the local engine; request stored features "
                "from the Ray engine, or set offline_store.engine: local"
            )
        entities = entity_table(entity_df)
        # every check the local engine makes (key types, clashes, as_of), on no rows, before a task runs
        RetrievalJob.build(
            defs, offline, entities.slice(0, 0), features, feature_service, full_feature_names, as_of, versions
        )
        ray = connect(address)
        parts = partitions_of(ray, partitions)
        requests = resolve(defs, features, feature_service, full_feature_names)
        numbered = entities.append_column(ROW, pa.array(np.arange(entities.num_rows, dtype=np.int64)))
        ts_column = "event_timestamp" if "event_timestamp" in entities.column_names else None
        columns: list[tuple[str, pa.ChunkedArray]] = []
        table_versions: dict[str, int | None] = {}
        pending = []
        for i, req in enumerate(requests):
            pinned = versions.get(req.view.name) if versions is not None else None
            version, files = (
                (None, [])
                if versions is not None and pinned is None
                else offline.files(req.layout.history_table, pinned)
            )
            table_versions[req.view.name] = version
            keys = req.view.join_keys
            keep = list(entities.column_names) if i == 0 else [*keys, *([ts_column] if ts_column else [])]
            pending.append(
                _submit(
                    ray,
                    defs,
                    req,
                    numbered.select([*dict.fromkeys([*keep, ROW])]),
                    files,
                    offline.location,
                    parts,
                    full_feature_names,
                    as_of,
                )
            )
        features_out: list[tuple[int, str, pa.ChunkedArray]] = []
        for i, (req, refs) in enumerate(zip(requests, pending)):
            joined = pa.concat_tables(ray.get(refs))
            where = np.empty(joined.num_rows, dtype=np.int64)  # row numbers are a permutation: invert it, no sort
            where[joined[ROW].to_numpy()] = np.arange(joined.num_rows, dtype=np.int64)
            joined = joined.take(where)
            if i == 0:  # entity columns as the kernel returns them
                columns += [(c, joined[c]) for c in entities.column_names]
            features_out += [(p, n, joined[n]) for p, n in zip(req.positions, req.output_names)]
        columns += [(n, c) for _, n, c in sorted(features_out, key=lambda f: f[0])]  # in request order
        table = pa.table(dict(columns)) if requests else entities
        return cls(table, table_versions, {r.view.name: r.layout.history_table for r in requests})

    def to_arrow(self) -> pa.Table:
        return self.table

    def to_df(self) -> pd.DataFrame:
        return self.table.to_pandas()

    def batches(self, rows_per_batch: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        yield from self.table.combine_chunks().to_batches(max_chunksize=rows_per_batch)

    def to_parquet(self, path: str | Path, on_batch: Any = None) -> int:
        """One Parquet file, written as the local engine writes it (the same rows give the same bytes)."""
        return write_parquet(self.batches(), path, on_batch)


def _view_state(defs: Definitions, view_name: str) -> dict[str, Any]:
    """The registry state of one view and its entities: what a task rebuilds the view from."""
    view = defs.view(view_name)
    return {
        "objects": {
            "entity": {e.name: {"spec": e.to_spec()} for e in view.entities},
            "feature_view": {view.name: {"spec": view.to_spec()}},
        },
        "history_versions": {view.name: defs.layout(view).version},
        "key_types": {view.name: {k: t.name for k, t in defs.key_types[view.name].items()}},
    }


def _submit(
    ray: Any,
    defs: Definitions,
    req: ViewRequest,
    entities: pa.Table,
    files: list[str],
    storage: Location,
    parts: int,
    full_feature_names: bool,
    as_of: str,
) -> list[Any]:
    """Tasks joining one view: a split per history file, then a join per partition."""
    state = _view_state(defs, req.view.name)
    key_types = state["key_types"][req.view.name]
    split = ray.remote(num_returns=parts)(_split_files) if parts > 1 else ray.remote(_split_files)
    groups = [files[g::parts] for g in range(min(parts, len(files)))]  # a task per group of files, not per file
    history_parts = [split.remote(state, group, storage, parts) for group in groups]
    if parts == 1:
        history_parts = [[h] for h in history_parts]
    entity_parts = hash_split(entities, _duckdb_types(key_types), parts)
    join = ray.remote(_join_partition)
    refs = [f"{req.view.name}:{f}" for f in req.features]
    return [
        join.remote(state, refs, full_feature_names, as_of, entity_parts[p], *[h[p] for h in history_parts])
        for p in range(parts)
    ]


def _duckdb_types(key_types: dict[str, str]) -> dict[str, str]:
    from featurestore.types import duckdb_type, from_name

    return {k: duckdb_type(from_name(t)) for k, t in key_types.items()}


def _split_files(state: dict[str, Any], uris: list[str], storage: Location, parts: int) -> Any:
    """History files of a view, read with the view's history columns (absent ones null), in parts."""
    fit_to_task()
    defs = applied_definitions(state)
    (view,) = defs.feature_views.values()
    schema = defs.history_schema(view)
    split = [
        pa.table(
            {
                f.name: part[f.name].cast(f.type) if f.name in part.column_names else pa.nulls(part.num_rows, f.type)
                for f in schema
            }
        )
        for part in read_split(uris, _duckdb_types(state["key_types"][view.name]), parts, storage)
    ]
    return split if parts > 1 else split[0]


class _InMemory:
    """The offline store interface over tables already in memory (what a join task has)."""

    def __init__(self, tables: dict[str, pa.Table]):
        self.tables = tables

    def register(
        self, con: duckdb.DuckDBPyConnection, view: str, name: str, schema: pa.Schema, version: int | None = None
    ) -> int | None:
        con.register(name, self.tables[view].select(schema.names))
        return version

    def version(self, view: str) -> int | None:
        return None  # rows in memory: the version the driver pinned is the one they came from


def _join_partition(
    state: dict[str, Any],
    refs: list[str],
    full_feature_names: bool,
    as_of: AsOf,
    entities: pa.Table,
    *history: pa.Table,
) -> pa.Table:
    defs = applied_definitions(state)
    (view,) = defs.feature_views.values()
    rows = pa.concat_tables(history) if history else defs.history_schema(view).empty_table()
    job = RetrievalJob.build(
        defs,
        _InMemory({defs.layout(view).history_table: rows}),
        entities,
        refs,
        None,
        full_feature_names,
        as_of,
    )
    fit_to_task(job.con)
    return job.to_arrow()
