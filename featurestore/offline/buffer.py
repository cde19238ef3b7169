"""A durable buffer in front of the history store: pushes return fast, Delta gets batches.

A push writes its rows as one segment file (Arrow IPC, fsynced; named by sequence, writer and
row count) under
``<data_dir>/buffer/<target>/`` before it returns, so an acknowledged push survives a crash;
``drain`` later commits all segments of a target in one Delta append and deletes them.
Targets are a view's history (``view:<name>``) or a push source's log (``log:<name>``).

Crash safety: a segment is named ``<seq>-<pid>-<rows>[-retry].<state>.arrow`` (``retry``: rows of an
idempotent push's retry, which the log must dedupe). ``pending`` means its online write
was not confirmed yet; the push renames it ``ready`` after Redis took the rows. ``drain``
re-sends pending segments online first (online writes are idempotent), so history never
holds rows Redis lacks. History appends dedupe by row identity; push-log appends carry a
Delta app transaction (``featurestore-buffer``, version = the newest segment's sequence), so a
drain that crashed after its commit but before deleting its segments never appends them twice.

Concurrency: writers take a shared lock while writing a segment, ``drain`` an exclusive one,
so a drain sees only complete segments and no two drains commit the same segment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

APP_ID = "featurestore-buffer"


class PushBuffer:
    def __init__(self, root: Path, max_rows: int = 10_000, max_seconds: float = 5.0):
        self.root = Path(root)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self._last_seq = 0
        self._looked_at = 0.0
        self._buffered: dict[str, int] = {}  # rows per target: seen at the last scan + appended since

    def worth_looking(self) -> bool:
        """Whether to scan the segments for due targets now: when a target may hold ``max_rows``
        (what the last scan saw plus this process's appends), or 1/20 of ``max_seconds`` after the
        last scan (a scan lists every segment: with each push it cost more than the push)."""
        now = time.monotonic()
        if now - self._looked_at < self.max_seconds / 20 and all(n < self.max_rows for n in self._buffered.values()):
            return False
        self._looked_at = now
        return True

    def _dir(self, target: str) -> Path:
        return self.root / target.replace(":", "__")

    @contextlib.contextmanager
    def _lock(self, target: str, exclusive: bool) -> Iterator[None]:
        folder = self._dir(target)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def append(self, target: str, rows: pa.Table, online_pending: bool = False, retry: bool = False) -> Path:
        """Write rows durably as a new segment; ``online_pending``: Redis has not confirmed them yet;
        ``retry``: they may have been written by an earlier attempt."""
        with self._lock(target, exclusive=False):
            seq = self._last_seq = max(time.time_ns(), self._last_seq + 1)
            state = "pending" if online_pending else "ready"
            # the name carries the row count, so checking the bounds opens no file
            path = self._dir(target) / f"{seq:020d}-{os.getpid()}-{rows.num_rows}{'-retry' if retry else ''}.{state}.arrow"
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                with ipc.new_file(f, rows.schema) as writer:
                    writer.write_table(rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
            self._buffered[target] = self._buffered.get(target, 0) + rows.num_rows
            return path

    @staticmethod
    def confirm_online(segment: Path) -> None:
        """The segment's rows are in Redis: drains need not re-send them."""
        os.replace(segment, segment.with_name(segment.name.replace(".pending.", ".ready.")))

    def segments(self, target: str) -> list[Path]:
        folder = self._dir(target)
        return sorted(folder.glob("*.arrow")) if folder.exists() else []

    def targets(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name.replace("__", ":", 1) for p in self.root.iterdir() if p.is_dir() and any(p.glob("*.arrow")))

    def due(self, target: str) -> bool:
        """Whether the target's buffered rows are many or old enough to commit."""
        segments = self.segments(target)
        if not segments:
            self._buffered[target] = 0
            return False
        rows = self._buffered[target] = sum(int(s.name.split("-")[2].split(".")[0]) for s in segments)
        oldest_ns = int(segments[0].name.split("-")[0])
        return time.time_ns() - oldest_ns >= self.max_seconds * 1e9 or rows >= self.max_rows

    def drain(self, target: str, commit: Callable[[pa.Table, int, bool], None], resend_online: Callable[[pa.Table], None] | None = None) -> int:
        """Commit every segment of ``target`` (``commit(rows, newest_seq, any_retry)``) and delete them; returns rows."""
        with self._lock(target, exclusive=True):
            segments = self.segments(target)
            if not segments:
                return 0
            tables = [_read(s) for s in segments]
            if resend_online is not None:
                pending = [t for s, t in zip(segments, tables) if ".pending." in s.name]
                if pending:
                    resend_online(pa.concat_tables(pending))
            rows = pa.concat_tables(tables)
            commit(rows, int(segments[-1].name.split("-")[0]), any(s.name.split(".")[0].endswith("-retry") for s in segments))
            for s in segments:
                s.unlink()
            self._buffered[target] = 0
            return rows.num_rows


def _read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
