"""Feature logging: every served feature vector, written to a Delta table off the request path.

``log()`` appends to an in-memory buffer (no I/O, never raises); a background thread
flushes it every second (or when it grows) to ``<data_dir>/feature_logs/<name>``. If the
buffer overflows because writes keep failing, the oldest entries are dropped and counted:
serving never blocks or fails on logging.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake


def log_path(data_dir: Path, name: str) -> Path:
    return Path(data_dir) / "feature_logs" / name


class FeatureLogger:
    def __init__(self, path: Path, schema: pa.Schema, flush_interval: float = 1.0, max_buffered_rows: int = 1_000_000):
        self.path, self.schema = Path(path), schema
        self.interval, self.max_rows = flush_interval, max_buffered_rows
        self._buffer: list[dict[str, list[Any]]] = []
        self._rows = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped_rows = 0
        self.failed_flushes = 0
        self._thread = threading.Thread(target=self._run, name="feature-logger", daemon=True)
        self._thread.start()

    def log(self, columns: dict[str, list[Any]]) -> None:
        n = len(next(iter(columns.values())))
        with self._lock:
            self._buffer.append(columns)
            self._rows += n
            while self._rows > self.max_rows and self._buffer:
                dropped = self._buffer.pop(0)
                self._rows -= len(next(iter(dropped.values())))
                self.dropped_rows += len(next(iter(dropped.values())))

    def flush(self) -> int:
        with self._lock:
            pending, self._buffer, self._rows = self._buffer, [], 0
        if not pending:
            return 0
        try:
            table = pa.concat_tables([pa.table({f.name: pa.array(c[f.name], f.type) for f in self.schema}, schema=self.schema) for c in pending])
            write_deltalake(str(self.path), table, mode="append")
            return table.num_rows
        except Exception as exc:  # never let logging hurt serving; keep the rows for the next try
            self.failed_flushes += 1
            print(f"feature logging: flush failed ({exc}); will retry", file=sys.stderr)
            with self._lock:
                self._buffer = pending + self._buffer
                self._rows += sum(len(next(iter(c.values()))) for c in pending)
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()


def read_log(path: Path) -> pa.Table:
    if not (Path(path) / "_delta_log").exists():
        raise FileNotFoundError(f"no feature log at {path}; serve some predictions first")
    return DeltaTable(str(path)).to_pyarrow_table()
