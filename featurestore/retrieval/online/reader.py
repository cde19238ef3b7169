"""Online lookups end to end: the façade and both servers read through an ``OnlineReader``.

A lookup is one round trip: its ``OnlineQuery.lookups``, its ranges read plainly with the tile
summaries of those that summaries may answer, and the windows of entities known to hold more
members than a plain read's limit, read by ``read_window.lua`` (their summaries and the events of
their other tiles). A plain read that holds a heavy entity's whole window (``heavy_from`` events
or more, its blocks counting theirs) is answered from the summaries read with it; a second round
trip only for one that stopped at its limit (events not packed in blocks).
Then the assembly, then storing the tile summaries the lookup computed, so the next lookups of
those entities read summaries, not events.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

from featurestore.online import packed
from featurestore.online.base import OnlineReads
from featurestore.retrieval.online.assembly import assemble
from featurestore.retrieval.online.plan import OnlineQuery, is_tiled
from featurestore.retrieval.online.response import OnlineResponse

log = logging.getLogger(__name__)

# Events a response may decode and aggregate on the event loop; past it (a cold heavy card: 50,000
# events, ~25 ms) assembling runs on a thread, and the loop answers other requests meanwhile.
OFF_LOOP_EVENTS = 2_000


class HeavyKeys:
    """Events keys of entities whose plain read stopped at its limit lately (heavy, their events
    not packed in blocks). Their next lookups read through ``read_window.lua`` at once, skipping
    the plain read: up to the limit's members, read only to be dropped, cost Redis ~1 ms and a
    round trip. A hint only saves time (summaries answer exactly for any entity), and it is
    bounded and expires, so an entity packed or gone light returns to the plain read."""

    def __init__(self, size: int = 10_000, seconds: float = 60.0):
        self.size, self.seconds = size, seconds
        self._until: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            self._until.pop(key, None)
            return False
        return True

    def add(self, key: bytes) -> None:
        with self._lock:
            self._until[key] = time.monotonic() + self.seconds
            self._until.move_to_end(key)
            while len(self._until) > self.size:
                self._until.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)

    def clear(self) -> None:
        with self._lock:
            self._until.clear()


class OnlineReader:
    """Reads lookups from an online store, remembering which entities are heavy. ``max_sealing``
    bounds the tile summaries being stored in the background at once (past it, a later lookup
    stores them; 0: never store any, a read-only reader)."""

    def __init__(self, store: OnlineReads, heavy: HeavyKeys | None = None, max_sealing: int = 4):
        self.store = store
        self.heavy = heavy if heavy is not None else HeavyKeys()
        self.max_sealing = max_sealing
        self._sealing: set[asyncio.Task] = set()

    def read(self, query: OnlineQuery) -> OnlineResponse:
        """``query`` answered, its tile summaries stored before returning."""
        plain, windows, summaries = self._reads(query)
        raw = query.placed(
            self.store.read(query.lookups, plain, windows, summaries) if query.lookups or plain or windows else []
        )
        query.require_retained(raw)
        found = self._found_heavy(query, raw)
        if found:
            query.place_heavy(found, raw, self.store.read((), (), [query.tiles_read(pos) for pos in found]))
        response = assemble(query, raw)
        if query.seals and self.max_sealing:
            try:
                self.store.seal(query.seals)
            except Exception as exc:  # summaries only save time: a lookup without them is as exact
                log.debug("storing tile summaries failed: %s", exc)
        return response

    async def read_async(self, query: OnlineQuery) -> OnlineResponse:
        """``read`` on the event loop; the tile summaries are stored in the background."""
        plain, windows, summaries = self._reads(query)
        if query.lookups or plain or windows:
            raw = query.placed(await self.store.read_async(query.lookups, plain, windows, summaries))
        else:
            raw = query.placed([])
        query.require_retained(raw)
        found = self._found_heavy(query, raw)
        if found:
            query.place_heavy(found, raw, await self.store.read_async((), (), [query.tiles_read(pos) for pos in found]))
        n = len(query.lookups)
        if query.ranges and _events_in(raw[n : n + len(query.ranges)]) > OFF_LOOP_EVENTS:
            response = await asyncio.to_thread(assemble, query, raw)
        else:
            response = assemble(query, raw)
        self._seal_in_background(query.seals)
        return response

    async def drain(self) -> None:
        """Wait for the tile summaries being stored in the background."""
        await asyncio.gather(*self._sealing, return_exceptions=True)

    def _reads(self, query: OnlineQuery) -> tuple[list, list, list]:
        query.known_heavy = {
            pos for pos, (key, _, _, limit) in enumerate(query.ranges) if limit is not None and key in self.heavy
        }
        return query.reads()

    def _found_heavy(self, query: OnlineQuery, raw: list) -> list[int]:
        found = query.found_heavy(raw)
        for pos in found:
            self.heavy.add(query.ranges[pos][0])
        return found

    def _seal_in_background(self, seals: list) -> None:
        if not seals or len(self._sealing) >= self.max_sealing:
            return
        task = asyncio.get_running_loop().create_task(self.store.seal_async(seals))
        self._sealing.add(task)
        task.add_done_callback(self._sealed)

    def _sealed(self, task: asyncio.Task) -> None:
        self._sealing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # summaries only save time: say so, go on
            log.debug("storing tile summaries failed: %s", task.exception())


def _events_in(replies: list) -> int:
    """Events in range replies: a plain one is its events, a heavy one ``[summaries, runs of events]``
    (a block counts its events)."""
    return sum(sum(map(packed.event_count, r[1])) if is_tiled(r) else packed.event_count(r) for r in replies)
