"""The entities a process's pushes wrote to aggregated views, kept until they are worth packing.

A push of a few events holds no tile whole, so it neither packs nor summarizes one (a write does
both for what it holds whole: ``online_write``). Left so, cards fed one event at a time would keep
every event as a plain member until ``featurestore compact``, and the first lookup of a heavy
one after each tile ends would summarize it. So pushes note the entities they wrote, per view and
tile of the wall clock, with how many events and from when. Once the tile after theirs has ended
too (for stragglers), an entity is due once it was written as many events as a block needs
(``least``) and as many as were packed for it in the current block (so a block is re-packed a
few times as it fills, each time about doubling, not once a tile: re-packing a block costs many
times an event's write, more as it grows), or once the block its events are in has ended (their
last packing). Its ended blocks, from the one holding the earliest event written on, are then
packed and summarized, one run at a time on this process's background thread, off the pushing
call (``FeatureStore.pack_pushed``). One not due yet is carried.

Held in memory and bounded: what is past the bound, noted by a process that stopped, or failed to
pack (an outage) is left to ``featurestore compact``, which finds it by scanning. Nothing depends
on it but memory and the first lookups' time: a plain event reads the same as a packed one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.aggregation.tiles import tile_us
from featurestore.definitions import FeatureView
from featurestore.online.packed import BLOCK_TILES

log = logging.getLogger(__name__)

NOTED_MOST = 200_000  # rows a process keeps to pack (an event each as noted, an entity each once merged)
# the columns beside an entity's keys: events written since it was last packed, the earliest of
# their times, the events packed for it in the block of the wall clock ``_BLOCK`` (-1: none)
_EVENTS, _SINCE, _PACKED, _BLOCK = "__events", "__since", "__packed", "__block"
_NONE_SINCE = 1 << 62
_MICROS = pa.timestamp("us", tz="UTC")


@dataclass
class _View:
    """What pushes wrote to one view: per tile of the wall clock, then carried."""

    tile_us: int
    tiles: dict[int, list[pa.Table]] = field(default_factory=dict)  # keys and the columns above, per push
    carried: pa.Table | None = None  # entities not due yet, and what was packed for those packed
    taken: int = -1  # the tile taken last


@dataclass(frozen=True)
class Due:
    """Entities of ``view`` to pack (their join-key columns), from the block holding ``since_us`` on (None: all)."""

    view: str
    keys: pa.Table
    since_us: int | None


class PushedEntities:
    """Notes what pushes wrote (``note``) and runs the packing of what is due (``pack_due``)."""

    def __init__(self, most: int = NOTED_MOST, clock: Callable[[], int] = lambda: time.time_ns() // 1000):
        self.most, self.clock = most, clock  # (µs of the wall clock)
        self._lock = threading.Lock()
        self._views: dict[str, _View] = {}
        self._rows = 0
        self._merged_to = 0  # rows left by the last merge at the bound
        self._dropped = 0  # entities given up since last said (once a minute at most)
        self._said_at = -60.0
        self._executor: ThreadPoolExecutor | None = None
        self._running: Future | None = None
        self._pid = os.getpid()

    def note(self, view: FeatureView, rows: pa.Table, time_column: str) -> None:
        """Remember the entities of ``rows`` (their join keys, events at ``time_column``) written to
        ``view`` online; an aggregated view's only (others store no tiles)."""
        if not view.is_aggregated or rows.num_rows == 0 or not set(view.join_keys) <= set(rows.column_names):
            return
        n = rows.num_rows
        try:  # (the rows are written: whatever noting them meets, the push stands)
            times = rows[time_column]
            if times.type != _MICROS:  # (a push's rows are typed already: a cast costs more than the rest)
                times = pc.cast(times, _MICROS)
            times = pa.chunked_array([chunk.view(pa.int64()) for chunk in times.chunks], pa.int64())
        except pa.ArrowException as exc:
            log.warning("cannot note what a push wrote to %s to pack it (%s): compact will", view.name, exc)
            return
        # a row an event, as written (its other columns made as it is merged per entity, off the
        # pushing call, or at the bound)
        written = pa.table([*(rows[k] for k in view.join_keys), times], names=[*view.join_keys, _SINCE])
        size = tile_us(view)
        self._after_fork()
        with self._lock:
            if self._rows + n > self.most and self._rows - self._merged_to >= self.most // 4:
                self._merge()  # (not again before a quarter of the bound is new: full of entities, it would each push)
            if self._rows + n > self.most:
                self._dropped += n
                return
            noted = self._views.setdefault(view.name, _View(size))
            noted.tile_us = size
            noted.tiles.setdefault(self.clock() // size, []).append(written)
            self._rows += n

    def take_due(self, least: int) -> list[Due]:
        """Take out, per view, the entities written a tile before the one that has just ended or
        earlier that are due; carry the others (and what was packed for those taken)."""
        now_us, taken = self.clock(), []
        self._after_fork()
        with self._lock:
            for name, noted in self._views.items():
                tile = now_us // noted.tile_us
                if not self._due(noted, tile):
                    continue
                parts = [t for ended in [t for t in noted.tiles if t + 2 <= tile] for t in noted.tiles.pop(ended)]
                parts += [noted.carried] if noted.carried is not None else []
                noted.carried, noted.taken = None, tile
                self._rows -= sum(t.num_rows for t in parts)
                self._merged_to = min(self._merged_to, self._rows)
                taken.append((name, noted, tile, parts))
        due = []
        for name, noted, tile, parts in taken:  # (merged outside the lock: pushes note meanwhile)
            written = _merged(parts)
            span = noted.tile_us * BLOCK_TILES
            block = (tile - 1) * noted.tile_us // span  # (of the tile that has just ended: those before ended)
            events, since = written[_EVENTS].to_numpy(), written[_SINCE].to_numpy()
            packed = np.where(written[_BLOCK].to_numpy() == block, written[_PACKED].to_numpy(), 0)
            ready = (events > 0) & ((events >= np.maximum(least, packed)) | (since // span < block))
            keys = written.drop_columns([_EVENTS, _SINCE, _PACKED, _BLOCK])
            after = {  # (an entity packed now carries no events, and what was packed for it)
                _EVENTS: np.where(ready, 0, events),
                _SINCE: np.where(ready, _NONE_SINCE, since),
                _PACKED: np.where(ready, packed + events, packed),
                _BLOCK: np.full(len(events), block, np.int64),
            }
            carried = pa.Table.from_arrays(
                [*keys.columns, *(pa.array(a) for a in after.values())], [*keys.column_names, *after]
            ).filter(pa.array((after[_EVENTS] > 0) | (after[_PACKED] > 0)))
            with self._lock:
                noted.carried = carried if carried.num_rows else None
                self._rows += carried.num_rows
            for first in np.unique(since[ready] // span).tolist():  # (each entity read from its own block on)
                group = ready & (since // span == first)
                due.append(Due(name, keys.filter(pa.array(group)), first * span))
        return due

    def any_due(self) -> bool:
        """Whether a run would find entities to look at (cheap: no merging, no store)."""
        now_us = self.clock()
        self._after_fork()
        with self._lock:
            return self._any_due(now_us)

    def pack_due(self, pack: Callable[[Due], object], least: int) -> None:
        """Take the due entities (``take_due``) and run ``pack`` on each view's, on this process's
        background thread, unless a run is still going (what is due then waits for the next call)."""
        now_us = self.clock()
        self._after_fork()
        with self._lock:
            if self._running is not None and not self._running.done():
                return
            dropped = self._dropped if time.monotonic() - self._said_at >= 60 else 0
            if dropped:
                self._dropped, self._said_at = 0, time.monotonic()
            if self._any_due(now_us):
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featurestore-pack")
                self._running = self._executor.submit(self._pack_taken, pack, least)
        if dropped:
            log.warning(
                "pushes wrote more entities than the %d kept to pack: %d left to `featurestore compact`",
                self.most,
                dropped,
            )

    def _pack_taken(self, pack: Callable[[Due], object], least: int) -> None:
        """``pack`` each view's due entities; a failure is said, not raised: packing only saves memory
        and lookup time, and ``featurestore compact`` does it later."""
        try:
            due = self.take_due(least)
        except Exception:
            log.warning("taking what pushes wrote to pack failed; `featurestore compact` packs it", exc_info=True)
            return
        for one in due:
            try:
                pack(one)
            except Exception as exc:
                log.warning(
                    "packing what pushes wrote to %s failed (%s); `featurestore compact` packs it", one.view, exc
                )

    def _after_fork(self) -> None:
        """In a forked child, drop what belonged to its parent's threads: the run in flight (it
        never ends here) and the lock (a parent's thread may have held it at the fork)."""
        if self._pid != os.getpid():
            self._lock, self._executor, self._running, self._pid = threading.Lock(), None, None, os.getpid()

    def _any_due(self, now_us: int) -> bool:
        return any(self._due(noted, now_us // noted.tile_us) for noted in self._views.values())

    @staticmethod
    def _due(noted: _View, tile: int) -> bool:
        """Whether a tile of ``noted`` has ended a tile ago, or it carries entities not looked at this tile."""
        return any(t + 2 <= tile for t in noted.tiles) or (noted.carried is not None and tile != noted.taken)

    def wait(self) -> None:
        """Until the run in flight, if any, has ended."""
        self._after_fork()
        running = self._running
        if running is not None:
            running.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _merge(self) -> None:
        """Merge each tile's notes of an entity into one row, and forget what was packed for
        entities written nothing since: the bound is for what is still to pack."""
        for name, noted in self._views.items():
            for tile, parts in list(noted.tiles.items()):
                rows = sum(t.num_rows for t in parts)
                try:
                    noted.tiles[tile] = [_merged(parts)]
                except pa.ArrowException as exc:  # (keys Arrow cannot group: left to compact)
                    log.warning("cannot merge what pushes wrote to %s to pack it (%s): compact will", name, exc)
                    del noted.tiles[tile]
                self._rows -= rows - sum(t.num_rows for t in noted.tiles.get(tile, []))
            if noted.carried is not None:
                kept = noted.carried.filter(pc.greater(noted.carried[_EVENTS], 0))
                self._rows -= noted.carried.num_rows - kept.num_rows
                noted.carried = kept if kept.num_rows else None
        self._merged_to = self._rows


def _counted(part: pa.Table) -> pa.Table:
    """A part as merged: a push's notes (keys and times) an event each, nothing packed."""
    if _EVENTS in part.column_names:
        return part
    n, keys = part.num_rows, [k for k in part.column_names if k != _SINCE]
    return pa.table(
        {
            **{k: part[k] for k in keys},
            _EVENTS: np.ones(n, np.int64),
            _SINCE: part[_SINCE],
            _PACKED: np.zeros(n, np.int64),
            _BLOCK: np.full(n, -1, np.int64),
        }
    )


def _merged(parts: list[pa.Table]) -> pa.Table:
    """One row an entity: its events and what was packed added, the earliest time and latest block kept."""
    # (promoted: a push's and a view write's key types)
    table = pa.concat_tables(map(_counted, parts), promote_options="permissive")
    keys = [c for c in table.column_names if c not in (_EVENTS, _SINCE, _PACKED, _BLOCK)]
    aggregations = [(_EVENTS, "sum"), (_SINCE, "min"), (_PACKED, "sum"), (_BLOCK, "max")]
    merged = table.group_by(keys, use_threads=False).aggregate(aggregations)
    return merged.rename_columns([*keys, _EVENTS, _SINCE, _PACKED, _BLOCK])
