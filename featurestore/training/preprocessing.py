"""Feature preprocessing, fitted on the training split and used unchanged at inference.

Numbers are standardized with the training split's mean and std; a null becomes 0 plus a
1 in its indicator column (so "missing" is a signal the model learns, the same way for
NOT_FOUND / OUTSIDE_MAX_AGE online as for nulls offline). Strings map through a
vocabulary (index 0 = unknown or null) to an embedding. Entity keys (``hashed``: card,
merchant: too many to list) map by a stable hash into a fixed number of buckets, each with a
learned embedding row: the large tables that sharded training spreads over ranks. Everything is vectorized over
Arrow arrays; one row at serving goes through the very same code as a batch in training.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


@dataclass
class Preprocessor:
    numeric: list[str]
    categorical: list[str]
    means: list[float] = field(default_factory=list)
    stds: list[float] = field(default_factory=list)
    vocabularies: dict[str, list[str]] = field(default_factory=dict)
    hashed: dict[str, int] = field(default_factory=dict)  # entity key column -> buckets
    _lookups: dict[str, dict[str, int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def fit(
        cls,
        table: pa.Table,
        numeric: Sequence[str],
        categorical: Sequence[str],
        max_vocab: int = 1000,
        hashed: Mapping[str, int] | None = None,
    ) -> Preprocessor:
        means, stds = [], []
        for name in numeric:
            values = pc.cast(table[name], pa.float64())
            mean = pc.mean(values).as_py()
            std = pc.stddev(values).as_py()
            means.append(float(mean) if mean is not None else 0.0)
            stds.append(float(std) if std else 1.0)
        vocabularies = {}
        for name in categorical:
            counts = pc.value_counts(table[name].drop_null()).to_pylist()
            counts.sort(key=lambda c: (-c["counts"], str(c["values"])))
            vocabularies[name] = [str(c["values"]) for c in counts[:max_vocab]]
        return cls(list(numeric), list(categorical), means, stds, vocabularies, dict(hashed or {}))

    @property
    def numeric_width(self) -> int:
        return 2 * len(self.numeric)

    @property
    def vocab_sizes(self) -> list[int]:
        return [len(self.vocabularies[c]) + 1 for c in self.categorical] + [b + 1 for b in self.hashed.values()]

    @property
    def inputs(self) -> list[str]:
        return self.numeric + self.categorical + list(self.hashed)

    def input_range(self, name: str) -> tuple[float, float] | None:
        """The values of numeric input ``name`` whose scaled value a float32 model input holds
        (outside it, the model would see infinity), or None for an input it does not scale."""
        if name not in self.numeric:
            return None
        i = self.numeric.index(name)
        reach = float(np.finfo(np.float32).max) * (1 - 1e-6) * self.stds[i]  # (a margin for rounding)
        top = float(np.finfo(np.float64).max)
        return max(self.means[i] - reach, -top), min(self.means[i] + reach, top)

    def transform(self, columns: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Arrow arrays (training, in bulk) or Python lists (serving, a few rows) by name →
        (float32 [n, 2·numeric], int64 [n, categorical]). Both inputs give the same bits."""
        numeric = []
        for name, mean, std in zip(self.numeric, self.means, self.stds):
            raw, present = _numbers(columns[name], mean)
            numeric.append(np.where(present, (raw - mean) / std, 0.0).astype(np.float32))
            numeric.append((~present).astype(np.float32))
        cats = [self._indexes(name, columns[name]) for name in self.categorical]
        cats += [_buckets(columns[name], size) for name, size in self.hashed.items()]
        n = len(numeric[0]) if numeric else len(cats[0])
        x_num = torch.from_numpy(np.stack(numeric, axis=1) if numeric else np.zeros((n, 0), np.float32))
        x_cat = torch.from_numpy(np.stack(cats, axis=1) if cats else np.zeros((n, 0), np.int64))
        return x_num, x_cat

    def _indexes(self, name: str, values: Any) -> np.ndarray:
        """Vocabulary position + 1 per value; 0 for null or unseen."""
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            idx = pc.index_in(pc.cast(values, pa.string()), value_set=pa.array(self.vocabularies[name], pa.string()))
            return pc.add(idx, 1).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        lookup = self._lookups.get(name)
        if lookup is None:
            lookup = self._lookups[name] = {token: i + 1 for i, token in enumerate(self.vocabularies[name])}
        return np.array([0 if v is None else lookup.get(str(v), 0) for v in values], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state.pop("_lookups")
        return state

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preprocessor:
        return cls(**data)


def _buckets(values: Any, size: int) -> np.ndarray:
    """1 + a stable hash of each key modulo ``size`` (0 for null): integers by value, anything
    else by BLAKE2b of its text, so training (Arrow) and serving (lists) agree on every process."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_integer(values.type):
            present = values.is_valid().to_numpy(zero_copy_only=False)
            raw = pc.cast(values, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
            return np.where(present, raw % size + 1, 0).astype(np.int64)
        values = values.to_pylist()
    return np.array(
        [
            0
            if v is None
            else (v % size if isinstance(v, int) and not isinstance(v, bool) else _text_hash(v) % size) + 1
            for v in values
        ],
        dtype=np.int64,
    )


def _text_hash(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=8).digest(), "little")


def _numbers(values: Any, fill: float) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values with nulls filled, presence mask) from an Arrow array or a list."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = pc.cast(values, pa.float64())
        return values.fill_null(fill).to_numpy(zero_copy_only=False), values.is_valid().to_numpy(zero_copy_only=False)
    present = np.array([v is not None for v in values], dtype=bool)
    return np.array([fill if v is None else float(v) for v in values], dtype=np.float64), present
