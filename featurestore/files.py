"""Folders the stores keep their data in: private to the user running them (0700), as the
embedded Redis's are. Other local users then read nothing, whatever the umask gave the files
inside (Delta and DuckDB write theirs 0644); clients reach the data through the servers."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter: created 0700, or tightened if this user owns
    it and it lets others in (a folder another user owns is left as it is)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(info.st_mode) & 0o700)
    return path
