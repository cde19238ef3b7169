"""The applied registry state on disk: atomic writes, a history of versions, watermarks.

Layout under the registry directory::

    registry.json            current applied state (version, time, every object's spec + hash,
                             each view's history version and join-key types)
    history/v00001.json      every applied version, immutable
    watermarks.json          per-view materialization progress
    run_seq                  monotonic counter giving each write run a unique ingest id
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from featurestore.errors import FeatureStoreError
from featurestore.files import file_lock


@dataclass(frozen=True)
class Watermark:
    """One view's materialization progress."""

    online_synced: bool = False  # the online store holds the view's whole history, under ``online_layout``
    online_layout: str | None = None  # the layout id (``ViewLayout.storage_id``) the online store was filled under
    last_run_id: int | None = None  # the last write run that committed history
    materialized_at: str | None = None  # when it did (ISO, UTC)
    end: str | None = None  # the end of the last materialized interval (ISO)
    max_event_timestamp: str | None = None  # the newest event it stored (ISO)

    def synced_under(self, storage_id: str) -> bool:
        """Whether the online store holds the whole history in this layout (another layout: nothing of it)."""
        return self.online_synced and self.online_layout == storage_id

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Watermark:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # fields older versions wrote are dropped


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
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read(file: Path) -> Any:
    """A registry file, or an error naming it and the way out (files are written atomically,
    so a damaged one was edited or truncated by something else)."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        history = file.parent / "history"
        raise FeatureStoreError(
            f"registry file {file} is damaged ({exc}); restore it from {history} (every applied version is "
            "kept there) or from a backup, or move it away and run `featurestore apply` again"
        ) from None


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True, default=str).encode()


class RegistryStore:
    """Persisted applied state of one repo."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = self.path / "registry.json"

    def current(self) -> dict[str, Any]:
        if not self.file.exists():
            return {"version": 0, "applied_at": None, "objects": {}}
        return _read(self.file)

    def version(self, number: int) -> dict[str, Any]:
        file = self.path / "history" / f"v{number:05d}.json"
        if not file.exists():
            raise FileNotFoundError(f"registry version {number} not found in {self.path / 'history'}")
        return _read(file)

    def versions(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in (self.path / "history").glob("v*.json"))

    def apply(self, objects: dict[str, dict[str, dict]], **derived: Any) -> dict[str, Any]:
        """Record a new applied state; ``derived``: what the plan resolved with it (each view's
        history version and join-key types), so an older state can be read back as it was."""
        with self._lock():
            state = {
                "version": self.current()["version"] + 1,
                "applied_at": datetime.now(UTC).isoformat(),
                "objects": objects,
                **derived,
            }
            data = _dumps(state)
            atomic_write(self.path / "history" / f"v{state['version']:05d}.json", data)
            atomic_write(self.file, data)
        return state

    # -- materialization progress

    def watermarks(self) -> dict[str, Watermark]:
        file = self.path / "watermarks.json"
        return {view: Watermark.from_json(mark) for view, mark in (_read(file) if file.exists() else {}).items()}

    def watermark(self, view: str) -> Watermark:
        """The view's progress (an empty one before its first run)."""
        return self.watermarks().get(view, Watermark())

    def set_watermark(self, view: str, **values: Any) -> None:
        """Change the named fields of the view's watermark (a name ``Watermark`` lacks is a TypeError)."""
        with self._lock():
            marks = self.watermarks()
            marks[view] = replace(marks.get(view, Watermark()), **values)
            self._write_watermarks(marks)

    def drop_watermark(self, view: str) -> None:
        with self._lock():
            marks = self.watermarks()
            marks.pop(view, None)
            self._write_watermarks(marks)

    def _write_watermarks(self, marks: dict[str, Watermark]) -> None:
        data = {view: {k: v for k, v in asdict(mark).items() if v is not None} for view, mark in marks.items()}
        atomic_write(self.path / "watermarks.json", _dumps(data))

    def next_run_id(self) -> int:
        """A number no earlier write run got; orders runs for the ingest tie-break."""
        with self._lock():
            file = self.path / "run_seq"
            current = int(file.read_text()) if file.exists() else 0
            atomic_write(file, str(current + 1).encode())
            return current + 1

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.path.mkdir(parents=True, exist_ok=True)
        with file_lock(self.path / ".lock"):
            yield
