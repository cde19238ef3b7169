"""History rows sent online: each entity's latest row, or for an aggregated view its events."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache

import pyarrow as pa

from featurestore.aggregation import dedup_us, tiles
from featurestore.definitions import FeatureView
from featurestore.materialization.compute import events_to_add, latest_per_entity, max_micros
from featurestore.online.base import OnlineWrites, Sealer
from featurestore.online.codec import datetime_to_micros, event_columns, make_events_decoder
from featurestore.registry import Definitions
from featurestore.registry.layout import ViewLayout


def key_expiry(defs: Definitions, view: FeatureView) -> timedelta | None:
    """How long a write of ``view`` may let its entity keys live (with ``online_store.expire_after_ttl``).

    All views keyed by the same join keys share one Redis hash, so the key may expire only if
    every one of them has a ttl; it then lives until the longest of them runs out."""
    sharing = [v for v in defs.feature_views.values() if v.online and sorted(v.join_keys) == sorted(view.join_keys)]
    ttls = [v.ttl for v in sharing]
    if any(t is None for t in ttls):
        return None
    return max(t for t in ttls if t is not None)


def write_online(
    online: OnlineWrites,
    view: FeatureView,
    layout: ViewLayout,
    rows: pa.Table,
    now: datetime,
    *,
    event_retention: timedelta = timedelta(0),
    expire_after: timedelta | None = None,
    whole_history: bool = False,
) -> int:
    """Send history rows to ``online`` under the view's ``layout``; returns the rows (or events) written.

    An aggregated view keeps its events of the longest window plus ``event_retention`` before
    ``now``, and the ended tiles the rows hold in full are summarized as they are written (so no
    lookup pays for it: ``aggregation.tiles``); ``whole_history``: ``rows`` are all of the view's
    history, whose verdicts on duplicate event ids the store then takes over its own. ``expire_after``: entity keys expire once their
    newest data is that old (views sharing the keys must all allow it: the caller's decision)."""
    if rows.num_rows == 0:
        return 0
    newest = (view.name, max_micros(rows["event_timestamp"]))  # per-view freshness
    if view.is_aggregated:
        horizon = view.longest_window + event_retention
        cutoff_us = datetime_to_micros(now - horizon)
        # Rows before the cutoff are sent from a bound by this machine's clock: Redis records that
        # the entity lacks them (a replay's lookup refuses windows reaching them), while those
        # older than every key kept are beyond what any replay reads (``OnlineQuery.require_retained``),
        # even when ``now`` runs ahead (a later end) or Redis's clock runs behind (by less than 1/16).
        sent_from_us = min(cutoff_us, time.time_ns() // 1000 - (horizon + horizon / 16) // timedelta(microseconds=1))
        writes = events_to_add(rows, view, sent_from_us, verdicts=whole_history)
        return online.write_events(
            layout.online_field,
            writes.rows,
            view.join_keys,
            event_columns(view),
            writes.ids,
            cutoff_us,
            horizon,
            tiles.tile_us(view),
            dedup_us(view),
            accepted=writes.accepted,
            newest=newest,
            sealer=sealer(view, layout.storage_id),
        )
    latest = latest_per_entity(rows, view.join_keys)
    stored = [(f.name, f.dtype) for f in view.schema]
    online.write_latest(layout.online_field, latest, view.join_keys, stored, expire_after, newest)
    return latest.num_rows


def sealer(view: FeatureView, storage_id: str) -> Sealer | None:
    """Summaries of the view's tiles as a lookup computes them from the stored events (None:
    nothing tiled), for writes and for ``featurestore compact``."""
    built = _summarizer(view, storage_id)
    # (a tile lighter than half the heavy threshold is mostly a light entity's, which reads events, not summaries)
    least = max(tiles.SEAL_FROM, tiles.HEAVY_PER_TILE // 2)
    return Sealer(least, *built) if built is not None else None


@lru_cache(maxsize=256)  # (building one costs more than a small push)
def _summarizer(
    view: FeatureView, storage_id: str
) -> tuple[Callable[[list[bytes]], list[tuple[int, int, bytes]]], bytes] | None:
    """The view's summarizer and its summaries' tag (None: nothing tiled)."""
    spec = tiles.TileSpec.of(view, storage_id)
    if spec is None:
        return None
    tiled = tiles.TiledEvaluator(view, spec)
    decode = make_events_decoder(event_columns(view), tiled.needed)

    def summarize(members: list[bytes]) -> list[tuple[int, int, bytes]]:
        times, columns = decode(members, -(1 << 62), 1 << 62)
        return tiles.seals(tiled, times, columns, set(), time.time_ns() // 1000, most=len(times))

    return summarize, spec.tag
