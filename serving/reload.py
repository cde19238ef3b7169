"""Registry reload: a server swaps in new definitions when ``apply`` writes a registry version."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from featurestore import FeatureStore

log = logging.getLogger("featurestore.server")


class RegistryWatcher:
    """Reloads the repo's definitions when ``apply`` writes a new registry version.

    Requests read ``current`` (already loaded); a background task polls the registry file
    (its stamp once a second: a ``stat``, or a ``HEAD`` on object storage) and swaps in a fully
    loaded store, so no request parses anything.
    """

    def __init__(self, repo: Path, interval: float = 1.0):
        self.repo = repo
        self.interval = interval
        self.current = self._load()
        self._stamp: str | None = None
        self._stamp = self._stamped()

    def _load(self) -> FeatureStore:
        store = FeatureStore(self.repo)
        store.require_applied()  # parse and validate now, not on a request; serve applied definitions only
        store.recheck_unfilled()  # (the watermarks read here, off the event loop)
        return store

    def _stamped(self) -> str | None:
        try:
            return self.current.registry.stamp()
        except Exception as exc:  # object storage unreachable: check again next time
            log.warning("cannot check the registry for changes: %s", exc)
            return self._stamp

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            stamp = await asyncio.to_thread(self._stamped)
            await asyncio.to_thread(self.current.pack_pushed)  # (the tiles ended since the last push, if any)
            if self.current.unfilled_views:  # views waiting for a resend another process may be sending
                await asyncio.to_thread(self.current.recheck_unfilled)
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    fresh = await asyncio.to_thread(self._load)
                except Exception as exc:  # any failure: keep serving the last good definitions, keep watching
                    log.warning("registry reload failed, still serving the previous definitions: %s", exc)
                    continue
                fresh.share_online(self.current)  # keep the warm connection pool
                self.current = fresh
