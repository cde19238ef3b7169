"""The interface an online store implements. A second backend is a new file beside redis_store.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

if TYPE_CHECKING:
    from featurestore.config import RepoConfig
    from featurestore.online.redis_store import RedisOnlineStore

# One lookup: an entity key and the view fields wanted from it.
Lookup = tuple[bytes, Sequence[str]]
# One entity's window: its events key, the event-time bounds in µs (low exclusive, high inclusive)
# and the most events to read (None: all).
Range = tuple[bytes, int, int, "int | None"]
# A heavy entity's window, read from tile summaries: its events key and ``READ_WINDOW``'s arguments.
TiledRange = tuple[bytes, Sequence[bytes | int]]
# Tile summaries to store for an events key: (key, tile µs, [(tile, events, summary)]).
Seal = tuple[bytes, int, Sequence[tuple[int, int, bytes]]]


class OnlineStore(Protocol):
    def write_latest(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        expire_after: timedelta | None = None,
    ) -> int:
        """Store each entity's row unless a stored one is newer (event, created, run, row id);
        with ``expire_after``, drop the entity's key once its newest data is that old."""

    def write_events(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        event_ids,
        cutoff_us: int,
        horizon: timedelta,
        tile_us: int,
    ) -> int:
        """Add each event to its entity's window state once per event id (ignoring events before ``cutoff_us``)."""

    def read(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        """One round trip: for each lookup, the encoded value of each wanted view (None if absent);
        then for each range, the encoded events in it, in (time, id) order."""

    def read_tiles(self, windows: Sequence[TiledRange]) -> list:
        """For each heavy entity's window, ``[tile summaries, events of the other tiles]``."""

    async def read_tiles_async(self, windows: Sequence[TiledRange]) -> list: ...

    def seal(self, seals: Sequence[Seal]) -> None:
        """Store tile summaries a lookup computed."""

    async def seal_async(self, seals: Sequence[Seal]) -> None: ...

    async def read_async(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        """``read`` for async servers."""

    def publish(self, channel: bytes, message: str) -> None:
        """Broadcast a message to subscribed servers."""

    def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Async stream of messages on a channel."""

    def drop_view(self, view: str) -> None: ...

    def close(self) -> None: ...


def open_online_store(config: RepoConfig) -> RedisOnlineStore:
    """The online store a repo's config names: Redis (embedded or a URL), or Redis Cluster."""
    from featurestore.online.redis_cluster import SCHEME, RedisClusterOnlineStore
    from featurestore.online.redis_store import RedisOnlineStore

    if config.online_url.startswith(SCHEME):
        return RedisClusterOnlineStore(
            config.online_url, config.project, config.read_timeout_ms, config.read_from_replicas
        )
    return RedisOnlineStore.from_config(config)
