"""What callers need of an online store, as small protocols, and how one is opened.

Each caller is typed against the capability it uses: materialization writes latest values and
events (``OnlineWrites``), retrieval reads them (``OnlineReads``), the servers also watch
freshness and health and hear model promotions (``OnlineStore``, all of them). A second backend
is a new module implementing these, not an ``if`` in its callers; the parametrized store suite
(``tests/test_online_store.py``) runs every contract test on each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from featurestore.definitions import content_hash
from featurestore.errors import OnlineStoreUnavailable

if TYPE_CHECKING:
    from featurestore.definitions import FeatureView
    from featurestore.online.transport import Transport

# One lookup: an entity key and the view fields wanted from it.
Lookup = tuple[bytes, Sequence[str]]
# One entity's window: its events key, the event-time bounds in µs (low exclusive, high inclusive)
# and the most events to read (None: all).
Range = tuple[bytes, int, "int | float", "int | None"]
# A heavy entity's window, read from tile summaries: its events key and ``read_window.lua``'s arguments.
TiledRange = tuple[bytes, Sequence[bytes | int]]
# The hash holding an events key's tile summaries (``aggregation.tiles``): tile number -> summary.
SUMMARIES_SUFFIX = b"|tiles"
# An events key's member scored +inf, its ledger, starts with the newest µs of an event the entity
# lacks (not kept, being before the cutoff, or trimmed since: ``add_events.lua``), 8 bytes
# sign-flipped big-endian; a range from LACKED_FROM (above every event's µs) to ``math.inf`` reads it.
LACKED_FROM = 1 << 62
EVENT_SCORES = ("-inf", "(inf")  # ZRANGEBYSCORE's bounds reading an events key's events (and blocks) only
# The project's hashes beside its entities' keys (under its key prefix): each view's newest event
# time written; its sync token (an emptied or replaced Redis lacks it); the horizons each aggregated
# view's events are held under (events field -> "horizon ms:until ms" pairs: ``keep_horizon.lua``).
NEWEST, SYNC_TOKENS, HORIZONS = b"newest", b"synced", b"horizons"
PROJECT_HASHES = (NEWEST, SYNC_TOKENS, HORIZONS)
# Tile summaries to store for an events key: (key, tile µs, [(tile, events, summary)]).
Seal = tuple[bytes, int, Sequence[tuple[int, int, bytes]]]


class Compacted(NamedTuple):
    """What packing a view's online events did (``featurestore compact``)."""

    blocks: int  # blocks packed (or packed again)
    events: int  # the events they hold
    summaries: int  # tile summaries stored for tiles no writer sealed (events streamed one by one)


@dataclass(frozen=True)
class Sealer:
    """How a writer summarizes the ended tiles it writes in full (``aggregation.tiles``), so that no
    lookup pays for it: ``summarize`` takes one entity's events (members in (time, id) order) of
    tiles holding ``least`` of them or more, and returns ``(tile, events, summary)`` for those worth
    storing; each summary starts with ``tag`` (one stored with another tag, as a change to the
    view's aggregations leaves them, is not read: its tile has no summary)."""

    least: int
    summarize: Callable[[list[bytes]], list[tuple[int, int, bytes]]]
    tag: bytes


KEY_ENCODING = 2  # how entity keys are written online (featurestore.online.codec.key_text); in every layout id
EVENTS_LAYOUT = 11  # how an aggregated view's events are kept online (featurestore.online.codec); in its layout id
# (tests/test_aggregations.py pins it to the code that writes it: change one, change the other)

EMBEDDED = "embedded"
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")  # (the second: TLS)
SENTINEL_SCHEME = "redis+sentinel://"


def layout_id(view: FeatureView, version: int) -> str:
    """Hash of how a view version's rows are stored online (keys, key types, columns and types,
    event id, version): values are written under ``online_field`` (name + this id), so bytes
    written under another layout are never decoded as this one; they read as NOT_FOUND until
    re-materialized."""
    return content_hash(
        {
            "keys": [e.to_spec()["key_types"] for e in view.entities],
            "join_keys": view.join_keys,
            "schema": [f.to_spec() for f in view.schema],
            "event_id": view.event_id,
            "key_encoding": KEY_ENCODING,
            **({"version": version} if version > 1 else {}),
            # the longest window bounds what Redis keeps and how far apart two writes of an event id are duplicates
            # (a dedup window, where set to another, the latter)
            **(
                {"events": EVENTS_LAYOUT, "longest_us": view.longest_window // timedelta(microseconds=1)}
                if view.aggregations
                else {}
            ),
            **({"dedup_us": view.own_dedup_window // timedelta(microseconds=1)} if view.own_dedup_window else {}),
        }
    )[:8]


def online_field(view: str, storage_id: str) -> str:
    return f"{view}#{storage_id}"


@dataclass(frozen=True)
class OnlineStoreSettings:
    """Where the online store is and how it is read: ``url`` is ``embedded`` (a redis-server under
    ``data_dir``), ``redis://`` / ``rediss://``, ``redis+cluster://h:p,h:p`` (``rediss+cluster://``: TLS),
    or ``redis+sentinel://h:p,h:p/service``."""

    project: str
    url: str = EMBEDDED
    data_dir: Path = Path("data")
    read_timeout_ms: int = 500  # past it a server's lookup answers 503: an outage never hangs it
    read_from_replicas: bool = False  # Redis Cluster or Sentinel: lookups may read replicas (may lag their master)
    wait_for_replicas: int = 0  # writes return once this many replicas have them (WAIT), else fail
    wait_timeout_ms: int = 1000


class OnlineWrites(Protocol):
    def write_latest(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        expire_after: timedelta | None = None,
        newest: tuple[str, int] | None = None,
    ) -> int:
        """Store each entity's row unless a stored one is newer (event, created, run, row id); with
        ``expire_after``, drop the entity's key once its newest data is that old; ``newest``: the
        view's newest event time (µs) for freshness. Returns the rows written."""
        ...

    def write_events(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        event_ids: np.ndarray,
        cutoff_us: int,
        horizon: timedelta,
        tile_us: int,
        dedup_us: int,
        accepted: np.ndarray | None = None,
        newest: tuple[str, int] | None = None,
        sealer: Sealer | None = None,
    ) -> int:
        """Add each event to its entity's window state once per event id (the rule of
        ``featurestore.aggregation``, or the history's verdicts in ``accepted``); with ``sealer``,
        store the summaries of ended tiles the write holds in full; pack the ended blocks it holds
        in full (``online.packed``). Returns the events added."""
        ...

    def pack_ended(
        self,
        view: str,
        features: Sequence,
        tile_us: int,
        progress: Callable[[int], None] | None = None,
        sealer: Sealer | None = None,
    ) -> Compacted:
        """Pack every entity's ended blocks that hold plain events; with ``sealer``, also store the
        summaries of the ended tiles no writer sealed."""
        ...

    def pack_entities(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        tile_us: int,
        sealer: Sealer | None,
        since_us: int | None = None,
    ) -> Compacted:
        """``pack_ended`` for the entities of ``rows`` only; with ``since_us``, for their blocks
        from the one holding that time on (what was written since)."""
        ...

    def pack_from(self) -> int:
        """Events a block needs on this store (fewer stay plain)."""
        ...

    def first_use(self, key: str, fingerprint: str, now_us: int, keep_seconds: int) -> tuple[int, str]:
        """Record ``(now_us, fingerprint)`` under an idempotency key unless already there; return what is recorded."""
        ...

    def sync_token(self, view: str) -> str | None:
        """The token ``set_sync_token`` last left for ``view`` in this store; None if none (a new,
        emptied or replaced store)."""
        ...

    def set_sync_token(self, view: str, token: str) -> None:
        """Leave ``token`` for ``view``: the registry records it too once a write made this store
        hold the view's whole history, and a later write sends the whole history again unless
        this store still has it."""
        ...


class OnlineReads(Protocol):
    def read(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range] = (),
        windows: Sequence[TiledRange] = (),
        summaries: Sequence[bytes] = (),
    ) -> list:
        """One round trip: for each lookup, the encoded value of each wanted view (None if absent);
        then for each range, the encoded events in it, in (time, id) order; then for each heavy
        entity's window, ``[tile summaries, events of the other tiles]``; then for each events key
        in ``summaries``, its tile summaries (its hash, as HGETALL replies)."""
        ...

    async def read_async(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range] = (),
        windows: Sequence[TiledRange] = (),
        summaries: Sequence[bytes] = (),
    ) -> list: ...

    def seal(self, seals: Sequence[Seal]) -> None:
        """Store tile summaries a lookup computed."""
        ...

    async def seal_async(self, seals: Sequence[Seal]) -> None: ...


class OnlineStore(OnlineWrites, OnlineReads, Protocol):
    """Everything the façade and the servers use: writes, reads, freshness, health, broadcast."""

    project: str

    @property
    def url(self) -> str: ...

    @property
    def client(self) -> Any:
        """redis-py's client, for plain commands (streams, inspection)."""
        ...

    def newest(self) -> dict[str, int]:
        """``{view: newest event time written online, µs since the epoch}``."""
        ...

    async def newest_async(self) -> dict[str, int]: ...

    def ping(self) -> bool: ...

    async def ping_async(self) -> bool: ...

    def eviction_policy(self) -> str | None:
        """How this store deletes keys once full (Redis's ``maxmemory-policy`` with ``maxmemory``
        set, other than ``noeviction``); None if it never does, or cannot say."""
        ...

    def publish(self, channel: bytes, message: str) -> None:
        """Broadcast to every subscribed server."""
        ...

    def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``, as they come; raises when the store goes away."""
        ...

    def drop_view(self, view: str, keep: str | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Delete every stored layout of the view, or every one but the online field ``keep``
        (what earlier versions or definitions left); returns how many keys and fields went.
        ``progress`` is told of each batch of keys scanned."""
        ...

    def unavailable(self, exc: BaseException) -> OnlineStoreUnavailable:
        """The store's error for a failed call of its client (a 503 on the servers)."""
        ...

    def close(self) -> None: ...


def open_online_store(settings: OnlineStoreSettings) -> OnlineStore:
    """The online store the settings name: Redis over one node (embedded, a URL, or the master
    Sentinel names), or over a cluster."""
    from featurestore.online.redis_store import RedisOnlineStore

    return RedisOnlineStore(_transport(settings), settings.project)


def _transport(settings: OnlineStoreSettings) -> Transport:
    from featurestore.online.transport import ReplicaWait

    wait = ReplicaWait(settings.wait_for_replicas, settings.wait_timeout_ms) if settings.wait_for_replicas else None
    if settings.url.startswith(CLUSTER_SCHEMES):
        from featurestore.online.redis_cluster import ClusterRedis

        return ClusterRedis(settings.url, settings.read_timeout_ms, settings.read_from_replicas, wait)
    from featurestore.online.embedded import EmbeddedRedis
    from featurestore.online.redis_single import SingleRedis

    if settings.url.startswith(SENTINEL_SCHEME):
        from featurestore.online import redis_sentinel

        return SingleRedis(
            settings.url,
            settings.read_timeout_ms,
            clients=redis_sentinel.sentinel_clients(settings.url),
            password_form=redis_sentinel.FORM,
            replica_wait=wait,
            read_from_replicas=settings.read_from_replicas,
        )
    embedded = EmbeddedRedis(settings.data_dir) if settings.url == EMBEDDED else None
    url = embedded.ensure_running() if embedded is not None else settings.url
    return SingleRedis(url, settings.read_timeout_ms, embedded, replica_wait=wait)
