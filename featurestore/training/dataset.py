"""A torch ``IterableDataset`` over an exported training dataset (manifest + Parquet).

Arrow record batches become tensors in bulk (no per-row Python). **One order of rows per epoch,
whatever the world size**: the data is cut into units (row ranges of at most ``unit_rows``
inside one Parquet row group), the units are shuffled by ``seed + epoch`` and read in windows
of about ``shuffle_buffer_batches`` batches, each window's rows shuffled again; the stream of
rows is then cut into global batches of ``batch_size`` rows (only the epoch's last one is
smaller), and each global batch is split evenly across the ``world`` ranks (rank r takes rows
``n·r/world`` to ``n·(r+1)/world``). So step s trains on the same rows on 1, 2 or 4 processes,
and every rank holds rows on every step but the last few of tiny batches. Every rank reads each
window (the columns it needs) and converts only its part: exactness over I/O, for datasets that
are columnar files on local disk. ``DataLoader`` workers take every k-th batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from featurestore.training.preprocessing import Preprocessor

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def load_manifest(dataset_dir: Path) -> dict:
    manifest = Path(dataset_dir) / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"no exported dataset at {dataset_dir} (no manifest.json): make one with `featurestore export`"
        )
    return json.loads(manifest.read_text())


def time_column(manifest: dict) -> str:
    """The exported rows' time column: the entity rows' (``event_timestamp`` before manifests said)."""
    return str(manifest.get("time_column", "event_timestamp"))


Unit = tuple[Path, int, int, int]  # file, row group, first row in the group, row count


def units(files: list[Path], unit_rows: int) -> list[Unit]:
    """Every row of ``files`` in row ranges of at most ``unit_rows``, in file order."""
    out: list[Unit] = []
    for file in files:
        meta = pq.ParquetFile(file).metadata
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            out += [(file, group, start, min(unit_rows, rows - start)) for start in range(0, rows, unit_rows)]
    return out


def share(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The slice ``[lo, hi)`` of a global batch of ``rows`` that ``rank`` of ``world`` trains on."""
    return rows * rank // world, rows * (rank + 1) // world


class ExportedDataset(IterableDataset):
    """Yields this rank's part (x_num, x_cat, label) of each global batch of the rows with
    ``lo <= time < hi`` (the entity rows' time), one per step (a part may have no rows): see the module docstring."""

    def __init__(
        self,
        dataset_dir: Path,
        preprocessor: Preprocessor,
        label: str,
        batch_size: int = 512,
        time_range: tuple[int | None, int | None] = (None, None),
        shuffle_buffer_batches: int = 8,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        unit_rows: int = 16_384,
    ):
        self.dir = Path(dataset_dir)
        manifest = load_manifest(self.dir)
        self.files = [self.dir / f["path"] for f in manifest["files"]]
        self.time_column = time_column(manifest)
        self.pre, self.label, self.batch_size = preprocessor, label, batch_size
        self.time_range, self.buffer, self.seed = time_range, shuffle_buffer_batches, seed
        self.rank, self.world = rank, world
        self.units = units(self.files, unit_rows)
        self.epoch = 0
        self._counts: list[int] | None = None

    def counts(self) -> list[int]:
        """Rows in the time range, per unit (read once: the timestamps only)."""
        if self._counts is None:
            self._counts = [t.num_rows for t in self._read(self.units, [self.time_column])]
        return self._counts

    def rows(self) -> int:
        return sum(self.counts())

    def steps(self) -> int:
        """Global batches per epoch: the same on every rank and for every world size."""
        return -(-self.rows() // self.batch_size)

    def step_rows(self, step: int) -> int:
        """Rows of global batch ``step`` (0-based) of an epoch, over all ranks."""
        return min(self.batch_size, self.rows() - step * self.batch_size)

    def _in_range(self, table: pa.Table) -> pa.Table:
        lo, hi = self.time_range
        ts = pc.cast(table[self.time_column], pa.int64())
        mask = pc.and_(
            pc.greater_equal(ts, lo if lo is not None else -(2**63)), pc.less(ts, hi if hi is not None else 2**63 - 1)
        )
        return table.filter(mask)

    def _read(self, chosen: list[Unit], columns: list[str] | None = None) -> Iterator[pa.Table]:
        """Each unit's rows in the time range (a row group read once for its units in a row)."""
        groups: dict[tuple[Path, int], pa.Table] = {}
        for file, group, start, count in chosen:
            if (file, group) not in groups:
                if len(groups) > 4:  # a window's row groups, bounded
                    groups.clear()
                groups[(file, group)] = pq.ParquetFile(file).read_row_group(group, columns=columns)
            yield self._in_range(groups[(file, group)].slice(start, count))

    def _windows(self) -> Iterator[pa.Table]:
        """The epoch's rows in their one order: shuffled units, read a window at a time, each
        window's rows shuffled by its own seed."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.units))
        counts, target = self.counts(), self.buffer * self.batch_size
        window: list[Unit] = []
        held, index = 0, 0
        for i in [*order, None]:
            if i is not None:
                if not counts[i]:
                    continue
                window.append(self.units[i])
                held += counts[i]
            if window and (held >= target or i is None):
                table = pa.concat_tables(list(self._read(window)))
                yield table.take(pa.array(np.random.default_rng([self.seed, self.epoch, index]).permutation(held)))
                window, held, index = [], 0, index + 1

    def _global_batches(self) -> Iterator[pa.Table]:
        pending: list[pa.Table] = []
        held = 0
        for table in self._windows():
            pending.append(table)
            held += table.num_rows
            while held >= self.batch_size:
                rows = pa.concat_tables(pending)
                yield rows.slice(0, self.batch_size)
                pending, held = [rows.slice(self.batch_size)], held - self.batch_size
        if held:
            yield pa.concat_tables(pending)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for step, batch in enumerate(self._global_batches()):
            if step % workers == worker:
                lo, hi = share(batch.num_rows, self.world, self.rank)
                yield self._tensors(batch.slice(lo, hi - lo))
        self.epoch += 1

    def _tensors(self, table: pa.Table) -> Batch:
        x_num, x_cat = self.pre.transform({c: table[c] for c in self.pre.inputs})
        y = torch.from_numpy(pc.cast(table[self.label], pa.float32()).to_numpy(zero_copy_only=False).copy())
        return x_num, x_cat, y
