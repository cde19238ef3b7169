"""Journal files: preallocated with zeros so a record's durability is one ``fdatasync``.

A lane's folder holds each process's journals (``<ns>-<pid>.journal``), those a drain took
(``.draining``) or set aside with a torn record (``.torn``), and the next journal being
zero-filled in the background (``.spare``).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

JOURNAL_BYTES = 1 << 20  # preallocated per journal; a record over a quarter of it gets a journal of its own


@dataclass
class Journal:
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


def write_all(fd: int, data: bytes | pa.Buffer, at: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def file_names(folder: Path) -> list[str]:
    """Journal (also those a drain took and did not finish) and older segment file names, oldest first."""
    try:
        return sorted(name for name in os.listdir(folder) if name.endswith((".journal", ".draining", ".arrow")))
    except FileNotFoundError:
        return []


def zero_filled(folder: Path) -> tuple[int, Path]:
    """A journal-to-be: ``JOURNAL_BYTES`` of real zeros (not fallocate's unwritten extents, which
    later writes would turn into metadata), synced, under a name no drain reads."""
    path = folder / f"{time.time_ns():020d}-{os.getpid()}.spare"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, bytes(JOURNAL_BYTES), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd, path


def torn_name(path: Path) -> str:
    return path.name.removesuffix(".draining") + ".torn"


def renamed(path: Path, name: str) -> Path:
    os.replace(path, path.with_name(name))
    return path.with_name(name)


def remove_dead_spares(folder: Path) -> None:
    """Spare journals whose process is gone (1 MiB each, never used)."""
    for name in os.listdir(folder):
        if name.endswith(".spare"):
            try:
                os.kill(int(name.split("-")[1].split(".")[0]), 0)
            except ProcessLookupError:
                (folder / name).unlink(missing_ok=True)
            except (PermissionError, ValueError):
                pass  # alive (another user's), or not ours


def take_spare(spare: Future, path: Path) -> int | None:
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


def same_file(journal: Journal) -> bool:
    """Whether the journal's name still names the file its writer has open."""
    try:
        return os.stat(journal.path).st_ino == os.fstat(journal.fd).st_ino
    except FileNotFoundError:
        return False


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
