"""Consume a ``StreamSource``'s Redis Stream into both stores.

At least once, nothing lost: entries are read through a consumer group, pushed (history and
Redis, the same path as ``FeatureStore.push``) and only then acknowledged. Entries a consumer
took and never acknowledged (it was killed, whatever its name) are claimed by a live consumer
once idle for ``claim_idle_ms`` (``XAUTOCLAIM``), and a consumer first re-reads its own pending
ones. Pushing an entry twice changes nothing: each row's ingest time and push id come from its
entry id, so a redelivered entry is the same row everywhere (the push log included).

Consumed entries do not stay in Redis: every few seconds (and as a run ends) the consumer trims
the stream of the entries every consumer group of it has acknowledged (``XTRIM MINID``), so its
memory is what is still to be read; a stream named by the source (``StreamSource(stream=...)``)
is its owner's to bound and is left as it is. The dead-letter stream keeps its newest
``DEAD_LETTERS_KEPT`` entries.

Entries map column names to text (``XADD s * card_id 17 amount 12.5 event_timestamp
2024-05-01T10:00:00Z``). An entry that does not fit the source's schema goes to the dead-letter
stream ``<stream>:dead`` with the reason, and is acknowledged: one bad entry never blocks the rest.

Entries come a few at a time, so no push holds a tile of an aggregated view whole and none
summarizes it: the tiles of the entities written are packed and summarized once they have ended
(one tile later, for stragglers), as for every push (``FeatureStore.pack_pushed``, which the
consumer's loop also calls, so a tile ending while the stream is quiet is not left behind).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import redis

from featurestore.definitions import StreamSource
from featurestore.errors import FeatureStoreError, NotFoundError, OnlineStoreUnavailable, RequestError
from featurestore.online.codec import key_prefix
from featurestore.types import as_declared

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore
    from featurestore.materialization.push import PushTarget

GROUP = "featurestore"
TRIM_SECONDS = 5.0  # how often a consumer trims the stream of what every group has acknowledged
DEAD_LETTERS_KEPT = 100_000  # the newest entries the dead-letter stream keeps
log = logging.getLogger(__name__)


def stream_key(project: str, source: StreamSource) -> str:
    return source.stream or (key_prefix(project) + b"stream:" + source.name.encode()).decode()


def publish(client: redis.Redis, stream: str, rows: list[dict[str, Any]]) -> list[bytes]:
    """Append rows to a stream as text fields (what a producer does); returns the entry ids."""
    pipe = client.pipeline(transaction=False)
    for row in rows:
        pipe.xadd(stream, {k: _text(v) for k, v in row.items() if v is not None})
    return pipe.execute()


def _text(value: Any) -> str | bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


@dataclass
class StreamStats:
    consumed: int = 0  # entries pushed and acknowledged
    dead: int = 0  # entries sent to the dead-letter stream
    pending: int = 0  # delivered to this group, not yet acknowledged
    lag_ms: float = 0.0  # newest entry's time minus the newest consumed entry's time
    started: float = 0.0

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.consumed / elapsed if elapsed > 0 else 0.0


class StreamConsumer:
    """One member of the consumer group of a stream source."""

    def __init__(
        self,
        store: FeatureStore,
        source_name: str,
        *,
        consumer: str | None = None,
        batch: int = 1000,
        block_ms: int = 1000,
        to: PushTarget = "online_and_offline",
        claim_idle_ms: int = 30_000,
    ):
        source = store.definitions.push_source(source_name)
        if not isinstance(source, StreamSource):
            raise NotFoundError(
                f"{source_name!r} is a push source, not a StreamSource; declare it with StreamSource(...) to consume a stream"
            )
        self.store, self.source, self.batch, self.block_ms, self.to = store, source, batch, block_ms, to
        self.stream = stream_key(store.config.project, source)
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.client: redis.Redis = store.online_store.client
        self.stats = StreamStats(started=time.monotonic())
        self.claim_idle_ms = (
            claim_idle_ms  # how long another consumer's entry waits unacknowledged before this one takes it
        )
        self._claimed_at = 0.0
        self._trimmed_at = time.monotonic()
        self._trims = not source.stream  # (a stream the source names is its owner's)
        try:
            self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        except redis.ConnectionError as exc:
            raise OnlineStoreUnavailable(f"Redis is unreachable: {exc}") from exc

    def run(
        self,
        *,
        until_idle: bool = False,
        stop: Callable[[], bool] = lambda: False,
        on_progress: Callable[[StreamStats], None] | None = None,
    ) -> StreamStats:
        """Consume until ``stop()`` (or, with ``until_idle``, until a read finds nothing new)."""
        backlog = True  # first our own pending entries (delivered before a crash), then new ones
        retry = 0.1
        while not stop():
            try:
                if time.monotonic() - self._claimed_at >= self.claim_idle_ms / 2000:
                    self._claim_idle()
                start = "0" if backlog else ">"
                reply: Any = self.client.xreadgroup(
                    GROUP,
                    self.consumer,
                    {self.stream: start},
                    count=self.batch,
                    block=None if backlog else self.block_ms,
                )
                entries = reply[0][1] if reply else []
                if backlog and not entries:
                    backlog = False
                    continue
                if entries:
                    self._handle(entries)
                self._measure()
                if time.monotonic() - self._trimmed_at >= TRIM_SECONDS:
                    self._trim()
                self.store.pack_pushed()
                retry = 0.1
            except (OnlineStoreUnavailable, redis.ConnectionError, redis.TimeoutError) as exc:
                # an outage: nothing was acknowledged that is not stored; wait, then re-read our pending entries
                log.warning("stream %s: Redis unavailable (%s); retrying in %.1fs", self.stream, exc, retry)
                time.sleep(retry)
                retry, backlog = min(retry * 2, 5.0), True
                continue
            if on_progress:
                on_progress(self.stats)
            if not entries and until_idle:
                break
        with contextlib.suppress(OnlineStoreUnavailable, redis.ConnectionError, redis.TimeoutError):
            self._trim()  # (what this run acknowledged: the next run, or another consumer, trims it otherwise)
        return self.stats

    def _handle(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        try:
            self._push(entries)
        except OnlineStoreUnavailable:
            raise
        except FeatureStoreError as exc:  # bad entries: isolate them, the good ones still go in
            if len(entries) == 1:
                self._dead_letter(entries[0], str(exc))
            else:
                for entry in entries:
                    self._handle([entry])
            return
        self.client.xack(self.stream, GROUP, *[entry_id for entry_id, _ in entries])
        self.stats.consumed += len(entries)

    def _claim_idle(self) -> None:
        """Take over, and push, the entries other consumers left unacknowledged for ``claim_idle_ms``
        (a consumer killed, or gone for good under a name nobody reuses)."""
        self._claimed_at = time.monotonic()
        cursor = "0-0"
        while True:
            reply = self.client.xautoclaim(
                self.stream, GROUP, self.consumer, self.claim_idle_ms, start_id=cursor, count=self.batch
            )
            cursor, entries = reply[0], [e for e in reply[1] if e[1] is not None]  # (trimmed entries come back empty)
            if entries:
                log.info(
                    "stream %s: %d entries idle for %d ms claimed by %s",
                    self.stream,
                    len(entries),
                    self.claim_idle_ms,
                    self.consumer,
                )
                self._handle(entries)
            if cursor in (b"0-0", "0-0"):
                return

    def _push(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        table = entries_to_table(entries, self.source)
        self.store.push(self.source.name, table, to=self.to, arrival=arrival(self.stream, entries))

    def _dead_letter(self, entry: tuple[bytes, dict[bytes, bytes]], reason: str) -> None:
        entry_id, fields = entry
        dead: dict[Any, Any] = {**fields, b"_reason": reason[:2000], b"_entry_id": entry_id}
        self.client.xadd(self.stream + ":dead", dead, maxlen=DEAD_LETTERS_KEPT, approximate=False)
        self.client.xack(self.stream, GROUP, entry_id)
        self.stats.dead += 1

    def _trim(self) -> None:
        """Drop the entries every consumer group of the stream has acknowledged: those before each
        group's oldest pending entry, or past its last delivered one when none is pending."""
        self._trimmed_at = time.monotonic()
        if not self._trims:
            return
        keep_from: list[tuple[int, int]] = []
        for group in self.client.xinfo_groups(self.stream):
            if group["pending"]:
                oldest = self.client.xpending(self.stream, group["name"])["min"]
                keep_from.append(_entry_id(oldest))
            else:
                ms, seq = _entry_id(group["last-delivered-id"])
                keep_from.append((ms, seq + 1))
        if keep_from:  # (no group: nothing read yet, nothing to trim)
            ms, seq = min(keep_from)
            self.client.xtrim(self.stream, minid=f"{ms}-{seq}", approximate=False)

    def _measure(self) -> None:
        summary = self.client.xpending(self.stream, GROUP)
        self.stats.pending = int(summary["pending"])
        groups = {g["name"]: g for g in self.client.xinfo_groups(self.stream)}
        last: bytes | str = groups.get(GROUP.encode(), groups.get(GROUP, {})).get("last-delivered-id", b"0-0")
        newest: Any = self.client.xrevrange(self.stream, count=1)
        # (none: every entry read, acknowledged and trimmed)
        self.stats.lag_ms = float(_ms(newest[0][0]) - _ms(last)) if newest else 0.0


def arrival(stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[pa.Array, pa.Array]:
    """Each entry's ingest time (its id's milliseconds: when Redis took it) and push id (a hash of the
    stream and the id): the same on every delivery."""
    ids = [entry_id.decode() if isinstance(entry_id, bytes) else entry_id for entry_id, _ in entries]
    times = pa.array([_ms(i) * 1000 for i in ids], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    pushes = [
        int.from_bytes(hashlib.blake2b(f"{stream}\0{i}".encode(), digest_size=8).digest(), "big") >> 1 for i in ids
    ]
    return times, pa.array(pushes, pa.int64())


def _ms(entry_id: bytes | str) -> int:
    return _entry_id(entry_id)[0]


def _entry_id(entry_id: bytes | str) -> tuple[int, int]:
    """An entry id's (milliseconds, sequence number)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def entries_to_table(entries: list[tuple[bytes, dict[bytes, bytes]]], source: StreamSource) -> pa.Table:
    """Stream entries -> a table of the source's schema (raises RequestError naming the bad column)."""
    columns = {}
    for f in source.schema:
        key = f.name.encode()
        raw = [fields.get(key) for _, fields in entries]
        try:
            if f.dtype.name == "Bytes":
                columns[f.name] = pa.array(raw, pa.binary())
            elif f.dtype.name == "UnixTimestamp":
                text = pd.Series([v.decode() if v is not None else None for v in raw], dtype="object")
                columns[f.name] = pa.array(pd.to_datetime(text, utc=True, format="ISO8601"), f.dtype.arrow)
            else:
                text = pa.array([v.decode() if v is not None else None for v in raw], pa.string())
                # (an integer only from its own text, as pushes and lookups take it: "017" is refused)
                integer = pa.types.is_integer(f.dtype.arrow)
                columns[f.name] = as_declared(f.name, text, f.dtype) if integer else pc.cast(text, f.dtype.arrow)
        except (ValueError, TypeError, UnicodeDecodeError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise RequestError(f"column {f.name!r} does not parse as {f.dtype!r}: {str(exc).splitlines()[0]}") from exc
    return pa.table(columns)
