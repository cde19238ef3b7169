"""Local copies of history files on object storage, so a join reads local disk and no request.

A Delta data file is never rewritten under its name (every write makes a new uuid-named file;
compaction adds new ones and removes old ones from the log), so a copy taken once stays true
for as long as anyone may read it. Files a process writes are kept as they are uploaded
(write-through), files it reads are fetched once, in parallel. The cache is bounded in bytes:
past the bound, the least recently used files are removed (never one used in the last minutes,
which a scan may be about to open). Several processes may share one cache folder: every file
appears by an atomic rename.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from featurestore.object_requests import FileSystem

log = logging.getLogger("featurestore.offline")

FETCH_THREADS = 16  # parallel downloads: object storage answers each request slowly but many at once
IN_USE_SECONDS = 600  # a file touched this recently is never evicted (a scan may be about to open it)


class FileCache:
    """Immutable files by their path on object storage, under ``root``, at most ``max_bytes`` in all."""

    def __init__(self, root: Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def _place(self, path: str) -> Path:
        digest = hashlib.sha256(path.encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}.parquet"

    def keep(self, path: str, local: Path) -> None:
        """Take ``local`` (a file just uploaded to ``path``) into the cache, moving it (``trim`` after)."""
        target = self._place(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(local, target)
        except OSError:  # another file system: a copy
            shutil.copyfile(local, target)

    def fetch(self, paths: list[str], fs: FileSystem) -> list[Path]:
        """Local copies of ``paths`` (in ``fs``), downloading those not cached."""
        places = [self._place(p) for p in paths]
        now, missing = time.time(), []
        for path, place in zip(paths, places):
            try:
                os.utime(place, (now, now))  # recently used: evicted last
            except FileNotFoundError:
                missing.append((path, place))
        if missing:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(missing))) as pool:
                list(pool.map(lambda item: self._download(fs, *item), missing))
            self.trim()
        return places

    def _download(self, fs: FileSystem, path: str, place: Path) -> None:
        place.parent.mkdir(parents=True, exist_ok=True)
        incoming = place.with_name(f".{place.name}.{uuid.uuid4().hex}.tmp")
        try:
            with fs.open_input_stream(path) as source, open(incoming, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            os.replace(incoming, place)
        finally:
            incoming.unlink(missing_ok=True)

    def trim(self) -> None:
        """Remove the least recently used files past the bound."""
        if self.max_bytes <= 0:
            return
        files = [(f.stat(), f) for f in self.root.glob("??/*.parquet")]
        total = sum(info.st_size for info, _ in files)
        if total <= self.max_bytes:
            return
        cutoff = time.time() - IN_USE_SECONDS
        freed = 0
        for info, file in sorted(files, key=lambda item: item[0].st_mtime):
            if total - freed <= self.max_bytes * 0.9 or info.st_mtime > cutoff:
                break
            file.unlink(missing_ok=True)
            freed += info.st_size
        log.info(
            "history file cache: %d MB past its %d MB bound, %d MB of the least recently used removed",
            (total - self.max_bytes) >> 20,
            self.max_bytes >> 20,
            freed >> 20,
        )
