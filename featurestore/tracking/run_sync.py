"""Training runs on object storage: written here, published there, pulled by every reader.

A run trains into this machine's folder (``local_dir/runs/<id>``: metric segments flushed as it
goes, checkpoints, artifacts' list), and ``publish`` copies what changed to ``data_dir/runs/<id>``
when the command ends (the newest sharded checkpoint's shards before the ``dcp/latest`` pointer
naming them, ``final.json`` last; sharded checkpoints older than the newest are removed there as
they are here). Readers on any machine (``featurestore runs``, the UI, ``train --resume``) first
``pull`` the runs they lack or that changed into their own folder, then read local files as
before. A run is written by one machine: the machine that wrote it (its folder records what it
published) never has its own files replaced by a pull.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.fs as pafs

from featurestore.files import atomic_write
from featurestore.storage import Location

log = logging.getLogger("featurestore.tracking")

PUBLISHED = ".published.json"  # in a run folder: what this machine published of it (it wrote the run)
PULLED = ".pulled.json"  # in a run folder: the remote files' (size, mtime) when last pulled
_LAST = ("dcp/latest", "final.json")  # uploaded after everything they point at or conclude


class RunMirror:
    """Runs under ``remote`` (an ``s3://`` prefix) mirrored in the local folder ``local``."""

    def __init__(self, remote: Location, local: Path):
        self.remote, self.local = remote, Path(local)

    def publish(self, run_id: str) -> int:
        """Upload the run's files that changed since its last publish; returns how many."""
        folder = self.local / run_id
        if not folder.is_dir():
            return 0
        record_file = folder / PUBLISHED
        published = json.loads(record_file.read_text()) if record_file.exists() else {"files": {}, "at": None}
        record = published["files"]
        files = {
            p.relative_to(folder).as_posix(): p
            for p in folder.rglob("*")
            if p.is_file()
            and p.name not in (PUBLISHED, PULLED)
            and not any(part.endswith(".tmp") for part in p.relative_to(folder).parts)  # being written
        }
        changed = sorted(
            (name for name, p in files.items() if record.get(name) != _stamp(p)),
            key=lambda n: (n in _LAST, _LAST.index(n) if n in _LAST else 0, n),
        )
        target = self.remote.child(run_id)
        for name in changed:
            target.upload(files[name], name)
            record[name] = _stamp(files[name])
        self._drop_old_checkpoints(run_id, folder)
        if changed:  # the store's clock, not this machine's: what a pull compares with
            fs, base = target.filesystem()
            published["at"] = fs.get_file_info(f"{base}/{changed[-1]}").mtime_ns
        published["files"] = {name: stamp for name, stamp in record.items() if name in files}
        atomic_write(record_file, json.dumps(published).encode())
        if changed:
            log.info("run %s: %d files published to %s", run_id, len(changed), target)
        return len(changed)

    def _drop_old_checkpoints(self, run_id: str, folder: Path) -> None:
        """Sharded checkpoints the run no longer keeps here, removed there too."""
        fs, base = self.remote.filesystem()
        kept = {p.name for p in (folder / "dcp").iterdir() if p.is_dir()} if (folder / "dcp").is_dir() else set()
        selector = pafs.FileSelector(f"{base}/{run_id}/dcp", allow_not_found=True)
        for info in fs.get_file_info(selector):
            if info.type == pafs.FileType.Directory and info.base_name not in kept:
                fs.delete_dir(info.path)

    def pull(self, run_id: str | None = None, checkpoints: bool = False) -> int:
        """Download the runs' files (one run's, or every run's) that are new or changed there,
        without their checkpoints unless asked (listing and comparing runs needs none); returns
        how many. Runs this machine wrote are left as they are."""
        fs, base = self.remote.filesystem()
        root = f"{base}/{run_id}" if run_id else base
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        by_run: dict[str, list[pafs.FileInfo]] = {}
        for info in infos:
            if info.type == pafs.FileType.File:
                run, _, name = info.path[len(base) + 1 :].partition("/")
                if name:
                    by_run.setdefault(run, []).append(info)
        fetched = 0
        for run, found in by_run.items():
            folder = self.local / run
            published = json.loads((folder / PUBLISHED).read_text()) if (folder / PUBLISHED).exists() else None
            record_file = folder / PULLED
            record = json.loads(record_file.read_text()) if record_file.exists() else {}
            for info in found:
                name = info.path[len(base) + len(run) + 2 :]
                if not checkpoints and (name.startswith("dcp/") or name == "checkpoint.pt"):
                    continue
                if published is not None and published["at"] is not None and info.mtime_ns <= published["at"]:
                    continue  # this machine's own, or older: what it wrote is the newest
                stamp = [info.size, info.mtime_ns]
                if record.get(name) == stamp and (folder / name).exists():
                    continue
                self.remote.child(run).download(name, folder / name)
                record[name] = stamp
                fetched += 1
            atomic_write(record_file, json.dumps(record).encode())
        return fetched


def _stamp(path: Path) -> list[int]:
    info = path.stat()
    return [info.st_size, info.st_mtime_ns]
