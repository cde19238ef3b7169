"""Registry reload: a server swaps in new definitions when ``apply`` writes a registry version."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from featurestore import FeatureStore

log = logging.getLogger("featurestore.server")


class RegistryWatcher:
    """Reloads the repo's definitions when ``apply`` writes a new registry version.

    Requests read ``current`` (already loaded); a background task polls the registry file
    (one ``stat`` a second) and swaps in a fully loaded store, so no request parses anything.
    """

    def __init__(self, repo: Path, interval: float = 1.0):
        self.repo = repo
        self.interval = interval
        self.current = self._load()
        self._mtime = self._stat()

    def _load(self) -> FeatureStore:
        store = FeatureStore(self.repo)
        store.require_applied()  # parse and validate now, not on a request; serve applied definitions only
        return store

    def _stat(self) -> float:
        with contextlib.suppress(FileNotFoundError):
            return os.stat(self.current.registry.file).st_mtime
        return 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            mtime = self._stat()
            if mtime != self._mtime:
                self._mtime = mtime
                try:
                    fresh = await asyncio.to_thread(self._load)
                except Exception as exc:  # any failure: keep serving the last good definitions, keep watching
                    log.warning("registry reload failed, still serving the previous definitions: %s", exc)
                    continue
                fresh.share_online(self.current)  # keep the warm connection pool
                self.current = fresh
