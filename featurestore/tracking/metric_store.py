"""An append-only metric store per run, written as training goes and readable while it runs.

Each writer (a process: ``main``, or ``rank3`` in distributed training) owns a folder
``<run>/metrics/<writer>/`` of Parquet segments named by the flush sequence numbers they hold,
``<first>-<last>.parquet``. A flush writes one segment atomically (temporary file, rename), so
readers never see a partial one and writers never lock each other out. Past ``max_segments``
a writer merges its segments into one; readers skip segments another one covers, so a reader
listing the folder mid-merge sees each record once.

On disk a record costs a few bytes: steps are delta-encoded, values and times byte-stream-split,
metric names dictionary-encoded, all zstd-compressed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [("step", pa.int64()), ("wall_time", pa.float64()), ("metric", pa.string()), ("value", pa.float64())]
)
_SEGMENT = re.compile(r"(\d{8})-(\d{8})\.parquet")


def _write(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(
        table,
        tmp,
        compression="zstd",
        use_dictionary=["metric"],
        column_encoding={"step": "DELTA_BINARY_PACKED", "wall_time": "BYTE_STREAM_SPLIT", "value": "BYTE_STREAM_SPLIT"},
    )
    os.replace(tmp, path)


class MetricWriter:
    """Buffers ``log`` calls and flushes them as a segment every ``flush_rows`` records or
    ``flush_seconds`` (checked at each call), and on ``flush``/``close``. The buffer is bounded
    by ``flush_rows``."""

    def __init__(
        self,
        run_dir: Path,
        writer: str = "main",
        flush_rows: int = 10_000,
        flush_seconds: float = 2.0,
        max_segments: int = 32,
    ):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", writer):
            raise ValueError(f"writer names are letters, digits, '_', '.', '-': {writer!r}")
        self.folder = Path(run_dir) / "metrics" / writer
        self.folder.mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_seconds, self.max_segments = flush_rows, flush_seconds, max_segments
        self._columns: dict[str, list] = {name: [] for name in SCHEMA.names}
        self._flushed_at = time.monotonic()
        self._seq = (
            max((int(m.group(2)) for m in map(_SEGMENT.fullmatch, os.listdir(self.folder)) if m), default=-1) + 1
        )

    def log(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """Record ``values`` (metric name -> number) at ``step``."""
        now = time.time() if wall_time is None else wall_time
        for name, value in values.items():
            self._columns["step"].append(int(step))
            self._columns["wall_time"].append(now)
            self._columns["metric"].append(name)
            self._columns["value"].append(float(value))
        if len(self._columns["step"]) >= self.flush_rows or time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._flushed_at = time.monotonic()
        if not self._columns["step"]:
            return
        _write(self.folder / f"{self._seq:08d}-{self._seq:08d}.parquet", pa.table(self._columns, schema=SCHEMA))
        self._seq += 1
        self._columns = {name: [] for name in SCHEMA.names}
        if len(_segments(self.folder)) > self.max_segments:
            self.merge()

    def merge(self) -> None:
        """Rewrite this writer's segments as one (the merged file appears before the parts go)."""
        parts = _segments(self.folder)
        if len(parts) < 2:
            return
        first, last = parts[0][0], parts[-1][1]
        _write(self.folder / f"{first:08d}-{last:08d}.parquet", pa.concat_tables(pq.read_table(p) for _, _, p in parts))
        for _, _, path in parts:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self.flush()
        self.merge()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _segments(folder: Path) -> list[tuple[int, int, Path]]:
    """(first, last, path) of the segments to read, in order; a segment inside another's range is
    skipped (the parts of a merge not yet deleted)."""
    found = sorted(
        (int(m.group(1)), -int(m.group(2)), folder / m.group(0))
        for m in map(_SEGMENT.fullmatch, os.listdir(folder))
        if m
    )
    kept: list[tuple[int, int, Path]] = []
    for first, neg_last, path in found:  # widest first at each start
        if kept and -neg_last <= kept[-1][1]:
            continue
        kept.append((first, -neg_last, path))
    return kept


def writers(run_dir: Path) -> list[str]:
    root = Path(run_dir) / "metrics"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


NAMES = pa.dictionary(pa.int32(), pa.string())  # metric and writer names as read: a few distinct values


def _read(path: Path, metric: str | None, columns: list[str]) -> pa.Table:
    # names stay dictionary-encoded: filtering them is 10x faster than a pushed-down filter here
    table = pq.read_table(path, columns=columns, read_dictionary=["metric"])
    if metric is not None:
        table = table.filter(pc.equal(table["metric"], metric))
    return table


def read_metrics(
    run_dir: Path, metric: str | None = None, writer: str | None = None, columns: list[str] | None = None
) -> pa.Table:
    """Records of a run (optionally one metric, one writer, some columns) as a table: writer,
    step, wall_time, metric, value (names dictionary-encoded); each writer's records in the order logged."""
    columns = columns or SCHEMA.names
    if "metric" not in columns:
        columns = [*columns, "metric"]
    empty = pa.schema([pa.field(c, NAMES) if c == "metric" else SCHEMA.field(c) for c in columns]).empty_table()
    tables = []
    for name in [writer] if writer else writers(run_dir):
        folder = Path(run_dir) / "metrics" / name
        for attempt in range(20):
            try:
                parts = [_read(p, metric, columns) for _, _, p in _segments(folder)]
                break
            except FileNotFoundError:  # merged away between listing and reading: list again, once the merge is done
                if attempt == 19:
                    raise
                time.sleep(0.002 * attempt)
        table = pa.concat_tables(parts) if parts else empty
        tables.append(
            table.add_column(
                0,
                "writer",
                pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)), pa.array([name])),
            )
        )
    if not tables:
        return empty.add_column(0, "writer", pa.array([], NAMES))
    return pa.concat_tables(tables)
