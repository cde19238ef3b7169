"""What the Ray engines share: attaching to the cluster, and splitting rows by a hash of their
join keys the same way in every process (DuckDB's ``hash`` of the keys cast to their declared
types), so an entity's rows meet in one partition whichever task split them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from featurestore.errors import FeatureStoreError
from featurestore.sources import connection, ident, quote


def connect(address: str | None) -> Any:
    """The ``ray`` module, attached to the cluster at ``address`` (``host:port``; None: start or reuse a local one)."""
    try:
        import ray
    except ModuleNotFoundError:
        raise FeatureStoreError("the Ray engine needs ray: pip install 'featurestore[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False, configure_logging=False)
        except ConnectionError as exc:
            raise FeatureStoreError(f"no Ray cluster at {address}: {exc}; start one with `ray start --head`") from exc
    return ray


def partitions(ray: Any, configured: int) -> int:
    """``configured``, or one partition per CPU of the cluster (at least 2)."""
    return configured or max(2, int(ray.cluster_resources().get("CPU", 1)))


def _part_sql(key_types: dict[str, str], parts: int) -> str:
    """A row's partition: the hash of its join keys cast to their declared DuckDB types."""
    return f"hash({', '.join(f'TRY_CAST({ident(k)} AS {t})' for k, t in key_types.items())}) % {parts}"


def hash_split(table: pa.Table, key_types: dict[str, str], parts: int) -> list[pa.Table]:
    """``table`` in ``parts`` by the hash of its join keys; ``key_types``: key -> DuckDB type."""
    con = connection()
    con.register("__keys", table.select(list(key_types)))
    which = con.sql(f"SELECT {_part_sql(key_types, parts)} AS p FROM __keys").fetchnumpy()["p"]
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(parts + 1))
    return [table.take(order[bounds[p]:bounds[p + 1]]) for p in range(parts)]


def read_split(uris: list[str], key_types: dict[str, str], parts: int) -> list[pa.Table]:
    """Parquet files split as ``hash_split`` splits rows, in one DuckDB pass: read, ordered by
    partition, sliced (a take of every row of every column costs ~5x as much). Columns absent
    from some files read as null."""
    files = "[" + ", ".join(quote(local_path(u)) for u in uris) + "]"
    table = connection().sql(
        f"SELECT *, {_part_sql(key_types, parts)} AS __part FROM read_parquet({files}, union_by_name = true) ORDER BY __part"
    ).to_arrow_table()
    bounds = np.searchsorted(table["__part"].to_numpy(), np.arange(parts + 1))
    table = table.drop_columns(["__part"])
    return [_compact(table.slice(bounds[p], bounds[p + 1] - bounds[p])) for p in range(parts)]


def _compact(table: pa.Table) -> pa.Table:
    """A slice copied into buffers of its own: pickled (into Ray's object store), a slice carries
    its parent's whole buffers."""
    return pa.Table.from_arrays([pa.concat_arrays(c.chunks) if c.num_chunks else pa.array([], c.type) for c in table.columns],
                                schema=table.schema)


def gather(ray: Any, refs: list[Any], description: str, progress: bool) -> list[Any]:
    """``ray.get(refs)``, showing tasks done, rate and elapsed time as they finish."""
    from featurestore.progress import progress_bar

    with progress_bar("tasks", progress) as bar:
        task = bar.add_task(description, total=len(refs))
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            bar.advance(task, len(done))
    return ray.get(refs)


def local_path(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri
