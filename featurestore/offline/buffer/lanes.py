"""The push buffer's lanes: appends under a shared lock, drains that take a lane's journals
and commit them per target, and the process's background threads that do both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from featurestore.files import file_lock
from featurestore.offline.buffer.journal import (
    JOURNAL_BYTES,
    Journal,
    file_names,
    fsync_dir,
    remove_dead_spares,
    renamed,
    same_file,
    take_spare,
    torn_name,
    write_all,
    zero_filled,
)
from featurestore.offline.buffer.record import (
    FLAGS_AT,
    MAGIC,
    PENDING,
    RECORD,
    RETRY,
    Record,
    count_rows,
    decode,
    encode_parts,
    read_records,
)

APP_ID = "featurestore-buffer"
log = logging.getLogger(__name__)


class PushBuffer:
    def __init__(self, root: Path, max_rows: int = 10_000, max_seconds: float = 5.0):
        self.root = Path(root)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self._last_seq = 0
        self._looked_at = 0.0
        self._buffered: dict[str, int] = {}  # rows per target: seen at the last scan + appended since
        self._counted: dict[Path, tuple[int, int, int]] = {}  # per file looked at: (inode, offset counted to, rows)
        self._journals: dict[str, Journal] = {}  # this process's journal per lane
        self._spares: dict[
            str, tuple[int, Future]
        ] = {}  # per lane, the next journal being zero-filled: (pid, (fd, path))
        self._mutex = threading.Lock()  # this process's threads: one record written at a time
        self._committing: tuple[int, Future] | None = None  # (pid, the background commit in flight)

    def writer_id(self) -> str:
        """This buffer's name in the push logs' app transactions (made with the buffer's first
        record, kept in its folder): logs on object storage are shared by the buffers of many
        machines, each numbering its own records."""
        file = self.root / "writer-id"
        if not file.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another process of this machine made it first
                with open(file, "x") as out:
                    out.write(f"{APP_ID}:{uuid.uuid4().hex}")
        return file.read_text().strip()

    def worth_looking(self) -> bool:
        """Whether to scan the journals for due targets now: when a target may hold ``max_rows``
        (what the last scan saw plus this process's appends), or 1/20 of ``max_seconds`` after the
        last scan (a scan with each push cost more than the push)."""
        now = time.monotonic()
        if now - self._looked_at < self.max_seconds / 20 and all(n < self.max_rows for n in self._buffered.values()):
            return False
        self._looked_at = now
        return True

    def in_background(self, commit: Callable[[], object]) -> None:
        """Run ``commit`` (a drain of the due lanes) on this process's committing thread, unless one
        is in flight: a push returns without waiting for Delta (a commit of 5 s of pushes took
        ~0.6 s in the pushing call)."""
        with self._mutex:
            if self._committing is not None and self._committing[0] == os.getpid() and not self._committing[1].done():
                return
            self._committing = (os.getpid(), _committer().submit(_logged, commit))

    def wait_background(self) -> None:
        """Until the background commit in flight, if any, has ended."""
        committing = self._committing
        if committing is not None and committing[0] == os.getpid():
            committing[1].result()

    def _dir(self, target: str) -> Path:
        return self.root / target.replace(":", "__")

    @contextlib.contextmanager
    def _lock(self, target: str, exclusive: bool, name: str = ".lock") -> Iterator[None]:
        """Writers hold ``.lock`` shared while writing a record; a drain holds it exclusively while
        it takes the journals, and ``.drain-lock`` (drains only) for the whole drain."""
        folder = self._dir(target)
        folder.mkdir(parents=True, exist_ok=True)
        with file_lock(folder / name, shared=not exclusive):
            yield

    def append(
        self, target: str, rows: pa.Table, retry: bool = False, meanwhile: Callable[[], object] | None = None
    ) -> None:
        """Write rows durably as a record of the target's lane (see ``append_parts``)."""
        self.append_parts(target, {target: rows}, retry, meanwhile)

    def append_parts(
        self, lane: str, parts: dict[str, pa.Table], retry: bool = False, meanwhile: Callable[[], object] | None = None
    ) -> None:
        """Write one record in ``lane`` holding rows for several targets (``{target: rows}``): a
        push to a source's log and its views pays one sync, not one per target. Returns once it
        is durable. ``meanwhile``: the online write of the same rows, run while the sync is in
        flight; the record is ``PENDING`` until it returns. ``retry``: the rows may have been
        written by an earlier attempt."""
        rows = max(t.num_rows for t in parts.values())
        payload = encode_parts(parts)
        flags = (PENDING if meanwhile is not None else 0) | (RETRY if retry else 0)
        with self._lock(lane, exclusive=False), self._mutex:
            seq = self._last_seq = max(time.time_ns(), self._last_seq + 1)
            record = RECORD.pack(MAGIC, len(payload), zlib.crc32(payload), seq, rows, flags) + payload
            journal = self._journal(lane, len(record))
            at = journal.offset
            write_all(journal.fd, record, at)
            journal.offset += len(record)
            journal.users += 1
            if journal.capacity == JOURNAL_BYTES and lane not in self._spares:  # the next journal, ready when this one
                self._spares[lane] = (
                    os.getpid(),
                    _helper().submit(zero_filled, self._dir(lane)),
                )  # fills or is drained
        self._buffered[lane] = self._buffered.get(lane, 0) + rows
        try:
            # the online write goes to a thread and this one waits in the sync, which releases the GIL
            # (the other way round, the sync thread would wait for the GIL until Redis answers)
            written = _helper().submit(meanwhile) if meanwhile is not None else None
            try:
                os.fdatasync(journal.fd)
            finally:
                if written is not None:
                    written.result()
            if meanwhile is not None:  # Redis has the rows: no drain need re-send them (a lost clear only re-sends)
                os.pwrite(journal.fd, bytes([flags & ~PENDING]), at + FLAGS_AT)
        finally:
            with self._mutex:
                journal.release()

    def _journal(self, lane: str, size: int) -> Journal:
        """This process's journal of ``lane`` with room for ``size`` bytes, new if it is full, was
        drained (deleted or set aside) or belongs to the process this one was forked from."""
        journal = self._journals.get(lane)
        if journal is not None and journal.pid == os.getpid():
            if journal.offset + size <= journal.capacity and same_file(journal):
                return journal
            journal.retire()
        self.writer_id()  # named before its first record: a drain repeated from any copy of the folder knows it
        preallocate = size <= JOURNAL_BYTES // 4
        path = self._dir(lane) / f"{time.time_ns():020d}-{os.getpid()}.journal"  # named now: ``due`` reads its age
        pid, spare = self._spares.pop(lane, (None, None)) if preallocate else (None, None)
        fd = (
            take_spare(spare, path) if spare is not None and pid == os.getpid() else None
        )  # (a parent's: never done here)
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            if preallocate:
                write_all(fd, bytes(JOURNAL_BYTES), 0)
                os.fsync(fd)
        fsync_dir(path.parent)
        journal = self._journals[lane] = Journal(fd, path, os.getpid(), 0, JOURNAL_BYTES if preallocate else size)
        return journal

    def close(self) -> None:
        """Close this process's journals (their records stay for the next drain)."""
        self.wait_background()
        with self._mutex:
            for journal in self._journals.values():
                if journal.pid == os.getpid():
                    journal.retire()
            self._journals.clear()
            for pid, spare in self._spares.values():
                if pid == os.getpid():
                    with contextlib.suppress(Exception):
                        fd, path = spare.result()
                        os.close(fd)
                        path.unlink()
            self._spares.clear()

    def files(self, target: str) -> list[Path]:
        """The lane's journals (and older segment files), oldest first."""
        folder = self._dir(target)
        return [folder / name for name in file_names(folder)]

    def records(self, target: str) -> list[Record]:
        """The lane's complete records, in sequence order."""
        return sorted((r for path in self.files(target) for r in read_records(path, target)[0]), key=lambda r: r.seq)

    def targets(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(
            d.name.replace("__", ":", 1) for d in os.scandir(self.root) if d.is_dir() and file_names(Path(d.path))
        )

    def due(self, target: str) -> bool:
        """Whether the target's buffered rows are many or old enough to commit. Age first (no
        reading); rows from the record headers appended since the last look: counting every
        header of every journal at each look took a third of the committing thread's time."""
        folder = self._dir(target)
        names = file_names(folder)
        if not names:
            self._buffered[target] = 0
            return False
        if time.time_ns() - int(names[0].split("-")[0]) >= self.max_seconds * 1e9:
            return True
        rows = self._buffered[target] = sum(self._rows_in(folder / name) for name in names)
        return rows >= self.max_rows

    def _rows_in(self, path: Path) -> int:
        """Rows a file holds, read on from where the last look at the same file stopped."""
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:  # a drain took it since the listing
            return 0
        seen_inode, at, rows = self._counted.get(path, (inode, 0, 0))
        if seen_inode != inode:  # a new file under a reused name
            at, rows = 0, 0
        at, rows = count_rows(path, at, rows)
        if len(self._counted) > 256:  # forget files gone (drained): the table stays small
            self._counted = {p: c for p, c in self._counted.items() if p.exists()}
        self._counted[path] = (inode, at, rows)
        return rows

    def drain(
        self,
        lane: str,
        commit: Callable[[str, pa.Table, int, bool], None],
        resend_online: Callable[[str, pa.Table], None] | None = None,
        committed: Callable[[str], int] | None = None,
    ) -> int:
        """Commit every record of ``lane``, per target (``commit(target, rows, newest_seq, any_retry)``),
        and delete its journals; returns rows. Rows of records Redis did not confirm go to
        ``resend_online(target, rows)`` first. ``committed(target)``: the newest sequence the target
        already holds (a drain that crashed after its commit, before deleting its journals): its
        records up to that one are not committed again, whatever else the drain holds. Writers wait
        only while the journals are taken (renamed ``.draining``: their next record goes to a new
        journal), not during the commit."""
        with self._lock(lane, exclusive=True, name=".drain-lock"):
            with self._lock(lane, exclusive=True):
                files = [
                    path if not path.name.endswith(".journal") else renamed(path, path.name + ".draining")
                    for path in self.files(lane)
                ]
            records: list[Record] = []
            torn = []
            for path in files:
                complete, problem = read_records(path, lane)
                records += complete
                if problem:
                    torn.append(path)
                    log.warning(
                        "buffer %s ends in a torn record (%s): its writer died writing it, so no push "
                        "returned with it; the %d records before it commit, the file is kept as %s",
                        path.name,
                        problem,
                        len(complete),
                        torn_name(path),
                    )
            records.sort(key=lambda r: r.seq)
            by_target: dict[str, list] = {}
            newest: dict[str, int] = {}
            retried: dict[str, bool] = {}
            pending: dict[str, list] = {}
            held: dict[str, int] = {}
            for record in records:
                for target, stream in record.streams:
                    if record.pending:
                        pending.setdefault(target, []).append(stream)
                    if committed is not None and target not in held:
                        held[target] = committed(target)
                    if record.seq <= held.get(target, -1):
                        continue  # committed by a drain that did not get to delete its journals
                    by_target.setdefault(target, []).append(stream)
                    newest[target] = record.seq
                    retried[target] = retried.get(target, False) or record.retry
            if resend_online is not None:
                for target, streams in pending.items():
                    resend_online(target, decode(streams))
            total = 0
            for target, streams in by_target.items():
                rows = decode(streams)
                commit(target, rows, newest[target], retried[target])
                total += rows.num_rows
            for path in files:
                if path in torn:
                    os.replace(path, path.with_name(torn_name(path)))
                else:
                    path.unlink()
            remove_dead_spares(self._dir(lane))
            self._buffered[lane] = 0
            return total


def _logged(commit: Callable[[], object]) -> None:
    with contextlib.suppress(OSError):  # pushes first when the cores are busy (the thread's own nice value, Linux)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    try:
        commit()
    except Exception:  # the records stay buffered: the next commit takes them
        log.warning("committing buffered pushes failed; they stay buffered for the next commit", exc_info=True)


_COMMITTER: ThreadPoolExecutor | None = None


def _committer() -> ThreadPoolExecutor:
    """The process's thread for background commits: one at a time."""
    global _COMMITTER
    if _COMMITTER is None:
        _COMMITTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featurestore-commit")
    return _COMMITTER


_HELPER: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    """The process's threads for online writes made while a record is synced."""
    global _HELPER
    if _HELPER is None:
        _HELPER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="featurestore-push")  # more pushes queue
    return _HELPER


def _forget_helper() -> None:  # a forked child has none of its parent's threads
    global _HELPER, _COMMITTER
    _HELPER = _COMMITTER = None


os.register_at_fork(after_in_child=_forget_helper)
