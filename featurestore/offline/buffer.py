"""A durable buffer in front of the history store: pushes return fast, Delta gets batches.

Each process appends its pushes to a journal per lane, ``<data_dir>/buffer/<lane>/<seq>-<pid>.journal``
(lanes: a view's history, ``view:<name>``, or a push source's log, ``log:<name>``), and a push
returns once its record is durable. A journal is preallocated with zeros, so making a record
durable is an ``fdatasync`` of its bytes alone: no new file, no directory fsync, no file-system
journal commit (a third of the old segment-per-push fsync; the next journal is zero-filled in
the background, ready when the current one fills or a drain takes it). ``drain`` later commits a lane's records, one
Delta append per target, and deletes its journals; a push that finds its lane due starts that
on the process's committing thread (``in_background``) and returns.

A record is a header (``RECORD``: magic, payload length, CRC-32 of the payload, sequence, rows,
flags) and a payload of parts, each a target's name and its rows as an Arrow IPC stream: a push
to both stores writes the source's log and its views' history as one record of the log's lane.
A drain decodes the parts of one target and schema in one go: their streams joined into one
(a record per call cost ~50 µs of a commit's CPU, which pushes beside it felt).

Crash safety: a record is ``PENDING`` until its online write is confirmed; the push then clears
the flag. ``drain`` re-sends pending records online first (online writes are idempotent), so
history never holds rows Redis lacks. The online write runs while the record's ``fdatasync``
is in flight, once its bytes are written (in the page cache): a killed process leaves a complete
pending record. A journal is read up to its first invalid record: zeros (its end) or a record
torn by a writer killed mid-write or a power loss before its sync. Such a record was
acknowledged to no one and its rows never reached Redis (nor did any after it: a process writes
its records in order and each sync covers the earlier ones); ``drain`` keeps the journal as
``.torn`` and says so. The one exception: a power loss in the ~0.3 ms between the online write
and the end of the sync, if Redis persisted the rows in that time (the embedded server fsyncs
its log every second), leaves them in Redis only, unacknowledged. History appends dedupe by row
identity; push-log appends carry a Delta app transaction (``featurestore-buffer``, version =
the newest record's sequence), so a drain that crashed after its commit but before deleting
its journals never appends them twice. A log is written from its own lane only, so those
versions only grow. (Segment files of one record each, ``<seq>-<pid>-<rows>[-retry].<state>.arrow``,
written by earlier versions, drain as before.)

Concurrency: writers take a shared lock (``.lock``) while writing a record; ``drain`` takes it
exclusively only to take the lane's journals (renamed ``.draining``; a writer's next record goes
to a new journal), so it sees only complete records and writers never wait for Delta. Drains
serialize on ``.drain-lock``, so no two commit the same record. Threads of one process share its
journal; a replaced journal's descriptor closes with its last in-flight push.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from featurestore.files import file_lock

APP_ID = "featurestore-buffer"
log = logging.getLogger(__name__)

RECORD = struct.Struct(">4sIIQIB7x")  # magic, payload bytes, CRC-32, sequence, rows, flags (32 bytes)
MAGIC = b"FSB2"
FLAGS_AT = 24  # the flags byte's offset in the header
PENDING, RETRY = 1, 2
JOURNAL_BYTES = 1 << 20  # preallocated per journal; a record over a quarter of it gets a journal of its own


@dataclass
class Record:
    """One push's rows in a lane: ``streams`` is ``[(target, rows as an Arrow IPC stream)]``."""

    seq: int
    rows: int
    pending: bool
    retry: bool
    streams: list[tuple[str, Any]]  # (target, bytes-like IPC stream or, from an old segment, a Table)

    @property
    def parts(self) -> list[tuple[str, pa.Table]]:
        """``[(target, rows)]``."""
        return [
            (target, s if isinstance(s, pa.Table) else ipc.open_stream(pa.py_buffer(s)).read_all())
            for target, s in self.streams
        ]


@dataclass
class _Journal:
    fd: int
    path: Path
    pid: int
    offset: int
    capacity: int
    users: int = 0  # appends still to sync or flag through ``fd``
    retired: bool = False  # replaced: ``fd`` closes with its last user (a closed number is reused at once)

    def release(self) -> None:
        self.users -= 1
        if self.retired and not self.users:
            os.close(self.fd)

    def retire(self) -> None:
        self.retired = True
        if not self.users:
            os.close(self.fd)


class PushBuffer:
    def __init__(self, root: Path, max_rows: int = 10_000, max_seconds: float = 5.0):
        self.root = Path(root)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self._last_seq = 0
        self._looked_at = 0.0
        self._buffered: dict[str, int] = {}  # rows per target: seen at the last scan + appended since
        self._counted: dict[Path, tuple[int, int, int]] = {}  # per file looked at: (inode, offset counted to, rows)
        self._journals: dict[str, _Journal] = {}  # this process's journal per lane
        self._spares: dict[
            str, tuple[int, Future]
        ] = {}  # per lane, the next journal being zero-filled: (pid, (fd, path))
        self._mutex = threading.Lock()  # this process's threads: one record written at a time
        self._committing: tuple[int, Future] | None = None  # (pid, the background commit in flight)

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
        payload = b"".join(
            _PART.pack(len(name := target.encode()), len(stream := _ipc_bytes(table))) + name + stream
            for target, table in parts.items()
        )
        flags = (PENDING if meanwhile is not None else 0) | (RETRY if retry else 0)
        with self._lock(lane, exclusive=False), self._mutex:
            seq = self._last_seq = max(time.time_ns(), self._last_seq + 1)
            record = RECORD.pack(MAGIC, len(payload), zlib.crc32(payload), seq, rows, flags) + payload
            journal = self._journal(lane, len(record))
            at = journal.offset
            _write_all(journal.fd, record, at)
            journal.offset += len(record)
            journal.users += 1
            if journal.capacity == JOURNAL_BYTES and lane not in self._spares:  # the next journal, ready when this one
                self._spares[lane] = (
                    os.getpid(),
                    _helper().submit(_zero_filled, self._dir(lane)),
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

    def _journal(self, lane: str, size: int) -> _Journal:
        """This process's journal of ``lane`` with room for ``size`` bytes, new if it is full, was
        drained (deleted or set aside) or belongs to the process this one was forked from."""
        journal = self._journals.get(lane)
        if journal is not None and journal.pid == os.getpid():
            if journal.offset + size <= journal.capacity and _same_file(journal):
                return journal
            journal.retire()
        preallocate = size <= JOURNAL_BYTES // 4
        path = self._dir(lane) / f"{time.time_ns():020d}-{os.getpid()}.journal"  # named now: ``due`` reads its age
        pid, spare = self._spares.pop(lane, (None, None)) if preallocate else (None, None)
        fd = (
            _take_spare(spare, path) if spare is not None and pid == os.getpid() else None
        )  # (a parent's: never done here)
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            if preallocate:
                _write_all(fd, bytes(JOURNAL_BYTES), 0)
                os.fsync(fd)
        _fsync_dir(path.parent)
        journal = self._journals[lane] = _Journal(fd, path, os.getpid(), 0, JOURNAL_BYTES if preallocate else size)
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
        return [folder / name for name in _file_names(folder)]

    def records(self, target: str) -> list[Record]:
        """The lane's complete records, in sequence order."""
        return sorted((r for path in self.files(target) for r in _records(path, target)[0]), key=lambda r: r.seq)

    def targets(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(
            d.name.replace("__", ":", 1) for d in os.scandir(self.root) if d.is_dir() and _file_names(Path(d.path))
        )

    def due(self, target: str) -> bool:
        """Whether the target's buffered rows are many or old enough to commit. Age first (no
        reading); rows from the record headers appended since the last look: counting every
        header of every journal at each look took a third of the committing thread's time."""
        folder = self._dir(target)
        names = _file_names(folder)
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
        at, rows = _rows_in(path, at, rows)
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
                    path if not path.name.endswith(".journal") else _renamed(path, path.name + ".draining")
                    for path in self.files(lane)
                ]
            records: list[Record] = []
            torn = []
            for path in files:
                complete, problem = _records(path, lane)
                records += complete
                if problem:
                    torn.append(path)
                    log.warning(
                        "buffer %s ends in a torn record (%s): its writer died writing it, so no push "
                        "returned with it; the %d records before it commit, the file is kept as %s",
                        path.name,
                        problem,
                        len(complete),
                        _torn_name(path),
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
                    resend_online(target, _decode(streams))
            total = 0
            for target, streams in by_target.items():
                rows = _decode(streams)
                commit(target, rows, newest[target], retried[target])
                total += rows.num_rows
            for path in files:
                if path in torn:
                    os.replace(path, path.with_name(_torn_name(path)))
                else:
                    path.unlink()
            _remove_dead_spares(self._dir(lane))
            self._buffered[lane] = 0
            return total


PARTS = "featurestore.parts"  # schema metadata of an old segment holding several targets' rows
_PART = struct.Struct(">HI")  # a part's target name length, then its stream's
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _ipc_bytes(rows: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    return sink.getvalue().to_pybytes()


def _decode(streams: list) -> pa.Table:
    """One target's rows from its records' IPC streams (and old segments' tables), in order:
    streams of one schema are joined into one (its schema message once, every stream's batch
    messages, one end) and read in one call."""
    tables: list[pa.Table] = []
    schema_message, batches = b"", list[bytes | memoryview]()
    joinable: dict[bytes, bool] = {}  # per schema message: no dictionaries (each stream would carry its own)

    def read_joined() -> None:
        if batches:
            tables.append(ipc.open_stream(pa.py_buffer(b"".join([schema_message, *batches, _EOS]))).read_all())
            batches.clear()

    for i, stream in enumerate(streams):
        _yield_gil(i)
        if isinstance(stream, pa.Table):
            read_joined()
            tables.append(stream)
            continue
        view = memoryview(stream)
        # a stream: its schema message (continuation marker, metadata length, metadata), batch messages, the end
        length = struct.unpack_from("<i", view, 4)[0] if view[:4] == b"\xff\xff\xff\xff" else -1
        schema = bytes(view[: 8 + length]) if length >= 0 and view[-8:] == _EOS else b""
        if schema and schema not in joinable:
            joinable[schema] = not any(pa.types.is_dictionary(f.type) for f in ipc.read_schema(pa.py_buffer(schema)))
        if not schema or not joinable[schema]:  # read alone
            read_joined()
            tables.append(ipc.open_stream(pa.py_buffer(stream)).read_all())
            continue
        if schema != schema_message:
            read_joined()
            schema_message = schema
        batches.append(view[8 + length : -8])
    read_joined()
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def _write_all(fd: int, data: bytes | pa.Buffer, at: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def _file_names(folder: Path) -> list[str]:
    """Journal (also those a drain took and did not finish) and older segment file names, oldest first."""
    try:
        return sorted(name for name in os.listdir(folder) if name.endswith((".journal", ".draining", ".arrow")))
    except FileNotFoundError:
        return []


def _records(path: Path, lane: str) -> tuple[list[Record], str | None]:
    """A file's complete records, and what is wrong with the first incomplete one (None: none is)."""
    if path.suffix == ".arrow":  # a segment of an earlier version: one record, its state in its name
        seq, _, rows = path.name.split(".")[0].split("-")[:3]
        try:
            parts = _segment_parts(pa.py_buffer(path.read_bytes()), lane)
        except pa.ArrowInvalid as exc:
            return [], str(exc)
        return [Record(int(seq), int(rows), ".pending." in path.name, "-retry" in path.name, parts)], None
    data = path.read_bytes()
    records: list[Record] = []
    at = 0
    while at + RECORD.size <= len(data):
        _yield_gil(len(records))
        magic, size, crc, seq, rows, flags = RECORD.unpack_from(data, at)
        if magic != MAGIC:
            return records, None if not any(data[at : at + RECORD.size]) else f"no record header at byte {at}"
        payload = memoryview(data)[at + RECORD.size : at + RECORD.size + size]  # (no copy)
        if len(payload) < size or zlib.crc32(payload) != crc:
            return records, f"record at byte {at} is cut short or corrupt"
        records.append(Record(seq, rows, bool(flags & PENDING), bool(flags & RETRY), _streams(payload)))
        at += RECORD.size + size
    return records, None


def _rows_in(path: Path, at: int = 0, rows: int = 0) -> tuple[int, int]:
    """``(where the valid records end, rows)`` of a file, counting on from record offset ``at`` with
    ``rows`` before it, from the record headers (payloads are not read)."""
    if path.suffix == ".arrow":
        return 0, int(path.name.split("-")[2].split(".")[0])
    try:
        with open(path, "rb") as f:
            while (header := os.pread(f.fileno(), RECORD.size, at)) and len(header) == RECORD.size:
                magic, size, _, _, n, _ = RECORD.unpack(header)
                if magic != MAGIC:
                    break
                rows, at = rows + n, at + RECORD.size + size
    except FileNotFoundError:  # a drain took it since the listing
        pass
    return at, rows


def _streams(payload: memoryview) -> list[tuple[str, memoryview]]:
    """A record's ``(target, IPC stream)`` parts."""
    parts, at = [], 0
    while at < len(payload):
        name_length, stream_length = _PART.unpack_from(payload, at)
        at += _PART.size
        name, stream = (
            bytes(payload[at : at + name_length]).decode(),
            payload[at + name_length : at + name_length + stream_length],
        )
        parts.append((name, stream))
        at += name_length + stream_length
    return parts


def _segment_parts(payload: pa.Buffer, lane: str) -> list[tuple[str, pa.Table]]:
    """An old segment's ``(target, rows)`` parts (one target's rows, or a table of them)."""
    table = ipc.open_file(payload).read_all()
    if (table.schema.metadata or {}).get(PARTS.encode()) != b"1":
        return [(lane, table)]
    return [
        (target, ipc.open_stream(pa.py_buffer(rows)).read_all())
        for target, rows in zip(table["target"].to_pylist(), table["rows"].to_pylist())
    ]


def _zero_filled(folder: Path) -> tuple[int, Path]:
    """A journal-to-be: ``JOURNAL_BYTES`` of real zeros (not fallocate's unwritten extents, which
    later writes would turn into metadata), synced, under a name no drain reads."""
    path = folder / f"{time.time_ns():020d}-{os.getpid()}.spare"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, bytes(JOURNAL_BYTES), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd, path


def _yield_gil(i: int) -> None:
    """Every 64 records, let a waiting thread (a push) have the GIL now: a commit's per-record loops
    otherwise keep it for the interpreter's switch interval (5 ms) each time a push needs it."""
    if i % 64 == 63:
        time.sleep(0)


def _torn_name(path: Path) -> str:
    return path.name.removesuffix(".draining") + ".torn"


def _renamed(path: Path, name: str) -> Path:
    os.replace(path, path.with_name(name))
    return path.with_name(name)


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


def _remove_dead_spares(folder: Path) -> None:
    """Spare journals whose process is gone (1 MiB each, never used)."""
    for name in os.listdir(folder):
        if name.endswith(".spare"):
            try:
                os.kill(int(name.split("-")[1].split(".")[0]), 0)
            except ProcessLookupError:
                (folder / name).unlink(missing_ok=True)
            except (PermissionError, ValueError):
                pass  # alive (another user's), or not ours


def _take_spare(spare: Future, path: Path) -> int | None:
    """The spare journal renamed to ``path`` (its descriptor), or None if it failed or is gone
    (a drain removed it as a dead process's)."""
    try:
        fd, spare_path = spare.result()
    except Exception:
        return None
    try:
        os.replace(spare_path, path)
    except FileNotFoundError:
        os.close(fd)
        return None
    return fd


def _same_file(journal: _Journal) -> bool:
    """Whether the journal's name still names the file its writer has open."""
    try:
        return os.stat(journal.path).st_ino == os.fstat(journal.fd).st_ino
    except FileNotFoundError:
        return False


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
