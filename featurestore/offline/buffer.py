"""A durable buffer in front of the history store: pushes return fast, Delta gets batches.

A push writes its rows as one segment file (Arrow IPC, fsynced; named by sequence, writer and
row count) under ``<data_dir>/buffer/<lane>/`` before it returns, so an acknowledged push
survives a crash; ``drain`` later commits all segments of a lane, one Delta append per target,
and deletes them. Targets are a view's history (``view:<name>``) or a push source's log
(``log:<name>``). A segment holds one target's rows (its lane's), or several (``append_parts``):
a push to both stores writes the source's log and its views' history in one segment of the
log's lane, one fsync for all (a fsync is most of a push's time).

Crash safety: a segment is named ``<seq>-<pid>-<rows>[-retry].<state>.arrow`` (``retry``: rows of an
idempotent push's retry, which the log must dedupe). ``pending`` means its online write
was not confirmed yet; the push renames it ``ready`` after Redis took the rows. ``drain``
re-sends pending segments online first (online writes are idempotent), so history never
holds rows Redis lacks. History appends dedupe by row identity; push-log appends carry a
Delta app transaction (``featurestore-buffer``, version = the newest segment's sequence), so a
drain that crashed after its commit but before deleting its segments never appends them twice.
A log is written from its own lane only, so those versions only grow.

The online write runs while the segment's fsync is in flight, once its bytes are written
(in the page cache): a killed process leaves a complete ``pending`` segment. A segment torn by
a writer killed mid-write (or a power loss before its fsync) was acknowledged to no one and
its rows never reached Redis; ``drain`` sets it aside (``.torn``) and says so. The one
exception: a power loss in the ~0.3 ms between the online write and the end of the fsync, if
Redis persisted the rows in that time (the embedded server fsyncs its log every second), leaves
them in Redis only, unacknowledged.

Concurrency: writers take a shared lock while writing or renaming a segment, ``drain`` an
exclusive one, so a drain sees only complete segments under stable names and no two drains
commit the same segment.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

APP_ID = "featurestore-buffer"
log = logging.getLogger(__name__)


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

    def append(self, target: str, rows: pa.Table, retry: bool = False, meanwhile: Callable[[], object] | None = None) -> Path:
        """Write rows durably as a new segment (see ``append_parts``)."""
        return self.append_parts(target, {target: rows}, retry, meanwhile)

    def append_parts(self, lane: str, parts: dict[str, pa.Table], retry: bool = False,
                     meanwhile: Callable[[], object] | None = None) -> Path:
        """Write one segment in ``lane`` holding rows for several targets (``{target: rows}``): a
        push to a source's log and its views pays one file and one fsync, not one per target.
        Returns once it is durable. ``meanwhile``: the online write of the same rows, run while the
        fsync is in flight (a fsync is half a push's time); the segment is ``pending`` until it
        returns. ``retry``: the rows may have been written by an earlier attempt."""
        single = list(parts) == [lane]
        table = parts[lane] if single else pa.table({
            "target": list(parts), "rows": pa.array([_ipc_bytes(rows) for rows in parts.values()], pa.large_binary())},
            metadata={PARTS: "1"})
        rows = max(t.num_rows for t in parts.values())
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        with self._lock(lane, exclusive=False):
            seq = self._last_seq = max(time.time_ns(), self._last_seq + 1)
            state = "ready" if meanwhile is None else "pending"
            # the name carries the row count, so checking the bounds opens no file. Written under
            # its final name: a writer killed mid-write leaves a torn segment, which no caller was
            # told is durable, whose rows Redis never got, and which ``drain`` sets aside
            path = self._dir(lane) / f"{seq:020d}-{os.getpid()}-{rows}{'-retry' if retry else ''}.{state}.arrow"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                data = memoryview(sink.getvalue())
                while data:
                    data = data[os.write(fd, data):]
            except BaseException:  # (a full disk): no segment
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        self._buffered[lane] = self._buffered.get(lane, 0) + rows
        # the online write goes to a thread and this one waits in fsync, which releases the GIL
        # (the other way round, the fsync thread would wait for the GIL until Redis answers)
        written = _helper().submit(meanwhile) if meanwhile is not None else None
        try:
            _fsync_and_close(fd, path.parent)
        finally:
            if written is not None:
                written.result()
        if meanwhile is not None:  # Redis has the rows: no drain need re-send them
            with self._lock(lane, exclusive=False), contextlib.suppress(FileNotFoundError):  # (a drain took it)
                os.replace(path, path.with_name(path.name.replace(".pending.", ".ready.")))
        return path

    def segments(self, target: str) -> list[Path]:
        folder = self._dir(target)
        return [folder / name for name in _segment_names(folder)]

    def targets(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(d.name.replace("__", ":", 1) for d in os.scandir(self.root) if d.is_dir() and _any_segment(d.path))

    def due(self, target: str) -> bool:
        """Whether the target's buffered rows are many or old enough to commit."""
        names = _segment_names(self._dir(target))
        if not names:
            self._buffered[target] = 0
            return False
        rows = self._buffered[target] = sum(int(n.split("-")[2].split(".")[0]) for n in names)
        oldest_ns = int(names[0].split("-")[0])
        return time.time_ns() - oldest_ns >= self.max_seconds * 1e9 or rows >= self.max_rows

    def drain(self, lane: str, commit: Callable[[str, pa.Table, int, bool], None],
              resend_online: Callable[[str, pa.Table], None] | None = None) -> int:
        """Commit every segment of ``lane``, per target (``commit(target, rows, newest_seq, any_retry)``),
        and delete them; returns rows. Rows of segments Redis did not confirm go to
        ``resend_online(target, rows)`` first."""
        with self._lock(lane, exclusive=True):
            segments = self.segments(lane)
            by_target: dict[str, list[pa.Table]] = {}
            pending: dict[str, list[pa.Table]] = {}
            for segment in list(segments):
                try:
                    parts = _read(segment, lane)
                except pa.ArrowInvalid as exc:
                    torn = segment.with_name(segment.name + ".torn")
                    os.replace(segment, torn)
                    segments.remove(segment)
                    log.warning("buffer segment %s is unreadable (%s): its writer died before finishing it, so no "
                                "push returned with it; set aside as %s", segment.name, exc, torn.name)
                    continue
                for target, rows in parts:
                    by_target.setdefault(target, []).append(rows)
                    if ".pending." in segment.name:
                        pending.setdefault(target, []).append(rows)
            if resend_online is not None:
                for target, tables in pending.items():
                    resend_online(target, pa.concat_tables(tables, promote_options="default"))
            if not segments:
                return 0
            newest, retried = int(segments[-1].name.split("-")[0]), any(s.name.split(".")[0].endswith("-retry") for s in segments)
            total = 0
            for target, tables in by_target.items():
                rows = pa.concat_tables(tables, promote_options="default")
                commit(target, rows, newest, retried)
                total += rows.num_rows
            for s in segments:
                s.unlink()
            self._buffered[lane] = 0
            return total


PARTS = "featurestore.parts"  # schema metadata of a segment holding several targets' rows


def _ipc_bytes(rows: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    return sink.getvalue().to_pybytes()


def _segment_names(folder: Path) -> list[str]:
    """Segment file names, oldest first (names, not Paths: a scan of thousands sorts 10x faster)."""
    try:
        return sorted(name for name in os.listdir(folder) if name.endswith(".arrow"))
    except FileNotFoundError:
        return []


def _any_segment(folder: str) -> bool:
    with os.scandir(folder) as entries:
        return any(e.name.endswith(".arrow") for e in entries)


def _read(path: Path, lane: str) -> list[tuple[str, pa.Table]]:
    """A segment's ``(target, rows)`` parts."""
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
    if (table.schema.metadata or {}).get(PARTS.encode()) != b"1":
        return [(lane, table)]
    return [(target, ipc.open_stream(pa.py_buffer(payload)).read_all())
            for target, payload in zip(table["target"].to_pylist(), table["rows"].to_pylist())]


def _fsync_and_close(fd: int, folder: Path) -> None:
    """Make a new segment durable: its bytes, then its name."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    folder_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


_HELPER: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    """The process's threads for online writes made while a segment is fsynced."""
    global _HELPER
    if _HELPER is None:
        _HELPER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="featurestore-push")  # more pushes queue
    return _HELPER


def _forget_helper() -> None:  # a forked child has none of its parent's threads
    global _HELPER
    _HELPER = None


os.register_at_fork(after_in_child=_forget_helper)
