"""A torch ``IterableDataset`` over an exported training dataset (manifest + Parquet).

Arrow record batches become tensors in bulk (no per-row Python); a shuffle buffer of a
few batches mixes rows. The data is cut into **units** (row ranges of at most ``unit_rows``
inside one Parquet row group); each epoch the units are shuffled by ``seed + epoch`` and dealt
to ranks round-robin, so with ``world`` ranks every row is read by exactly one rank per
epoch, each rank reading only its own units' row groups (``DataLoader`` workers split a rank's
units again). ``batches_per_rank`` tells every rank how many steps the busiest one takes.
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
    return json.loads((Path(dataset_dir) / "manifest.json").read_text())


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


def deal(all_units: list[Unit], seed: int, epoch: int, rank: int, world: int) -> list[Unit]:
    """This rank's units for the epoch: a seeded shuffle dealt round-robin (disjoint, covering)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(all_units))
    return [all_units[i] for i in order[rank::world]]


class ExportedDataset(IterableDataset):
    """Yields (x_num, x_cat, label) minibatches from the rows with ``lo <= event_timestamp < hi``
    in this rank's share of the data (see the module docstring)."""

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
        self.files = [self.dir / f["path"] for f in load_manifest(self.dir)["files"]]
        self.pre, self.label, self.batch_size = preprocessor, label, batch_size
        self.time_range, self.buffer, self.seed = time_range, shuffle_buffer_batches, seed
        self.rank, self.world = rank, world
        self.units = units(self.files, unit_rows)
        self.epoch = 0

    def _mine(self, rank: int | None = None) -> list[Unit]:
        mine = deal(self.units, self.seed, self.epoch, self.rank if rank is None else rank, self.world)
        info = get_worker_info()
        return mine[info.id :: info.num_workers] if info else mine

    def _in_range(self, table: pa.Table) -> pa.Table:
        lo, hi = self.time_range
        ts = pc.cast(table["event_timestamp"], pa.int64())
        mask = pc.and_(
            pc.greater_equal(ts, lo if lo is not None else -(2**63)), pc.less(ts, hi if hi is not None else 2**63 - 1)
        )
        return table.filter(mask)

    def _tables(self, columns: list[str] | None = None, rank: int | None = None) -> Iterator[pa.Table]:
        cache: dict[tuple[Path, int], pa.Table] = {}
        for file, group, start, count in self._mine(rank):
            if (file, group) not in cache:  # a rank's units of one row group are read once
                cache.clear()
                cache[(file, group)] = pq.ParquetFile(file).read_row_group(group, columns=columns)
            yield self._in_range(cache[(file, group)].slice(start, count))

    def _flushes(self, columns: list[str] | None = None, rank: int | None = None) -> Iterator[pa.Table]:
        """Tables of about ``buffer`` batches: the shuffle buffer's contents, in order."""
        pending: list[pa.Table] = []
        rows = 0
        for table in self._tables(columns, rank):
            pending.append(table)
            rows += table.num_rows
            if rows >= self.buffer * self.batch_size:
                yield pa.concat_tables(pending)
                pending, rows = [], 0
        if rows:
            yield pa.concat_tables(pending)

    def batches_per_rank(self) -> list[int]:
        """How many batches each rank yields this epoch (reads only the timestamps)."""
        return [
            sum(-(-t.num_rows // self.batch_size) for t in self._flushes(["event_timestamp"], rank))
            for rank in range(self.world)
        ]

    def __iter__(self) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, self.epoch, self.rank])
        for table in self._flushes():
            yield from self._emit(table, rng)
        self.epoch += 1

    def _emit(self, table: pa.Table, rng: np.random.Generator) -> Iterator[Batch]:
        table = table.take(pa.array(rng.permutation(table.num_rows)))
        x_num, x_cat = self.pre.transform({c: table[c] for c in self.pre.inputs})
        y = torch.from_numpy(pc.cast(table[self.label], pa.float32()).to_numpy(zero_copy_only=False).copy())
        for start in range(0, table.num_rows, self.batch_size):
            end = start + self.batch_size
            yield x_num[start:end], x_cat[start:end], y[start:end]
