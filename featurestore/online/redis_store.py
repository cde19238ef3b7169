"""Online store on Redis (embedded redis-server by default, or any ``redis://``/``rediss://`` URL).

Writes go through a Lua script so the compare-and-set is atomic in Redis: concurrent
materializations or pushes cannot regress a value. Events of aggregated views are added by
another script, once per event id. Reads are one round trip of HMGETs (latest values) and
HVALS (window events); on the servers the lookups of one event-loop turn share it
(``BatchedReads``). Reads and writes are packed in bulk and sent without redis-py's
per-argument packing (``resp``). Layout: see ``featurestore.online.codec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis

from featurestore.config import RepoConfig
from featurestore.errors import OnlineStoreUnavailable
from featurestore.online import resp
from featurestore.online.base import Lookup, Range, Seal, TiledRange
from featurestore.online.codec import (
    encode_events,
    encode_values,
    entity_keys,
    events_key,
    glob_escaped,
    key_prefix,
    numpy_values,
)
from featurestore.online.embedded import EmbeddedRedis
from featurestore.online.resp import decimal, suffixed

# KEYS: entity keys; ARGV[1]: view field; ARGV[2]: expiry ttl in ms (0: none); ARGV[i+2]: value for KEYS[i].
# A value replaces the stored one only if its 32-byte order key is larger: compared as
# eight big-endian uint32s (exact; Lua numbers are doubles and string < depends on locale).
# With a ttl, the key expires when its newest value would be OUTSIDE_MAX_AGE (never earlier).
WRITE_IF_NEWER = """
local field = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local written = 0
local now_ms = nil
for i, key in ipairs(KEYS) do
  local new = ARGV[i + 2]
  local n = {struct.unpack('>I4I4I4I4I4I4I4I4', new)}
  local old = redis.call('HGET', key, field)
  local newer = true
  if old then
    local o = {struct.unpack('>I4I4I4I4I4I4I4I4', old)}
    newer = false
    for j = 1, 8 do
      if n[j] ~= o[j] then newer = n[j] > o[j]; break end
    end
  end
  if newer then
    redis.call('HSET', key, field, new)
    written = written + 1
    if ttl_ms > 0 then
      if not now_ms then
        local t = redis.call('TIME')
        now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      local event_ms = math.floor(((n[1] - 2147483648) * 4294967296 + n[2]) / 1000)
      local expire_at = event_ms + ttl_ms
      local pttl = redis.call('PTTL', key)
      if pttl == -1 or now_ms + pttl < expire_at then
        redis.call('PEXPIREAT', key, expire_at)
      end
    end
  end
end
return written
"""

KEEP_MAX = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or tonumber(current) < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
"""

# KEYS[1]: an idempotency key; ARGV: the value to record unless one is, its expiry in s. Returns the recorded one.
FIRST_USE = """
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
return redis.call('GET', KEYS[1])
"""

# KEYS: the events key of each write; ARGV[1]: cutoff µs (events before it are trimmed, and a
# write before it only records its time); ARGV[2]: horizon ms (keys expire that long after their
# newest event); ARGV[3]: slack ms; ARGV[4]: tile µs; ARGV[5]: dedup µs; ARGV[6]: '1' when the
# writes carry the history's verdicts (a whole-history resend); then the n writes' µs as decimal
# text, the n events (8-byte id, then the value), and with verdicts n of '1' (kept) or '0'.
#
# The duplicate rule (``featurestore.aggregation``): a write of an id is a duplicate when an earlier
# write of the id lies less than the dedup window away in event time. The ids hash maps each id to
# the times of its writes (8 bytes each, sign-flipped big-endian: bytes 9-16 of the event), kept a
# dedup window beyond the events, so the rule is decided here as writes arrive (retries and
# replays never count twice; an id reused further apart is a new event). A kept event goes into
# the events sorted set (score: its µs; members of one µs sort by id, so a range comes in (time,
# id) order); one in an ended tile drops that tile's sealed summary. With verdicts, the history
# decides instead: a kept write replaces any other event of its id less than the dedup window
# away, a duplicate is removed. Expiry is pushed out to newest + horizon (+ the dedup window for
# the ids) + slack whenever newest + horizon passes it, so a stream of events refreshes it (and
# trims old events, write times and summaries) once per slack, not per event. Every redis.call
# costs ~3 µs here.
ADD_EVENTS = """
local cutoff = tonumber(ARGV[1])
local horizon_ms, slack_ms, tile, within = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local verdicts = ARGV[6] == '1'
local n = #KEYS
local added = 0
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function micros(stamp, at)
  local hi, lo = struct.unpack('>I4I4', stamp, at)
  return (hi - 2147483648) * 4294967296 + lo
end
local function touched(events, us)  -- an event changed in an ended tile: its summary is stale
  local tile_no = math.floor(us / tile)
  if (tile_no + 1) * tile <= now_ms * 1000 then redis.call('HDEL', events .. '|tiles', tile_no) end
end
local function extend(key, expire_at)  -- keys live until expire_at (ms) at least; true if moved
  local pttl = redis.call('PTTL', key)
  if pttl >= 0 and now_ms + pttl >= expire_at then return false end
  redis.call('PEXPIREAT', key, string.format('%.0f', expire_at + slack_ms))
  return true
end
for k = 1, n do
  local events, us, event = KEYS[k], tonumber(ARGV[6 + k]), ARGV[6 + n + k]
  local ids, id, stamp = events .. '|ids', string.sub(event, 1, 8), string.sub(event, 9, 16)
  local kept = redis.call('HSETNX', ids, id, stamp) == 1
  local times = not kept and redis.call('HGET', ids, id) or stamp
  if not kept then
    local seen = false
    kept = true
    for at = 1, #times, 8 do
      local other = micros(times, at)
      if math.abs(other - us) < within then kept = false end
      if other == us then seen = true end
    end
    if not seen then times = times .. stamp; redis.call('HSET', ids, id, times) end
  end
  if verdicts then kept = ARGV[6 + 2 * n + k] == '1' end
  if us >= cutoff then
    if kept and redis.call('ZADD', events, us, event) == 1 then
      added = added + 1
      touched(events, us)
    elseif verdicts and not kept and redis.call('ZREM', events, event) == 1 then
      touched(events, us)
    end
    if verdicts and kept then  -- the history's write is the id's event: drop others near it
      for at = 1, #times, 8 do
        local other = micros(times, at)
        if math.abs(other - us) < within then
          local at_us = string.format('%.0f', other)
          for _, member in ipairs(redis.call('ZRANGEBYSCORE', events, at_us, at_us)) do
            if member ~= event and string.sub(member, 1, 8) == id then
              redis.call('ZREM', events, member)
              touched(events, other)
            end
          end
        end
      end
    end
  end
  local expire_ms = math.floor(us / 1000) + horizon_ms
  local ids_expire_ms = expire_ms + math.floor(within / 1000)
  if us < cutoff then
    extend(ids, ids_expire_ms)
  elseif extend(events, expire_ms) then  -- (the ids' and summaries' expiry move with the events')
    redis.call('PEXPIREAT', events .. '|tiles', string.format('%.0f', expire_ms + slack_ms))
    redis.call('PEXPIREAT', ids, string.format('%.0f', ids_expire_ms + slack_ms))
    redis.call('ZREMRANGEBYSCORE', events, '-inf', '(' .. ARGV[1])
    local first_tile = math.floor(cutoff / tile)
    for _, name in ipairs(redis.call('HKEYS', events .. '|tiles')) do
      if tonumber(name) < first_tile then redis.call('HDEL', events .. '|tiles', name) end
    end
    local stored = redis.call('HGETALL', ids)  -- write times a dedup window before the cutoff are no longer needed
    for i = 1, #stored, 2 do
      local kept_times = ''
      for at = 1, #stored[i + 1], 8 do
        if micros(stored[i + 1], at) > cutoff - within then kept_times = kept_times .. string.sub(stored[i + 1], at, at + 7) end
      end
      if kept_times == '' then redis.call('HDEL', ids, stored[i])
      elseif kept_times ~= stored[i + 1] then redis.call('HSET', ids, stored[i], kept_times) end
    end
  end
end
return added
"""

# KEYS[1]: an events key; ARGV: low µs (exclusive), high µs, tile µs, the summaries' tag, then
# the window starts and the lookup time (the tiles holding them are read event by event).
# Returns {summaries, runs}: the sealed summary of each tile inside (low, high] holding no cut
# (``tile number, summary`` pairs), and the events of the other tiles in (low, high], in order,
# as one array per run of such tiles (not copied into one: Lua pays per element).
READ_WINDOW = """
local events, low, high = KEYS[1], ARGV[1], ARGV[2]
local tile = tonumber(ARGV[3])
local tag = ARGV[4]
local cut = {}
for i = 5, #ARGV do cut[math.floor(tonumber(ARGV[i]) / tile)] = true end
local sealed = {}
local stored = redis.call('HGETALL', events .. '|tiles')
for i = 1, #stored, 2 do
  if string.sub(stored[i + 1], 1, #tag) == tag then sealed[tonumber(stored[i])] = stored[i + 1] end
end
local summaries, read = {}, {}
local first, last = math.floor((tonumber(low) + 1) / tile), math.floor(tonumber(high) / tile)
local run = nil  -- the first tile of a run read event by event
for t = first, last + 1 do
  local summary = t <= last and not cut[t] and sealed[t]
  if summary then
    summaries[#summaries + 1] = t
    summaries[#summaries + 1] = summary
  end
  if (summary or t > last) and run then
    local from = math.max(tonumber(low) + 1, run * tile)
    local to = math.min(tonumber(high), t * tile - 1)
    read[#read + 1] = redis.call('ZRANGEBYSCORE', events, string.format('%.0f', from), string.format('%.0f', to))
    run = nil
  elseif not summary and not run then
    run = t
  end
end
return {summaries, read}
"""

# KEYS[1]: an events key; ARGV[1]: tile µs; then per tile: its number, its event count when
# summarized, the summary. A summary is kept only for a tile that has ended (by Redis's clock)
# and still holds that many events: an event added since (which drops the tile's summary) makes
# the count differ, so a summary never misses an event.
SEAL_TILES = """
local events, tile = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local sealed = 0
for i = 2, #ARGV, 3 do
  local no = tonumber(ARGV[i])
  if (no + 1) * tile <= now_us and redis.call('EXISTS', events) == 1 then
    local from, to = string.format('%.0f', no * tile), string.format('%.0f', (no + 1) * tile - 1)
    if redis.call('ZCOUNT', events, from, to) == tonumber(ARGV[i + 1]) then
      redis.call('HSET', events .. '|tiles', ARGV[i], ARGV[i + 2])
      local ttl = redis.call('PTTL', events)
      if ttl > 0 then redis.call('PEXPIRE', events .. '|tiles', ttl) end
      sealed = sealed + 1
    end
  end
end
return sealed
"""


async def listen(client: aioredis.Redis, channel: bytes) -> AsyncIterator[str]:
    """The messages published on ``channel``, through ``client``, as text."""
    pubsub = client.pubsub()
    await pubsub.subscribe(channel)
    try:
        async for message in pubsub.listen():
            if message["type"] == "message":
                yield message["data"].decode()
    finally:
        await pubsub.aclose()


def redact(text: str, url: str) -> str:
    """``text`` with the password of ``url`` (``redis://user:secret@host``) replaced by ``***``."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(url).password
    except ValueError:
        return text
    return text.replace(password, "***") if password else text


# what a Redis that is down, hung, or failing over raises (a cluster: no master for a slot yet)
UNAVAILABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
    OSError,
)

CHUNK = 256  # rows per script call: Redis is busy ~5 ms at most for other clients
Call = tuple[str, "pa.Array | list", list, "list[pa.Array]"]  # script, keys, arguments, per-key argument columns


def _array(values: pa.Array | list) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, pa.binary())


MAX_ASYNC_READS = 256  # batches of lookups in flight (connections in use) per server process


class ReadConnections:
    """Connections for lookups, reused newest first: a pool without redis-py's per-checkout
    bookkeeping (~10 µs a lookup). At most ``keep`` wait idle; ``make`` opens one lazily."""

    def __init__(self, make: Callable[[], Any], keep: int = 64):
        self.make, self.keep = make, keep
        self._idle: list = []

    def take(self) -> Any:
        try:
            return self._idle.pop()
        except IndexError:
            return self.make()

    def give_back(self, connection: Any) -> bool:
        """Keep ``connection`` for the next lookup; False when enough are kept (close it)."""
        if len(self._idle) >= self.keep:
            return False
        self._idle.append(connection)
        return True

    def drain(self) -> list:
        """Every idle connection, forgotten (to close)."""
        idle, self._idle = self._idle, []
        return idle


class BatchedReads:
    """Lookups made in one turn of the event loop go to Redis together: one write and one read on
    one connection for all of them, replies handed back in order (ioredis calls it
    auto-pipelining). Under concurrent requests the server and Redis then wake once per batch,
    not once per lookup. The first lookup of a turn yields once, then sends the batch and hands
    the others their replies. At most ``MAX_ASYNC_READS`` batches are in flight (connections in
    use); a batch fails after ``timeout`` to 1.25x ``timeout`` seconds (TimeoutError: an OSError)."""

    Batch = list[
        tuple[bytes, int, "asyncio.Future | None"]
    ]  # (commands, reply count, joiner's future; None: the sender's)

    def __init__(self, readers: ReadConnections, timeout: float):
        self.readers, self.timeout = readers, timeout
        self._pending: BatchedReads.Batch | None = None
        self._slots = asyncio.Semaphore(MAX_ASYNC_READS)
        self._deadlines: dict[asyncio.Task, float] = {}  # sending tasks -> loop time they time out at
        self._expired: set[asyncio.Task] = set()  # those the watchdog cancelled
        self._watching = False

    async def read(self, packed: bytes, count: int) -> list:
        """The ``count`` replies to the commands in ``packed``."""
        if self._pending is not None:  # a batch is forming: join it
            future = asyncio.get_running_loop().create_future()
            self._pending.append((packed, count, future))
            return await future
        batch: BatchedReads.Batch = [(packed, count, None)]
        self._pending = batch
        try:
            await asyncio.sleep(0)  # the lookups of this turn join
        except BaseException:  # cancelled before sending: the joiners retry
            _fail(batch, redis.ConnectionError("the batch's sender was cancelled"))
            raise
        finally:
            self._pending = None
        return await self._exchange(batch)

    async def _exchange(self, batch: BatchedReads.Batch) -> list:
        """Send ``batch``; resolve every joiner's future, whatever happens; return the sender's replies."""
        own: list = []
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self._deadlines[task] = loop.time() + self.timeout
        if not self._watching:
            self._watching = True
            loop.call_later(self.timeout / 4, self._watch, loop)
        try:
            async with self._slots:
                connection = self.readers.take()
                try:
                    await connection.send_packed_command([packed for packed, _, _ in batch], check_health=False)
                    for _, count, future in batch:
                        replies = []
                        for _ in range(count):
                            try:
                                replies.append(await connection.read_response())
                            except redis.ResponseError as exc:  # that lookup's error; the replies after it still come
                                replies.append(exc)
                        if future is None:
                            own = replies
                        elif not future.done():  # (its caller may have gone)
                            _settle(future, replies)
                except BaseException:
                    await connection.disconnect()  # replies may be left unread: never reuse it
                    raise
                if not self.readers.give_back(connection):
                    await connection.disconnect()
        except asyncio.CancelledError:
            del self._deadlines[task]  # (the watchdog must not cancel the clean-up)
            if task not in self._expired:  # the caller's cancellation: a joiner retries once on a ConnectionError
                await self._abandon(batch, redis.ConnectionError("the batch's sender was cancelled"))
                raise
            self._expired.discard(task)  # the watchdog's: a timeout (an OSError), for the sender and its joiners
            task.uncancel()
            timeout = TimeoutError(f"Redis did not answer within {self.timeout:g} s")
            await self._abandon(batch, timeout)
            raise timeout from None
        except BaseException as exc:
            del self._deadlines[task]
            await self._abandon(
                batch, exc if isinstance(exc, Exception) else redis.ConnectionError("the batch's sender was stopped")
            )
            raise
        self._deadlines.pop(task)
        error = _first_error(own)
        if error is not None:
            raise error
        return own

    async def _abandon(self, batch: BatchedReads.Batch, error: Exception) -> None:
        for idle in self.readers.drain():  # connected to the same server: as stale
            await idle.disconnect()
        _fail(batch, error)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the batches past their deadline. One timer for all batches in flight (an
        ``asyncio.timeout`` per batch cost ~4 µs of a lookup's ~80): a batch times out within
        1.25x ``timeout``."""
        now = loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        if self._deadlines:
            loop.call_later(self.timeout / 4, self._watch, loop)
        else:
            self._watching = False


def _fail(batch: BatchedReads.Batch, error: Exception) -> None:
    for _, _, future in batch:
        if future is not None and not future.done():
            future.set_exception(error)


def _first_error(replies: list) -> Exception | None:
    """A lookup's first error reply (its other replies are then of no use)."""
    return next((r for r in replies if isinstance(r, Exception)), None)


def _settle(future: asyncio.Future, replies: list) -> None:
    error = _first_error(replies)
    if error is None:
        future.set_result(replies)
    else:
        future.set_exception(error)


class Script:
    """A Lua script's text and SHA-1, as EVALSHA needs them."""

    def __init__(self, code: str):
        self.code = code
        self.sha = hashlib.sha1(code.encode()).hexdigest()


class RedisOnlineStore:
    def __init__(self, url: str, project: str, embedded: EmbeddedRedis | None = None, read_timeout_ms: int = 500):
        self.url = url
        self.safe_url = redact(url, url)  # for messages and logs: never the password
        self.read_timeout_ms = read_timeout_ms
        self.project = project
        self.embedded = embedded
        self.client = self._connect()
        self._async: aioredis.Redis | None = None
        self._readers: ReadConnections | None = None
        self._batched: BatchedReads | None = None
        self._batched_loop: asyncio.AbstractEventLoop | None = None  # the event loop it serves
        self._scripts = {
            name: Script(code)
            for name, code in (
                ("write", WRITE_IF_NEWER),
                ("add_events", ADD_EVENTS),
                ("keep_max", KEEP_MAX),
                ("read_window", READ_WINDOW),
                ("seal", SEAL_TILES),
            )
        }
        self._recovering: asyncio.Future | None = None

    @classmethod
    def from_config(cls, config: RepoConfig) -> RedisOnlineStore:
        if config.embedded_redis:
            embedded = EmbeddedRedis(config.data_dir)
            return cls(embedded.ensure_running(), config.project, embedded, config.read_timeout_ms)
        return cls(config.online_url, config.project, read_timeout_ms=config.read_timeout_ms)

    @property
    def prefix(self) -> bytes:
        return key_prefix(self.project)

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

        def calls() -> Iterator[Call]:  # encoded a chunk at a time: Redis runs one while the next is encoded
            for i in range(0, rows.num_rows, CHUNK):
                part = rows.slice(i, CHUNK)
                yield (
                    "write",
                    entity_keys(self.project, part, join_keys),
                    [view, ttl_ms],
                    [encode_values(part, features)],
                )

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
    ) -> int:
        """Apply event writes (history rows, in write order) to their entities' events: each is kept
        unless an earlier write of its id is less than ``dedup_us`` away (or, with ``accepted``, as
        the history's rule decided); one before ``cutoff_us`` only records its time; older events
        are trimmed (``ADD_EVENTS``). Returns how many events were added."""
        if rows.num_rows == 0:
            return 0
        horizon_ms = horizon // timedelta(milliseconds=1)
        suffix = events_key(b"", view)
        verdicts = accepted is not None

        def calls() -> Iterator[Call]:  # encoded a chunk at a time: Redis runs one while the next is encoded
            for i in range(0, rows.num_rows, CHUNK):
                part = rows.slice(i, CHUNK)
                scores = decimal(numpy_values(part["event_timestamp"]).view(np.int64))
                columns = [scores, encode_events(part, features, event_ids[i : i + CHUNK])]
                if verdicts:
                    columns.append(pa.array([b"1" if a else b"0" for a in accepted[i : i + CHUNK]], pa.binary()))
                yield (
                    "add_events",
                    suffixed(entity_keys(self.project, part, join_keys), suffix),
                    [cutoff_us, horizon_ms, horizon_ms // 16, tile_us, dedup_us, int(verdicts)],
                    columns,
                )

        return sum(self._run(calls, newest))

    def read(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        """Each lookup's values (HMGET), then each range's events (ZRANGEBYSCORE), in one round trip."""
        packed, count = resp.reads(lookups, ranges), len(lookups) + len(ranges)
        if self._readers is None:
            pool = self.client.connection_pool
            self._readers = ReadConnections(lambda: pool.connection_class(**pool.connection_kwargs))
        readers = self._readers
        for attempt in (1, 2):  # a connection Redis dropped (a restart) fails once; reads are safe to resend
            connection = readers.take()
            try:
                connection.send_packed_command([packed], check_health=False)
                replies = [connection.read_response() for _ in range(count)]
            except BaseException as exc:
                connection.disconnect()  # replies may be left unread: never reuse it
                if not isinstance(exc, UNAVAILABLE):
                    raise
                for idle in readers.drain():  # connected to the same server: as stale
                    idle.disconnect()
                if attempt == 1 and isinstance(exc, redis.ConnectionError):
                    continue
                raise self.unavailable(exc) from exc
            if not readers.give_back(connection):
                connection.disconnect()
            return replies
        raise AssertionError("unreachable")

    def _connect(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=30)

    def _connect_async(self, timeout: float) -> aioredis.Redis:
        return aioredis.Redis.from_url(
            self.url, socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=256
        )

    @property
    def async_client(self) -> aioredis.Redis:
        if self._async is None:
            # short: during an outage a request answers 503 in about this long, never hangs the server
            self._async = self._connect_async(self.read_timeout_ms / 1000)
        return self._async

    async def read_async(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        """``read`` on the event loop, batched with the other lookups of the same loop turn."""
        loop = asyncio.get_running_loop()
        if self._batched is None or self._batched_loop is not loop:  # connections and timers belong to one loop
            pool = self.async_client.connection_pool
            # no per-call timeouts (redis-py makes a task or a timer for every send and reply): BatchedReads' watchdog
            untimed = {**pool.connection_kwargs, "socket_timeout": None}
            self._batched = BatchedReads(
                ReadConnections(lambda: pool.connection_class(**untimed)), self.read_timeout_ms / 1000
            )
            self._batched_loop = loop
        batched = self._batched
        packed, count = resp.reads(lookups, ranges), len(lookups) + len(ranges)
        for attempt in (1, 2):  # as ``read``: a connection Redis dropped fails once
            try:
                return await batched.read(packed, count)
            except UNAVAILABLE as exc:
                if attempt == 1 and isinstance(exc, redis.ConnectionError):
                    continue
                self._recover_in_background()
                raise self._error(exc) from exc
        raise AssertionError("unreachable")

    def _recover(self) -> None:
        """An embedded server whose owner exited is restarted by whoever notices."""
        if self.embedded is not None:
            try:
                self.embedded.ensure_running()
            except OnlineStoreUnavailable:
                pass

    def _recover_in_background(self) -> None:
        """``_recover`` off the event loop, one at a time: the failing request answers 503 at once
        and the others keep being served (a blocking restart froze the whole server for seconds)."""
        if self.embedded is None or self._recovering is not None and not self._recovering.done():
            return
        self._recovering = asyncio.get_running_loop().run_in_executor(None, self._recover)

    def ping(self) -> bool:
        with self._calling():
            return bool(self.client.ping())

    async def ping_async(self) -> bool:
        try:
            return bool(await self.async_client.ping())
        except (redis.RedisError, OSError) as exc:
            self._recover_in_background()
            raise self._error(exc) from exc

    def _run(self, calls: Callable[[], Iterable[Call]], newest: tuple[str, int] | None) -> list:
        """Run script calls ``(script, keys, arguments, per-key arguments)`` in one round trip, then
        note the view's newest event time (kept as a maximum: it never moves back; the servers
        export its age as per-view freshness); returns the calls' results.

        Each call is packed in bulk (``resp``) and sent as soon as ``calls`` yields it, so Redis
        runs one while the next is encoded. EVALSHA straight away (redis-py's scripts ask SCRIPT
        EXISTS first: a round trip more per write); a Redis that lost its scripts (a restart)
        gets them, and the calls, all idempotent, run again."""
        noted = [("keep_max", [self.prefix + b"newest"], list(newest), [])] if newest is not None else []
        for attempt in (1, 2):
            results = self._send(itertools.chain(calls(), noted))
            if attempt == 1 and any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                with self._calling():
                    for script in self._scripts.values():
                        self.client.script_load(script.code)
                continue
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise errors[0]
            return results[: len(results) - len(noted)]
        raise AssertionError("unreachable")

    def _command(self, name: str, keys: pa.Array | list, args: list, per_key: list[pa.Array]) -> bytes:
        return resp.command("EVALSHA", self._scripts[name].sha, len(keys), _array(keys), *args, *per_key)

    def _send(self, calls: Iterable[Call]) -> list:
        """Send each call as it comes, then read the replies (errors as values)."""
        pool = self.client.connection_pool
        try:
            connection = pool.get_connection()  # (connects: a Redis that is down fails here)
        except UNAVAILABLE as exc:
            raise self.unavailable(exc) from exc
        try:
            sent = 0
            for name, keys, args, per_key in calls:
                connection.send_packed_command([self._command(name, keys, args, per_key)])
                sent += 1
            results: list = []
            for _ in range(sent):
                try:
                    results.append(connection.read_response())
                except redis.ResponseError as exc:
                    results.append(exc)
            return results
        except UNAVAILABLE as exc:
            connection.disconnect()
            raise self.unavailable(exc) from exc
        finally:
            pool.release(connection)

    def _error(self, exc: BaseException) -> OnlineStoreUnavailable:
        """What a failed call raises: the store's error (a 503 on the servers), never redis-py's."""
        return OnlineStoreUnavailable(f"Redis at {self.safe_url} is unreachable: {redact(str(exc), self.url)}")

    def unavailable(self, exc: BaseException) -> OnlineStoreUnavailable:
        """``_error``, an embedded server that died restarted first (by whoever notices)."""
        self._recover()
        return self._error(exc)

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        try:
            yield
        except UNAVAILABLE as exc:
            raise self.unavailable(exc) from exc

    def read_tiles(self, windows: Sequence[TiledRange]) -> list:
        """Each heavy entity's ``[tile summaries, edge events]`` (``READ_WINDOW``)."""
        return self._run(lambda: (("read_window", [key], list(arguments), []) for key, arguments in windows), None)

    async def read_tiles_async(self, windows: Sequence[TiledRange]) -> list:
        """``read_tiles`` on the event loop: one round trip for all the windows."""
        if len(windows) == 1:
            return [await self._evalsha_async("read_window", windows[0][0], *windows[0][1])]
        script = self._scripts["read_window"]
        for attempt in (1, 2):
            pipe = self.async_client.pipeline(transaction=False)
            for key, arguments in windows:
                pipe.evalsha(script.sha, 1, key, *arguments)
            try:
                return await pipe.execute()
            except redis.exceptions.NoScriptError:  # a Redis that lost its scripts (a restart)
                if attempt == 2:
                    raise
                await self.async_client.script_load(script.code)
            except UNAVAILABLE as exc:
                raise self._error(exc) from exc
        raise AssertionError("unreachable")

    async def _evalsha_async(self, name: str, key: bytes, *arguments: Any) -> Any:
        script = self._scripts[name]
        try:
            return await self.async_client.evalsha(script.sha, 1, key, *arguments)
        except redis.exceptions.NoScriptError:  # a Redis that lost its scripts (a restart)
            await self.async_client.script_load(script.code)
            return await self.async_client.evalsha(script.sha, 1, key, *arguments)
        except UNAVAILABLE as exc:
            raise self._error(exc) from exc

    def seal(self, seals: Sequence[Seal]) -> None:
        """Store tile summaries (``SEAL_TILES``: only where the tile still holds what was summarized)."""
        self._run(lambda: (("seal", [key], [tile_us, *_flat(tiles)], []) for key, tile_us, tiles in seals), None)

    async def seal_async(self, seals: Sequence[Seal]) -> None:
        """``seal`` on the event loop."""
        for key, tile_us, tiles in seals:
            await self._evalsha_async("seal", key, tile_us, *_flat(tiles))

    def newest(self) -> dict[str, int]:
        """``{view: newest event time written online, µs since the epoch}``."""
        with self._calling():
            return {k.decode(): int(v) for k, v in self.client.hgetall(self.prefix + b"newest").items()}

    async def newest_async(self) -> dict[str, int]:
        """``{view: newest event time written online, µs since the epoch}``."""
        return {k.decode(): int(v) for k, v in (await self.async_client.hgetall(self.prefix + b"newest")).items()}

    def first_use(self, key: str, fingerprint: str, now_us: int, keep_seconds: int) -> tuple[int, str]:
        """Record ``(now_us, fingerprint)`` under an idempotency key unless already there; return what is
        recorded (a retry gets the first attempt's time and fingerprint)."""
        name = self.prefix + b"idem:" + key.encode()
        with self._calling():
            recorded = self.client.eval(FIRST_USE, 1, name, f"{now_us}:{fingerprint}", keep_seconds).decode()
        first, _, recorded_fingerprint = recorded.partition(":")
        return int(first), recorded_fingerprint

    def publish(self, channel: bytes, message: str) -> None:
        """Broadcast to every subscribed server (model promotions)."""
        with self._calling():
            self.client.publish(self.prefix + channel, message)

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``, as they come; raises when Redis goes away."""
        async for message in listen(self.async_client, self.prefix + channel):
            yield message

    def drop_view(self, view: str) -> None:
        """Delete every stored layout of the view (fields and event keys named ``view#<layout>``)."""
        with self._calling():
            self._drop_view(view)

    def _drop_view(self, view: str) -> None:
        marker = view.encode() + b"#"
        for key in self.client.scan_iter(match=glob_escaped(self.prefix) + b"*", count=1000):
            if not key.startswith(self.prefix):  # (exact: the pattern is escaped, this is the proof)
                continue
            tail = key.rsplit(b":", 1)[-1]
            if tail.startswith(marker):  # an events or event-ids key
                self.client.delete(key)
            elif key.endswith(b"}"):
                fields = [f for f in self.client.hkeys(key) if f.startswith(marker)]
                if fields:
                    self.client.hdel(key, *fields)

    def close(self) -> None:
        for connection in self._readers.drain() if self._readers else []:
            connection.disconnect()
        self.client.close()
        if self.embedded is not None:
            self.embedded.stop()


def _flat(tiles: Sequence[tuple[int, int, bytes]]) -> list:
    return [x for tile in tiles for x in tile]
