"""A torch ``IterableDataset`` over an exported training dataset (manifest + Parquet).

Arrow record batches become tensors in bulk (no per-row Python); a shuffle buffer of a
few batches mixes rows; ``DataLoader`` workers each read their own row groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

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


class ExportedDataset(IterableDataset):
    """Yields (x_num, x_cat, label) minibatches from the rows with ``lo <= event_timestamp < hi``."""

    def __init__(
        self, dataset_dir: Path, preprocessor: Preprocessor, label: str, batch_size: int = 512,
        time_range: tuple[int | None, int | None] = (None, None), shuffle_buffer_batches: int = 8, seed: int = 0,
    ):
        self.dir = Path(dataset_dir)
        self.files = [self.dir / f["path"] for f in load_manifest(self.dir)["files"]]
        self.pre, self.label, self.batch_size = preprocessor, label, batch_size
        self.time_range, self.buffer, self.seed = time_range, shuffle_buffer_batches, seed
        self.epoch = 0

    def _row_groups(self) -> list[tuple[Path, int]]:
        groups = [(f, i) for f in self.files for i in range(pq.ParquetFile(f).num_row_groups)]
        info = get_worker_info()
        return groups[info.id::info.num_workers] if info else groups

    def _tables(self) -> Iterator[pa.Table]:
        lo, hi = self.time_range
        for file, group in self._row_groups():
            table = pq.ParquetFile(file).read_row_group(group)
            ts = pc.cast(table["event_timestamp"], pa.int64())
            mask = pc.and_(pc.greater_equal(ts, lo if lo is not None else -(2**63)), pc.less(ts, hi if hi is not None else 2**63 - 1))
            yield table.filter(mask)

    def __iter__(self) -> Iterator[Batch]:
        rng = np.random.default_rng(self.seed + self.epoch)
        self.epoch += 1
        pending: list[pa.Table] = []
        rows = 0
        for table in self._tables():
            pending.append(table)
            rows += table.num_rows
            if rows >= self.buffer * self.batch_size:
                yield from self._emit(pa.concat_tables(pending), rng)
                pending, rows = [], 0
        if rows:
            yield from self._emit(pa.concat_tables(pending), rng)

    def _emit(self, table: pa.Table, rng: np.random.Generator) -> Iterator[Batch]:
        table = table.take(pa.array(rng.permutation(table.num_rows)))
        x_num, x_cat = self.pre.transform({c: table[c] for c in self.pre.numeric + self.pre.categorical})
        y = torch.from_numpy(pc.cast(table[self.label], pa.float32()).to_numpy(zero_copy_only=False).copy())
        for start in range(0, table.num_rows, self.batch_size):
            end = start + self.batch_size
            yield x_num[start:end], x_cat[start:end], y[start:end]
