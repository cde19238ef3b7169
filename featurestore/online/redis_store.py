"""The online store on Redis: one store over a transport (one node, or a cluster's slots).

Writes go through Lua scripts (``online/scripts``) so the compare-and-set is atomic in Redis:
concurrent materializations or pushes cannot regress a value. Events of aggregated views are
added by another script, once per event id. Reads are one round trip of HMGETs (latest values)
and ZRANGEBYSCOREs (window events). Writes are packed in bulk (``resp``) and sent a chunk at a
time while the next is encoded. Where they go is the transport's business (``online.transport``);
what they say is this store's. Layout: see ``featurestore.online.codec``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import redis

from featurestore.errors import OnlineStoreUnavailable
from featurestore.online import packed
from featurestore.online.base import (
    HORIZONS,
    NEWEST,
    SUMMARIES_SUFFIX,
    SYNC_TOKENS,
    Compacted,
    Lookup,
    Range,
    Seal,
    Sealer,
    TiledRange,
)
from featurestore.online.codec import (
    encode_events,
    encode_values,
    entity_keys,
    events_field,
    events_key,
    glob_escaped,
    key_prefix,
    numpy_values,
)
from featurestore.online.lua import scripts
from featurestore.online.resp import decimal, suffixed
from featurestore.online.transport import UNAVAILABLE, Call, Transport

CHUNK = 256  # rows per script call: Redis is busy ~5 ms at most for other clients
PACK_BATCH = 256  # entities whose blocks are packed together (``packed.pack_many``), read together when packing
PACKED_RETRIES = 3  # a whole-history write unpacks its entities' blocks, and again if a writer packed some meanwhile


# what the store runs, for a Redis user of its own (``ACL SETUSER``): every key, scripts, pub/sub
# (promotions), WAIT, TIME (in the scripts), and INFO / MEMORY / SCAN for ``featurestore capacity``
ACL_NEEDED = "~* &* +@read +@write +@scripting +@pubsub +@keyspace +@connection +time +info +memory"


class RedisOnlineStore:
    """Latest values, window events and tile summaries of a project's views, in Redis."""

    def __init__(self, transport: Transport, project: str):
        self.transport = transport
        self.project = project
        self.prefix = key_prefix(project)
        self._scripts_sent = False  # sent once before the first write: a cluster write of 100k rows is ~16k calls
        # (view, horizon ms) -> until when (ms) this store recorded it in Redis (``_horizon_call``)
        self._horizons_noted: dict[tuple[str, int], int] = {}
        self._zset_value_limit: int | None = None

    @property
    def client(self) -> Any:
        """redis-py's client, for plain commands (streams, inspection)."""
        return self.transport.client

    @property
    def url(self) -> str:
        return self.transport.url

    def write_latest(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        expire_after: timedelta | None = None,
        newest: tuple[str, int] | None = None,
    ) -> int:
        """Compare-and-set each entity's row; with ``expire_after``, keys expire once their data is too old to serve.
        ``newest``: (view name, newest event time in µs) for per-view freshness, sent in the same round trip."""
        if rows.num_rows == 0:
            return 0
        ttl_ms = int(expire_after.total_seconds() * 1000) if expire_after else 0
        keys, order = self._keys(rows, join_keys)
        rows = rows if order is None else rows.take(order)

        def calls() -> Iterator[Call]:  # encoded a chunk at a time: Redis runs one while the next is encoded
            for i in range(0, rows.num_rows, CHUNK):
                part = rows.slice(i, CHUNK)
                yield ("write_if_newer", keys.slice(i, CHUNK), [view, ttl_ms], [encode_values(part, features)])

        return sum(self._run(calls, newest))

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
        """Apply event writes (history rows, in write order) to their entities' events: each is kept
        unless an earlier write of its id is less than ``dedup_us`` away (or, with ``accepted``, as
        the history's rule decided); one before ``cutoff_us`` only records its time; older events
        are trimmed (``add_events.lua``). With ``sealer``, the ended tiles the rows hold in full are
        summarized in the same round trip, after the adds; then the ended blocks they hold in full
        are packed (``seal_tiles.lua``: only where Redis holds exactly the events summarized or
        packed: ``online.packed``). A whole-history write (``accepted``) first unpacks the blocks
        of its entities (it may replace or remove their events) and forgets what they lacked; it
        then lists its horizon alone (``keep_horizon.lua``). Returns how many events were added."""
        horizon_ms = horizon // timedelta(milliseconds=1)
        slack_ms = horizon_ms // 16
        newest_us = int(numpy_values(rows["event_timestamp"]).view(np.int64).max()) if rows.num_rows else 0
        # (a key lives until its newest event + horizon + dedup window + slack: ``add_events.lua``)
        until_ms = max(time.time_ns() // 1000, newest_us) // 1000 + horizon_ms + dedup_us // 1000 + slack_ms
        horizon_call = self._horizon_call(view, horizon_ms, until_ms, accepted is not None)
        if rows.num_rows == 0:  # (none to send, all before the cutoff: they are not held, under this horizon)
            if horizon_call is not None:
                self._run(lambda: [horizon_call], None)
                self._noted(horizon_call)
            return 0
        if accepted is not None:
            rows, event_ids, accepted = _without_copies_of_kept(rows, join_keys, features, event_ids, accepted)
        keys, order = self._keys(rows, join_keys)
        if order is not None:  # (stable: each entity's writes keep their order)
            rows, event_ids = rows.take(order), event_ids[order]
            accepted = accepted[order] if accepted is not None else None
        keys = suffixed(keys, events_key(b"", view))
        verdicts = accepted is not None
        adds = -(-rows.num_rows // CHUNK)
        least, limit = self.pack_from(), self.compact_value_limit()

        times = numpy_values(rows["event_timestamp"]).view(np.int64)

        def calls() -> Iterator[Call]:  # encoded a chunk at a time: Redis runs one while the next is encoded
            if horizon_call is not None:
                yield horizon_call  # (ahead of the events)
            for i in range(0, rows.num_rows, CHUNK):
                part = rows.slice(i, CHUNK)
                scores = decimal(numpy_values(part["event_timestamp"]).view(np.int64))
                columns = [scores, encode_events(part, features, event_ids[i : i + CHUNK])]
                if accepted is not None:
                    columns.append(pa.array([b"1" if a else b"0" for a in accepted[i : i + CHUNK]], pa.binary()))
                yield (
                    "add_events",
                    keys.slice(i, CHUNK),
                    [cutoff_us, horizon_ms, slack_ms, tile_us, dedup_us, int(verdicts), limit],
                    columns,
                )
            # (summarized and packed while Redis adds the last chunks)
            ended = _ended_rows(keys, times, accepted, cutoff_us, tile_us)
            held = _tile_members(keys, rows, times, features, event_ids, ended)
            for batch in iter(lambda: list(itertools.islice(held, PACK_BATCH)), []):  # (packed together)
                groups = [(_written_groups(events, tile_us), False) for _, events in batch]
                for (key, events), packs in zip(batch, _pack_groups(groups, features, tile_us, least, limit)):
                    entries: list = []
                    if sealer is not None:
                        full = _full_tiles(events, tile_us, cutoff_us, sealer.least)
                        if full:
                            summaries = _with_digests(sealer.summarize([m for _, m in full]), full, tile_us)
                            entries += itertools.chain.from_iterable(summaries)
                    entries += [x for pack in packs for x in pack]
                    if entries:
                        yield ("seal_tiles", [key], [tile_us, *entries], [])

        first = 0 if horizon_call is None else 1  # (the adds' replies follow the horizon's)
        if not verdicts:
            added = sum(self._run(calls, newest)[first : first + adds])
            self._noted(horizon_call)
            return added
        entities = pc.unique(keys).to_pylist()
        self._run(lambda: [("forget_trimmed", entities, [], [])], None)
        for attempt in range(1, PACKED_RETRIES + 1):
            self.unpack(entities, features)
            try:
                # (verdicts converge: the calls may run again)
                added = sum(self._run(calls, newest)[first : first + adds])
                self._noted(horizon_call)
                return added
            except redis.exceptions.ResponseError as exc:  # a concurrent writer packed some again
                if not str(exc).startswith("PACKED") or attempt == PACKED_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def _horizon_call(self, view: str, horizon_ms: int, until_ms: int, whole_history: bool) -> Call | None:
        """The ``keep_horizon.lua`` call a write of ``view`` makes ahead of its events; None when this
        store recorded it lately enough (``_noted``). It records a slack beyond ``until_ms`` (a later
        bound only counts more as missing), so a stream of writes sends one a slack of time, not one
        per write; a whole-history write always sends its own."""
        if not whole_history and self._horizons_noted.get((view, horizon_ms), 0) >= until_ms:
            return None
        ahead = until_ms + horizon_ms // 16
        return ("keep_horizon", [self.prefix + HORIZONS], [view, horizon_ms, ahead, int(whole_history)], [])

    def _noted(self, call: Call | None) -> None:
        """Remember a ``_horizon_call`` that ran (a whole-history write's replaced the view's others)."""
        if call is None:
            return
        view, horizon_ms, until_ms, whole_history = call[2]
        if whole_history:
            self._horizons_noted = {k: v for k, v in self._horizons_noted.items() if k[0] != view}
        elif len(self._horizons_noted) > 1024:  # (views x retentions: a few; bounded all the same)
            self._horizons_noted.clear()
        self._horizons_noted[view, horizon_ms] = until_ms

    def _keys(self, rows: pa.Table, join_keys: Sequence[str]) -> tuple[pa.Array, np.ndarray | None]:
        """The rows' entity keys, in the order the transport wants them written (None: as given)."""
        keys = entity_keys(self.project, rows, join_keys)
        order = self.transport.order(keys)
        return (keys, None) if order is None else (keys.take(pa.array(order)), order)

    def pack_ended(
        self,
        view: str,
        features: Sequence,
        tile_us: int,
        progress: Callable[[int], None] | None = None,
        sealer: Sealer | None = None,
    ) -> Compacted:
        """Pack the ended blocks of every entity's events under the view's layout ``view`` that
        hold plain events (streamed one by one, or late into a block): ``seal_tiles.lua``, only
        where Redis still holds what was read. With ``sealer``, first store the summaries of the
        ended tiles that have none (no writer held them whole), so no lookup pays for them.
        ``progress`` is told of each batch of keys scanned."""
        pattern = glob_escaped(self.prefix) + b"*:ev:" + glob_escaped(view.encode())
        scan = self.client.scan_iter(match=pattern, count=1000)  # (lazy: it reads as the batches are taken)
        return self._pack_batches(
            iter(lambda: list(itertools.islice(scan, PACK_BATCH)), []), features, tile_us, sealer, progress
        )

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
        """``pack_ended`` on the events of the entities of ``rows`` only (those pushes wrote, once
        their tiles have ended), from the block holding ``since_us`` on: bounded work, no scan."""
        keys = pc.unique(suffixed(entity_keys(self.project, rows, join_keys), events_key(b"", view))).to_pylist()
        batches = (keys[i : i + PACK_BATCH] for i in range(0, len(keys), PACK_BATCH))
        return self._pack_batches(batches, features, tile_us, sealer, since_us=since_us)

    def _pack_batches(
        self,
        batches: Iterable[list[bytes]],
        features: Sequence,
        tile_us: int,
        sealer: Sealer | None,
        progress: Callable[[int], None] | None = None,
        since_us: int | None = None,
    ) -> Compacted:
        done = Compacted(0, 0, 0)
        with self._calling():
            for keys in batches:
                found = self._pack_keys(keys, features, tile_us, sealer, since_us)
                done = Compacted(*map(sum, zip(done, found)))
                if progress is not None:
                    progress(len(keys))
        return done

    def _pack_keys(
        self, keys: list[bytes], features: Sequence, tile_us: int, sealer: Sealer | None, since_us: int | None
    ) -> Compacted:
        span = tile_us * packed.BLOCK_TILES
        least, limit = self.pack_from(), self.compact_value_limit()
        before = (time.time_ns() // 1000 // tile_us) * tile_us - 1  # (the tiles that may have ended)
        start = "-inf" if since_us is None else since_us // span * span  # (whole blocks: a block's score is its start)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrangebyscore(key, start, before)
            if sealer:
                pipe.hgetall(key + SUMMARIES_SUFFIX)
        replies = iter(pipe.execute())
        read = []  # (key, its summaries' entries, its blocks holding plain events, whether its set is sparse)
        for key, members in zip(keys, replies):
            entry = []
            if sealer:  # (a summary under another tag, of aggregations since changed, is none)
                sealed = {int(t) for t, summary in next(replies).items() if summary.startswith(sealer.tag)}
                entry = _unsealed(members, sealed, sealer, features, tile_us)
            read.append((key, entry, *_plain_groups(members, span, limit)))
        every = [group for _, _, groups, _ in read for group in groups]
        for (_, _, held), got in zip(every, packed.expand_many([raw for _, raw, _ in every], features, keep=False)):
            held += got  # (the blocks of them all decoded together, not kept: they are packed again)
        found = _pack_groups([(groups, sparse) for _, _, groups, sparse in read], features, tile_us, least, limit)
        entries, blocks, events, summaries = {}, 0, 0, 0
        for (key, entry, groups, _), packs in zip(read, found):
            summaries += len(entry) // 5
            for (_, raw, _), pack in zip(groups, packs):
                if pack:  # (after the summaries: they check plain members)
                    entry += pack
                    blocks, events = blocks + 1, events + packed.event_count(raw)
            if entry:
                entries[key] = entry
        if entries:
            self._run(partial(_seal_calls, entries, tile_us), None)
        return Compacted(blocks, events, summaries)

    def pack_from(self) -> int:
        """Events a block needs on this Redis (``packed.pack_from`` of its sorted sets' compact value limit)."""
        return packed.pack_from(self.compact_value_limit())

    def compact_value_limit(self) -> int:
        """The longest member this Redis keeps a sorted set compact with (``zset-max-listpack-value``;
        Redis's default where CONFIG is disabled), read once."""
        if self._zset_value_limit is None:
            with self._calling():
                try:  # (named listpack from Redis 7, ziplist before)
                    limits = self.client.config_get("zset-max-*-value")
                except redis.ResponseError:  # CONFIG disabled, as on some managed services: Redis's default
                    limits = {}
            self._zset_value_limit = max((int(v) for v in limits.values()), default=64)
        return self._zset_value_limit

    def eviction_policy(self) -> str | None:
        """How this Redis deletes keys once full (``maxmemory`` set, ``maxmemory-policy`` other than
        ``noeviction``); None if it never does, or CONFIG is disabled (a managed service's)."""
        with self._calling():
            try:
                config = self.client.config_get("maxmemory*")
            except redis.ResponseError:
                return None
        policy = config.get("maxmemory-policy", "noeviction")
        return policy if int(config.get("maxmemory", 0)) > 0 and policy != "noeviction" else None

    def unpack(self, keys: Sequence[bytes], features: Sequence) -> None:
        """Replace the blocks of these events keys by the events they hold (``unpack_block.lua``)."""
        blocks = self._run(lambda: (("blocks", [key], [], []) for key in keys), None)
        self._run(
            lambda: (
                ("unpack_block", [key], [block, *packed.unpack(block, features)], [])
                for key, found in zip(keys, blocks)
                for block in found
            ),
            None,
        )

    def read(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range] = (),
        windows: Sequence[TiledRange] = (),
        summaries: Sequence[bytes] = (),
    ) -> list:
        """One round trip: for each lookup, the encoded value of each wanted view (None if absent);
        then for each range, the encoded events in it, in (time, id) order; then for each heavy
        entity's window, ``[tile summaries, events of the other tiles]`` (``read_window.lua``);
        then for each events key in ``summaries``, its tile summaries (its hash, as HGETALL replies).
        A Redis that lost its scripts (a restart) gets them, and the read goes again."""
        try:
            return self.transport.read(lookups, ranges, windows, summaries)
        except redis.exceptions.NoScriptError:
            self._load_scripts()
            return self.transport.read(lookups, ranges, windows, summaries)
        except redis.ResponseError as exc:  # (no context manager: a lookup's path pays nothing for it)
            self._raise_refused(exc)

    async def read_async(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range] = (),
        windows: Sequence[TiledRange] = (),
        summaries: Sequence[bytes] = (),
    ) -> list:
        """``read`` on the event loop (on one node, batched with the other lookups of the loop turn)."""
        try:
            return await self.transport.read_async(lookups, ranges, windows, summaries)
        except redis.exceptions.NoScriptError:
            try:
                await self.transport.async_client.script_load(scripts()["read_window"].code)
            except self.transport.failures as exc:
                raise self.transport.error(exc) from exc
            return await self.transport.read_async(lookups, ranges, windows, summaries)
        except redis.ResponseError as exc:
            self._raise_refused(exc)

    def seal(self, seals: Sequence[Seal]) -> None:
        """Store tile summaries a lookup computed (``seal_tiles.lua``: only where the tile still holds as many events)."""
        self._run(lambda: (("seal_tiles", [key], [tile_us, *_flat(tiles)], []) for key, tile_us, tiles in seals), None)

    async def seal_async(self, seals: Sequence[Seal]) -> None:
        """``seal`` on the event loop."""
        await self._evalsha_async("seal_tiles", [(key, [tile_us, *_flat(tiles)]) for key, tile_us, tiles in seals])

    def newest(self) -> dict[str, int]:
        """``{view: newest event time written online, µs since the epoch}``."""
        with self._calling():
            return {k.decode(): int(v) for k, v in self.client.hgetall(self.prefix + NEWEST).items()}

    async def newest_async(self) -> dict[str, int]:
        """``newest`` on the event loop."""
        try:
            stored = await self.transport.async_client.hgetall(self.prefix + NEWEST)
        except self.transport.failures as exc:
            raise self.transport.error(exc) from exc
        return {k.decode(): int(v) for k, v in stored.items()}

    def first_use(self, key: str, fingerprint: str, now_us: int, keep_seconds: int) -> tuple[int, str]:
        """Record ``(now_us, fingerprint)`` under an idempotency key unless already there; return what is
        recorded (a retry gets the first attempt's time and fingerprint)."""
        name = self.prefix + b"idem:" + key.encode()
        with self._calling():  # (a write call: with wait_for_replicas, the replicas have it when it returns)
            (recorded,) = self._run(
                lambda: [("first_use", [name], [f"{now_us}:{fingerprint}", keep_seconds], [])], None
            )
        recorded = recorded.decode()
        first, _, recorded_fingerprint = recorded.partition(":")
        return int(first), recorded_fingerprint

    def sync_token(self, view: str) -> str | None:
        """The token ``set_sync_token`` last left for ``view`` here; None if none (a new, emptied or replaced Redis)."""
        with self._calling():
            token = self.client.hget(self.prefix + SYNC_TOKENS, view)
        return None if token is None else token.decode()

    def set_sync_token(self, view: str, token: str) -> None:
        with self._calling():
            self.client.hset(self.prefix + SYNC_TOKENS, view, token)

    def publish(self, channel: bytes, message: str) -> None:
        """Broadcast to every subscribed server (model promotions)."""
        with self._calling():
            self.client.publish(self.prefix + channel, message)

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``, as they come; raises when Redis goes away."""
        async for message in self.transport.subscribe(self.prefix + channel):
            yield message

    def ping(self) -> bool:
        with self._calling():
            return bool(self.client.ping())

    async def ping_async(self) -> bool:
        try:
            return bool(await self.transport.async_client.ping())
        except (redis.RedisError, OSError) as exc:
            self.transport.recover_in_background()
            raise self.transport.error(exc) from exc

    def drop_view(self, view: str, keep: str | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Delete every stored layout of the view (fields and event keys named ``view#<layout>``),
        or every one but the online field ``keep``; returns how many keys and fields went.
        ``progress`` is told of each batch of keys scanned."""
        marker, kept = view.encode() + b"#", (keep or "").encode()

        def dropped(field: bytes | None) -> bool:
            return field is not None and field.startswith(marker) and field != kept

        gone = 0
        with self._calling():
            if keep is None:
                self.client.hdel(self.prefix + SYNC_TOKENS, view)
            held = [f for f in self.client.hkeys(self.prefix + HORIZONS) if dropped(f)]
            if held:
                gone += self.client.hdel(self.prefix + HORIZONS, *held)
            self._horizons_noted.clear()
            scan = self.client.scan_iter(match=glob_escaped(self.prefix) + b"*", count=1000)
            for batch in iter(lambda: list(itertools.islice(scan, 1000)), []):  # (a round trip or two a batch)
                # (exact: the pattern is escaped, this is the proof)
                mine = [k for k in batch if k.startswith(self.prefix)]
                events = [k for k in mine if dropped(events_field(k))]  # an events key, its ids or its tiles
                entities = [k for k in mine if k.endswith(b"}")]  # (their hashes of latest values)
                reads = self.client.pipeline(transaction=False)
                for key in entities:
                    reads.hkeys(key)
                writes = self.client.pipeline(transaction=False)
                for key in events:
                    writes.delete(key)
                for key, fields in zip(entities, reads.execute()):  # (an empty pipeline sends nothing)
                    if stale := [f for f in fields if dropped(f)]:
                        writes.hdel(key, *stale)
                gone += sum(writes.execute())
                if progress is not None:
                    progress(len(batch))
        return gone

    def unavailable(self, exc: BaseException) -> OnlineStoreUnavailable:
        """The store's error for a failed call of redis-py's (an embedded server that died restarted first)."""
        self.transport.recover()
        return self.transport.error(exc)

    def close(self) -> None:
        self.transport.close()

    def _refused(self, exc: BaseException) -> OnlineStoreUnavailable | None:
        """The store's error when Redis is up but takes no writes (full, under ``noeviction``; a
        replica; or it cannot save its snapshots), or refuses the URL's user a command or key (its
        ACL); None for any other error."""
        text = str(exc)  # (a script's command refused: its error carries the refusal, "-OOM …")
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or "-OOM " in text:
            why = "is full (used memory past maxmemory) and refuses writes: raise maxmemory or add nodes"
            why += " (`featurestore capacity` sizes it)"
        elif isinstance(exc, redis.exceptions.ReadOnlyError) or "-READONLY " in text:
            why = "is a read-only replica: point `online_store.url` at its master"
        elif isinstance(exc, redis.ResponseError) and (text.startswith("MISCONF") or "-MISCONF " in text):
            why = "refuses writes: it cannot save its snapshots (MISCONF; its log says why)"
        elif isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in text:
            why = f"refuses the URL's user a command or key ({text}): grant it {ACL_NEEDED}"
        else:
            return None
        return OnlineStoreUnavailable(f"Redis at {self.transport.safe_url} {why}")

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        try:
            yield
        except UNAVAILABLE as exc:
            raise self.unavailable(exc) from exc
        except redis.ResponseError as exc:
            self._raise_refused(exc)

    def _raise_refused(self, exc: redis.ResponseError) -> NoReturn:
        """``exc`` as the store's error where it is a refusal (``_refused``), else as it is."""
        refused = self._refused(exc)
        if refused is None:
            raise exc
        raise refused from exc

    def _run(self, calls: Callable[[], Iterable[Call]], newest: tuple[str, int] | None) -> list:
        """Run script calls in one round trip (per node), then note the view's newest event time
        (kept as a maximum: it never moves back; the servers export its age as per-view
        freshness); returns the calls' results. EVALSHA straight away (redis-py's scripts ask
        SCRIPT EXISTS first: a round trip more per write); a Redis that lost its scripts (a
        restart) gets them, and the calls, all idempotent, run again."""
        noted: list[Call] = [("keep_max", [self.prefix + NEWEST], list(newest), [])] if newest is not None else []
        if not self._scripts_sent:  # (else the first calls all fail with NOSCRIPT and go again)
            self._load_scripts()
        for attempt in (1, 2):
            results = self.transport.send(itertools.chain(calls(), noted))
            if attempt == 1 and any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                self._load_scripts()
                continue
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise self._refused(errors[0]) or errors[0]
            return results[: len(results) - len(noted)]
        raise AssertionError("unreachable")

    def _load_scripts(self) -> None:
        with self._calling():
            for script in scripts().values():
                self.client.script_load(script.code)
        self._scripts_sent = True

    async def _evalsha_async(self, name: str, calls: list[tuple[bytes, list]]) -> list:
        """One script on each key, in one round trip (per node); its text sent again to a Redis that lost it."""
        transport, sha = self.transport, scripts()[name].sha
        for attempt in (1, 2):
            try:
                # by command: redis-py blocks its EVALSHA method in cluster pipelines; the command routes by key
                if len(calls) == 1:
                    key, arguments = calls[0]
                    return [await transport.async_client.execute_command("EVALSHA", sha, 1, key, *arguments)]
                pipe = transport.async_client.pipeline(transaction=False)
                for key, arguments in calls:
                    pipe.execute_command("EVALSHA", sha, 1, key, *arguments)
                return await pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                try:
                    await transport.async_client.script_load(scripts()[name].code)
                except transport.failures as exc:
                    raise transport.error(exc) from exc
            except transport.failures as exc:
                transport.recover_in_background()
                raise transport.error(exc) from exc
        raise AssertionError("unreachable")


def _flat(tiles: Sequence[tuple[int, int, bytes]]) -> list:
    """A lookup's summaries as ``seal_tiles.lua`` takes them: no digest (its count check suffices)."""
    return [x for tile, events, summary in tiles for x in ("S", tile, events, b"", summary)]


def _without_copies_of_kept(
    rows: pa.Table, join_keys: Sequence[str], features: Sequence, event_ids: np.ndarray, accepted: np.ndarray
) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """A whole-history write without the duplicates that are byte-for-byte copies of a kept
    write (a retried push: same id, time and values): Redis removes a duplicate's event, which
    for a copy would be the kept event itself. (Its write time is the kept write's: nothing lost.)"""
    rejected = np.flatnonzero(~accepted.astype(bool))
    if not len(rejected):
        return rows, event_ids, accepted
    times = numpy_values(rows["event_timestamp"]).view(np.int64)
    entities = entity_keys("", rows, join_keys).to_pylist()
    kept = np.flatnonzero(accepted.astype(bool))
    same_event = {(entities[k], int(event_ids[k]), int(times[k])): k for k in kept}
    pairs = [(r, same_event.get((entities[r], int(event_ids[r]), int(times[r])))) for r in rejected]
    pairs = [(r, k) for r, k in pairs if k is not None]
    if not pairs:
        return rows, event_ids, accepted
    index = pa.array([x for pair in pairs for x in pair])
    members = encode_events(rows.take(index), features, event_ids[index.to_numpy()]).to_pylist()
    drop = {r for (r, _), a, b in zip(pairs, members[::2], members[1::2]) if a == b}
    keep = np.array([i not in drop for i in range(rows.num_rows)])
    return rows.filter(pa.array(keep)), event_ids[keep], accepted[keep]


def _seal_calls(entries: dict[bytes, list], tile_us: int) -> Iterator[Call]:
    return (("seal_tiles", [key], [tile_us, *entry], []) for key, entry in entries.items())


def _unsealed(members: list[bytes], sealed: set[int], sealer: Sealer, features: Sequence, tile_us: int) -> list:
    """``seal_tiles.lua``'s summary entries for the ended tiles among ``members`` (a range of one
    entity's events, in sorted-set order, blocks and plain events) that have no summary
    (``sealed``) and hold ``sealer.least`` events or more: what the first lookups would summarize
    otherwise. Each checks the tile's block, if one holds some of its events, and plain events."""
    counts: collections.Counter[int] = collections.Counter()
    block_of: dict[int, bytes] = {}  # tile -> the block holding some of its events
    plain: dict[int, list[bytes]] = {}
    for member in members:
        if packed.is_block(member):
            number, per_tile = packed.header(member)
            for i, count in enumerate(per_tile):
                if count:
                    counts[number * packed.BLOCK_TILES + i] += count
                    block_of[number * packed.BLOCK_TILES + i] = member
        else:
            tile = packed.tile_of(member, tile_us)
            counts[tile] += 1
            plain.setdefault(tile, []).append(member)
    wanted = {tile for tile, count in counts.items() if count >= sealer.least and tile not in sealed}
    if not wanted:
        return []
    holding = [m for m in dict.fromkeys(block_of[t] for t in wanted if t in block_of)]
    holding += [m for t in sorted(wanted) for m in plain.get(t, [])]
    events = [m for m in packed.expand(holding, features, keep=False) if packed.tile_of(m, tile_us) in wanted]
    return [
        x
        for tile, count, summary in sealer.summarize(events)
        for x in (
            "S",
            tile,
            count,
            hashlib.sha1(block_of.get(tile, b"") + b"".join(plain.get(tile, []))).hexdigest(),
            summary,
        )
    ]


Group = tuple[int, list[bytes], list[bytes]]  # a block's number, the members Redis holds in it, their events


def _plain_groups(members: list[bytes], span: int, limit: int) -> tuple[list[Group], bool]:
    """The blocks among ``members`` (a range of one entity's events, in sorted-set order) that
    hold plain events, with the block packed before if any (their events to read: empty), and
    whether the sorted set holds a member longer than ``limit`` (Redis's compact value limit:
    ``_pack_groups``)."""

    def block(member: bytes) -> int:
        if packed.is_block(member):
            return packed.header(member)[0]
        return packed.tile_of(member, span)

    groups: list[Group] = []
    for number, group in itertools.groupby(members, key=block):
        raw = list(group)
        if not all(packed.is_block(m) for m in raw):
            groups.append((number, raw, []))
    return groups, any(len(m) > limit for m in members)


def _written_groups(events: list[tuple[int, bytes]], tile_us: int) -> list[Group]:
    """The blocks of the ended tiles whose events (``(µs, member)`` in (time, id) order) a write
    holds, to pack as ``_pack_groups`` decides."""
    span = tile_us * packed.BLOCK_TILES
    groups = []
    for block, group in itertools.groupby(events, key=lambda e: e[0] // span):
        members = [m for _, m in group]
        groups.append((block, members, members))
    return groups


def _pack_groups(
    entities: Sequence[tuple[list[Group], bool]], features: Sequence, tile_us: int, least: int, limit: int
) -> list[list[list]]:
    """For each entity's groups, the entry packing each of ``least`` events or more, or none; of
    ``packed.SPARSE_PACK_FROM`` where its sorted set holds (its flag) or gets a member longer than
    ``limit``, Redis's compact value limit. All entities' blocks are packed at once."""
    flat = _pack_entries([g for groups, _ in entities for g in groups], features, tile_us, least)
    found, at = [], 0
    for groups, _ in entities:
        found.append(flat[at : at + len(groups)])
        at += len(groups)
    again = [
        (k, j)
        for k, (groups, sparse) in enumerate(entities)
        if sparse or any(entry and len(entry[4]) > limit for entry in found[k])
        for j, entry in enumerate(found[k])
        if not entry
    ]
    redone = _pack_entries([entities[k][0][j] for k, j in again], features, tile_us, packed.SPARSE_PACK_FROM)
    for (k, j), entry in zip(again, redone):
        found[k][j] = entry
    return found


def _pack_entries(groups: Sequence[Group], features: Sequence, tile_us: int, least: int) -> list[list]:
    """The entry packing each group's events (``least`` or more, else none), which Redis holds as
    its members in the block's ended tiles: ``["P", block, tiles ended, SHA-1 of its members, the
    block, its id filter]``."""
    wanted = [i for i, (_, _, events) in enumerate(groups) if len(events) >= least]
    blobs = packed.pack_many([groups[i][2] for i in wanted], features, tile_us)  # (None: a tile too full to count)
    done = [(i, blob) for i, blob in zip(wanted, blobs) if blob is not None]
    ids = np.frombuffer(b"".join(m[:8] for i, _ in done for m in groups[i][2]), dtype=">u8")
    filters = packed.id_filters(ids, np.array([len(groups[i][2]) for i, _ in done], np.int64))
    now_tile = time.time_ns() // 1000 // tile_us
    out: list[list] = [[] for _ in groups]
    for (i, blob), id_filter in zip(done, filters):
        block, raw, _ = groups[i]
        ended = min(packed.BLOCK_TILES, now_tile - block * packed.BLOCK_TILES)
        out[i] = ["P", block, ended, hashlib.sha1(b"".join(raw)).hexdigest(), blob, id_filter]
    return out


def _ended_rows(
    keys: pa.Array, times: np.ndarray, accepted: np.ndarray | None, cutoff_us: int, tile_us: int
) -> np.ndarray:
    """The rows (event µs ``times``) stored in ended tiles (at or after the cutoff): those a
    writer may summarize or pack. Sorted by entity, then time."""
    tile = times // tile_us
    usable = (tile < time.time_ns() // 1000 // tile_us) & (times >= cutoff_us)
    if accepted is not None:  # a write the history found a duplicate is not stored
        usable &= accepted.astype(bool)
    candidates = np.flatnonzero(usable)
    if len(candidates) < 2:  # (most often none: a stream's events are in the tile of now)
        return candidates
    entity = pc.dictionary_encode(keys.take(pa.array(candidates))).indices.to_numpy(zero_copy_only=False)
    return candidates[np.lexsort((times[candidates], entity))]


def _full_tiles(events: list[tuple[int, bytes]], tile_us: int, cutoff_us: int, least: int) -> list[tuple[int, bytes]]:
    """The events of one entity's tiles inside the cutoff that hold ``least`` of them or more."""
    counts = collections.Counter(us // tile_us for us, _ in events)
    return [(us, m) for us, m in events if counts[us // tile_us] >= least and us // tile_us * tile_us >= cutoff_us]


def _tile_members(
    keys: pa.Array, rows: pa.Table, times: np.ndarray, features: Sequence, event_ids: np.ndarray, whole: np.ndarray
) -> Iterator[tuple[bytes, list[tuple[int, bytes]]]]:
    """Per entity, the events of rows ``whole`` as Redis stores them, ``(µs, member)`` in (time,
    id) order (the sorted set's: by score, then member bytes), a retried write's copy once."""
    if not len(whole):
        return
    taken = pa.array(whole)
    members = encode_events(rows.take(taken), features, event_ids[whole]).to_pylist()
    stamps = times[whole].tolist()
    for key, group in itertools.groupby(zip(keys.take(taken).to_pylist(), stamps, members), key=lambda r: r[0]):
        yield key, sorted({(t, m) for _, t, m in group})


def _with_digests(tiles: Sequence[tuple[int, int, bytes]], events: list[tuple[int, bytes]], tile_us: int) -> list:
    """``seal_tiles.lua``'s quadruples: each summary with the SHA-1 of its tile's members."""
    by_tile: dict[int, list[bytes]] = {}
    for us, member in events:
        by_tile.setdefault(us // tile_us, []).append(member)
    return [
        ("S", tile, count, hashlib.sha1(b"".join(by_tile[tile])).hexdigest(), summary) for tile, count, summary in tiles
    ]
