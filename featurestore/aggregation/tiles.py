"""Tile summaries: a heavy entity's lookup merges sealed summaries instead of reading every event.

Online, an aggregated view's events are grouped in tiles of ``tile_us`` (``TileSpec``). Once a
tile has ended and holds ``SEAL_FROM`` events or more, the lookup that read it event by event
stores its summary (``seals``; so does the write that holds all of a tile's events,
``materialization.online_write``): per tiled aggregation of the view, the events passing the
filter, the non-null values among them and a mergeable state. An entity with
``HEAVY_PER_TILE`` events per tile of its longest window or more then reads the summaries of
the tiles wholly inside the window, the events of the others (those holding a window's start
or the lookup time, and tiles not sealed yet), and merges both in time order
(``evaluate_tiled``): its reads no longer grow with its events. An event added to an ended
tile drops the tile's summary (``online/scripts/add_events.lua``).

Exact, not approximate: merged states give what the events give (``WindowEvaluator``). Counts,
min, max and last merge exactly, integer sums too. A float sum or mean keeps each tile's
Shewchuk partials (non-overlapping floats whose sum is exactly the tile's), so ``math.fsum``
over the partials and the remaining values rounds the same exact sum: the same bits. A tile
with a value that is not finite, or whose sum leaves the float range, is not sealed. Functions
whose state grows with the events (``count_distinct``, ``last_n``, ``variance``, ``stddev``) and
columns other than numbers and strings are not tiled: a lookup asking for one reads events.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import orjson

from featurestore.aggregation.evaluate import NOT_FOUND, NULL_VALUE, PRESENT, WindowEvaluator, checked, pick
from featurestore.aggregation.functions import FUNCTIONS, Mergeable, Unsealable
from featurestore.decoded_cache import DecodedCache
from featurestore.definitions import Aggregation, FeatureView, content_hash

TILED_TYPES = frozenset({"Int32", "Int64", "Float32", "Float64", "Bool", "String"})
SUMMARY_FORMAT = 2  # how a tile's summary is stored (``encode``, the functions' states); in its tag (a test pins it)
SEAL_FROM = 8  # events a tile needs before a summary pays for itself
HEAVY_PER_TILE = 24  # events per tile of the longest window before a lookup reads summaries (its break-even)
SEALS_PER_LOOKUP = 64  # tiles one lookup summarizes (~1 µs per event each): the rest, the next lookups
TILES_PER_WINDOW = 64  # about how many tiles the longest window spans, at least
DECODED_SUMMARY_BYTES = 64 << 20  # what a process's decoded summaries may hold
_TILE_SIZES_US = [s * 1_000_000 for s in (1, 10, 60, 300, 900, 3600, 6 * 3600, 86400)]

State = list  # [events passing the filter, non-null values, payload]


def tile_us(view: FeatureView) -> int:
    """The view's tile size: the largest of 1 s, 10 s, 1 min, 5 min, 15 min, 1 h, 6 h, 1 d with
    ``TILES_PER_WINDOW`` tiles in the longest window."""
    longest = view.longest_window // timedelta(microseconds=1)
    return max([size for size in _TILE_SIZES_US if size * TILES_PER_WINDOW <= longest] or [_TILE_SIZES_US[0]])


@dataclass(frozen=True)
class TileSpec:
    """How a view's tiles are summarized: the tile size and the aggregations a summary holds."""

    tile_us: int
    aggregations: tuple[Aggregation, ...]
    tag: bytes  # starts every summary: one written for other aggregations or another layout is not read

    @classmethod
    def of(cls, view: FeatureView, storage_id: str) -> TileSpec | None:
        """The tiles of the view's mergeable aggregations, for its online layout ``storage_id``."""
        stored = {f.name: f.dtype.name for f in view.schema}
        tiled = tuple(
            a
            for a in view.aggregations
            if isinstance(FUNCTIONS[a.function], Mergeable) and (a.column is None or stored[a.column] in TILED_TYPES)
        )
        if not tiled:
            return None
        size = tile_us(view)
        layout = content_hash(
            {
                "storage": storage_id,
                "tile_us": size,
                "aggregations": [a.to_spec() for a in tiled],
                "summary": SUMMARY_FORMAT,
            }
        )
        return cls(size, tiled, b"T" + layout[:12].encode() + b":")

    def covers(self, aggregations: Sequence[Aggregation]) -> bool:
        return all(a in self.aggregations for a in aggregations)


class TiledEvaluator:
    """States of a view's tiled aggregations over events, their merge in time order, and the
    values they give (each equal to ``WindowEvaluator``'s over the same events)."""

    def __init__(self, view: FeatureView, spec: TileSpec):
        self.spec = spec
        self.events = WindowEvaluator(view, spec.aggregations)  # columns, filters, empty values
        stored = {f.name: f.dtype.name for f in view.schema}
        self.functions: list[Mergeable] = [FUNCTIONS[a.function] for a in spec.aggregations]  # type: ignore[misc]
        self.floats = [a.column is not None and stored[a.column] in ("Float32", "Float64") for a in spec.aggregations]
        self.needed = self.events.needed

    def states(
        self, columns: dict[int, list[Any]], start: int, end: int, compact: bool, indexes: Sequence[int] | None = None
    ) -> list[State] | None:
        """The state of each aggregation (or those at ``indexes``) over events ``start:end`` of
        ``columns``. ``compact``: as a summary stores it (None if one cannot be exact), else as
        cheap to build as may be. Aggregations of one state kind over one column and filter (a sum
        and a mean, several windows) share the picking and the state."""
        ev = self.events
        out: list[State] = []
        picks: dict[tuple, tuple[int, list[Any] | None]] = {}
        payloads: dict[tuple, Any] = {}
        for k in range(len(self.spec.aggregations)) if indexes is None else indexes:
            agg, function = self.spec.aggregations[k], self.functions[k]
            source = (ev.columns[k], repr(agg.where))
            if source not in picks:
                picks[source] = pick(columns, ev.columns[k], ev.filters[k], start, end)
            count, picked = picks[source]
            if picked is None:
                out.append([count, count, None])
                continue
            if picked and (source, function.state_kind) not in payloads:
                try:
                    payloads[(source, function.state_kind)] = function.state(picked, self.floats[k], compact)
                except Unsealable:
                    return None
            out.append([count, len(picked), payloads[(source, function.state_kind)] if picked else None])
        return out

    def finish(self, index: int, states: list[State]) -> tuple[Any, str]:
        """The value and status of aggregation ``index`` from its states, oldest first."""
        agg, empty = self.spec.aggregations[index], self.events.empty[index]
        events, values = sum(s[0] for s in states), sum(s[1] for s in states)
        if not events:
            return empty, NOT_FOUND
        if not values:
            return empty, NULL_VALUE if empty is None else PRESENT
        payloads = [s[2] for s in states if s[1]]
        value = checked(self.functions[index].merge(payloads, values, self.floats[index]), self.events.view, agg)
        return value, NULL_VALUE if value is None else PRESENT

    def encode(self, newest_us: int, states: list[State]) -> bytes | None:
        """A summary: the tag, then JSON ``[newest event µs, states]`` (orjson: floats round-trip
        exactly, and decoding is ~5x the standard library's, which a heavy lookup's 150+ summaries
        feel). A state equal to an earlier one (one function over several windows, a sum and a
        mean) is stored as that one's index. None when JSON cannot carry it exactly: a non-finite
        float, an integer past 64 bits."""
        if any(isinstance(s[2], float) and not math.isfinite(s[2]) for s in states):
            return None
        first: dict[bytes, int] = {}
        stored: list[State | int] = []
        try:
            for k, state in enumerate(states):
                text = orjson.dumps(state)
                if text in first:
                    stored.append(first[text])
                else:
                    first[text] = k
                    stored.append(state)
            return self.spec.tag + orjson.dumps([newest_us, stored])
        except TypeError:  # an integer sum past 64 bits
            return None

    def decode(self, summaries: Sequence[bytes]) -> list[tuple[int, list[State]]]:
        """Each summary's newest µs and states, shared with the other lookups that read it (never changed)."""
        tag_length = len(self.spec.tag)
        return decoded_summaries.get_many([(summary, tag_length) for summary in summaries])


def _decode_summaries(keys: list[tuple[bytes, int]]) -> list[tuple[int, list[State]]]:
    """Summaries (with their tags' lengths) decoded together, as one JSON array of their bodies: a
    heavy card's first lookup decodes one a tile of its window, and one parse costs less than many."""
    decoded = orjson.loads(b"[" + b",".join([memoryview(summary)[tag:] for summary, tag in keys]) + b"]")
    if len(decoded) != len(keys):
        raise ValueError("a malformed tile summary")
    return [(newest_us, [s if type(s) is list else stored[s] for s in stored]) for newest_us, stored in decoded]


# the summaries a process decoded last: a sealed tile's summary never changes, and decoding a heavy
# card's (one a tile of its window) was a quarter of its lookup (``benchmarks/aggregations.py``);
# decoded, one takes ~6 times its JSON's bytes in lists and numbers
decoded_summaries: DecodedCache[tuple[bytes, int], tuple[int, list[State]]] = DecodedCache(
    _decode_summaries, lambda key, _: 8 * len(key[0]) + 100, DECODED_SUMMARY_BYTES
)


def evaluate_tiled(
    tiled: TiledEvaluator,
    wanted: Sequence[int],
    windows_us: Sequence[int],
    summaries: dict[int, list[State]],
    times: list[int],
    columns: dict[int, list[Any]],
    now_us: int,
) -> tuple[list[Any], list[str]]:
    """Values and statuses at ``now_us`` of the aggregations ``wanted`` (indexes into the spec),
    from sealed ``summaries`` ({tile: states}) and the events of the other tiles (``times``
    ascending, ``columns`` as ``WindowEvaluator.evaluate`` takes them)."""
    size = tiled.spec.tile_us
    sealed = sorted(summaries)
    # the events between two sealed tiles are one chunk: cut where the count of sealed tiles before an event changes
    before = np.searchsorted(np.array(sealed, dtype=np.int64), np.array(times, dtype=np.int64) // size, side="right")
    cuts = [0, *(np.flatnonzero(np.diff(before)) + 1).tolist(), len(times)]
    runs = [(int(before[a]), a, b) for a, b in zip(cuts, cuts[1:]) if a < b]  # (sealed tiles before it, start, end)
    cache: dict[tuple[int, int], list[State]] = {}
    values, statuses = [], []
    for slot, (index, window) in enumerate(zip(wanted, windows_us)):
        first_us = now_us - window + 1
        first_tile = bisect.bisect_left(sealed, -(-first_us // size))  # the sealed tiles wholly in the window
        chunks = [(2 * i + 1, summaries[sealed[i]][index]) for i in range(first_tile, len(sealed))]
        for position, start, end in runs:
            lo = bisect.bisect_left(times, first_us, start, end)
            hi = bisect.bisect_right(times, now_us, start, end)
            if lo < hi:
                if (lo, hi) not in cache:  # (not compact: never None)
                    cache[(lo, hi)] = tiled.states(columns, lo, hi, compact=False, indexes=wanted) or []
                chunks.append((2 * position, cache[(lo, hi)][slot]))
        chunks.sort(key=lambda c: c[0])  # time order: a run before the sealed tile after it
        value, status = tiled.finish(index, [c[1] for c in chunks])
        values.append(value)
        statuses.append(status)
    return values, statuses


def seals(
    tiled: TiledEvaluator,
    times: list[int],
    columns: dict[int, list[Any]],
    cut: set[int],
    now_us: int,
    most: int | None = None,
) -> list[tuple[int, int, bytes]]:
    """Summaries worth storing, ``(tile, events, summary)``: of the ended tiles read event by
    event in full (holding no cut), those with ``SEAL_FROM`` events or more, at most ``most``
    (a lookup's default: ``SEALS_PER_LOOKUP``; a writer's work is bounded by its batch)."""
    size, start = tiled.spec.tile_us, 0
    most = SEALS_PER_LOOKUP if most is None else most
    out: list[tuple[int, int, bytes]] = []
    while start < len(times) and len(out) < most:
        tile = times[start] // size
        end = bisect.bisect_left(times, (tile + 1) * size, start)
        if end - start >= SEAL_FROM and tile not in cut and (tile + 1) * size <= now_us:
            states = tiled.states(columns, start, end, compact=True)
            summary = tiled.encode(times[end - 1], states) if states is not None else None
            if summary is not None:
                out.append((tile, end - start, summary))
        start = end
    return out
