"""Local files the stores keep: folders private to the user running them (0700), as the
embedded Redis's are (other local users then read nothing, whatever the umask gave the files
inside: Delta and DuckDB write theirs 0644; clients reach the data through the servers), and
the one advisory lock helper every local writer uses."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False) -> Iterator[None]:
    """Hold ``flock`` on ``path`` (created if missing), exclusive or shared, across processes of
    this machine. Local disk only: another host sees nothing of it."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter: created 0700, or tightened if this user owns
    it and it lets others in (a folder another user owns is left as it is)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(info.st_mode) & 0o700)
    return path


def atomic_write(path: Path, data: bytes) -> None:
    """Write temp file, fsync, rename, fsync dir: readers see the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync(path.parent)


def fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (names added, replaced, removed), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
