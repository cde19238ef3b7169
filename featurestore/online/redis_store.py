"""Online store on Redis (embedded redis-server by default, or any ``redis://``/``rediss://`` URL).

Writes go through a Lua script so the compare-and-set is atomic in Redis: concurrent
materializations or pushes cannot regress a value. Events of aggregated views are added by
another script, once per event id. Reads are one pipelined round trip of HMGETs (latest
values) and ZRANGEBYSCOREs (window events). Layout: see ``featurestore.online.codec``.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from typing import AsyncIterator, Sequence

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis

from featurestore.config import RepoConfig
from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.base import Lookup, Range
from featurestore.online.codec import encode_events, encode_values, entity_keys, event_ids_key, events_key, key_prefix
from featurestore.online.resp import suffixed
from featurestore.online import resp
from featurestore.online.embedded import EmbeddedRedis

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

# KEYS: (events key, event ids key) per event; ARGV[1]: cutoff µs (events before it are trimmed);
# ARGV[2]: horizon ms (keys expire that long after their newest event); ARGV[3]: slack ms;
# ARGV[i+3]: the member of event i (8-byte id, then the value whose first 8 bytes are the
# sign-flipped event µs). The caller sends only events at or after the cutoff. An event is
# added only if its id is new: retries and replays never count twice. Expiry is pushed out to
# newest + horizon + slack whenever newest + horizon passes it, so a stream of events refreshes
# it (and trims old events) once per slack, not per event: storage stays within horizon + slack.
# µs fit a double exactly (< 2^53), and numbers are written with %.0f, never Lua's lossy default.
KEEP_MAX = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or tonumber(current) < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
"""

ADD_EVENTS = """
local cutoff = '(' .. ARGV[1]
local horizon_ms, slack_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local added = 0
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #KEYS, 2 do
  local events, ids = KEYS[i], KEYS[i + 1]
  local member = ARGV[(i + 1) / 2 + 3]
  if redis.call('HSETNX', ids, string.sub(member, 1, 8), '') == 1 then
    local hi, lo = struct.unpack('>I4I4', member, 9)
    local us = (hi - 2147483648) * 4294967296 + lo
    redis.call('ZADD', events, string.format('%.0f', us), member)
    added = added + 1
    local expire_at = math.floor(us / 1000) + horizon_ms
    local pttl = redis.call('PTTL', events)
    if pttl < 0 or now_ms + pttl < expire_at then
      local at = string.format('%.0f', expire_at + slack_ms)
      redis.call('PEXPIREAT', events, at)
      redis.call('PEXPIREAT', ids, at)
      while true do
        local old = redis.call('ZRANGEBYSCORE', events, '-inf', cutoff, 'LIMIT', 0, 500)
        if #old == 0 then break end
        for _, o in ipairs(old) do redis.call('HDEL', ids, string.sub(o, 1, 8)) end
        redis.call('ZREM', events, unpack(old))
      end
    end
  end
end
return added
"""

def redact(text: str, url: str) -> str:
    """``text`` with the password of ``url`` (``redis://user:secret@host``) replaced by ``***``."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(url).password
    except ValueError:
        return text
    return text.replace(password, "***") if password else text


def _queue(pipe, lookups: Sequence[Lookup], ranges: Sequence[Range]):
    """One round trip: an HMGET per lookup, then a ZRANGEBYSCORE ``(low, high]`` per event range."""
    for key, fields in lookups:
        pipe.hmget(key, fields)
    for key, low, high in ranges:
        pipe.zrangebyscore(key, f"({low}", high)
    return pipe


CHUNK = 2000  # rows per script call: bounded Redis latency for other clients


def _array(values: pa.Array | list) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, pa.binary())


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
        self.client = redis.Redis.from_url(url, socket_timeout=30)
        self._async: aioredis.Redis | None = None
        self._scripts = {name: Script(code) for name, code in
                         (("write", WRITE_IF_NEWER), ("add_events", ADD_EVENTS), ("keep_max", KEEP_MAX))}
        self._recovering: asyncio.Future | None = None

    @classmethod
    def from_config(cls, config: RepoConfig) -> "RedisOnlineStore":
        if config.embedded_redis:
            embedded = EmbeddedRedis(config.data_dir)
            return cls(embedded.ensure_running(), config.project, embedded, config.read_timeout_ms)
        return cls(config.online_url, config.project, read_timeout_ms=config.read_timeout_ms)

    @property
    def prefix(self) -> bytes:
        return key_prefix(self.project)

    def write_latest(self, view: str, rows: pa.Table, join_keys: Sequence[str], features: Sequence, expire_after: timedelta | None = None,
                     newest: tuple[str, int] | None = None) -> int:
        """Compare-and-set each entity's row; with ``expire_after``, keys expire once their data is too old to serve.
        ``newest``: (view name, newest event time in µs) for per-view freshness, sent in the same round trip."""
        if rows.num_rows == 0:
            return 0
        keys = entity_keys(self.project, rows, join_keys)
        values = encode_values(rows, features)
        ttl_ms = int(expire_after.total_seconds() * 1000) if expire_after else 0
        calls = [("write", keys[i:i + CHUNK], [view, ttl_ms], values[i:i + CHUNK]) for i in range(0, len(keys), CHUNK)]
        return sum(self._run(calls, newest))

    def write_events(
        self, view: str, rows: pa.Table, join_keys: Sequence[str], features: Sequence, event_ids: np.ndarray,
        cutoff_us: int, horizon: timedelta, newest: tuple[str, int] | None = None,
    ) -> int:
        """Add events (history rows at or after ``cutoff_us``) to their entities' sorted sets, once
        per event id; older events are trimmed. Returns how many were new."""
        if rows.num_rows == 0:
            return 0
        keys = suffixed(entity_keys(self.project, rows, join_keys), events_key(b"", view), event_ids_key(b"", view))
        members = encode_events(rows, features, event_ids)
        horizon_ms = horizon // timedelta(milliseconds=1)
        calls = [("add_events", keys[2 * i:2 * (i + CHUNK)], [cutoff_us, horizon_ms, horizon_ms // 16], members[i:i + CHUNK])
                 for i in range(0, len(members), CHUNK)]
        return sum(self._run(calls, newest))

    def read(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        try:
            if len(lookups) == 1 and not ranges:  # one command needs no pipeline
                key, fields = lookups[0]
                return [self.client.hmget(key, fields)]
            return _queue(self.client.pipeline(transaction=False), lookups, ranges).execute()
        except redis.ConnectionError as exc:
            self._recover()
            raise OnlineStoreUnavailable(f"Redis at {self.safe_url} is unreachable: {redact(str(exc), self.url)}") from exc

    @property
    def async_client(self) -> aioredis.Redis:
        if self._async is None:
            # short: during an outage a request answers 503 in about this long, never hangs the server
            timeout = self.read_timeout_ms / 1000
            self._async = aioredis.Redis.from_url(self.url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                  max_connections=256)
        return self._async

    async def read_async(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        try:
            if len(lookups) == 1 and not ranges:
                key, fields = lookups[0]
                return [await self.async_client.hmget(key, fields)]
            return await _queue(self.async_client.pipeline(transaction=False), lookups, ranges).execute()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._recover_in_background()
            raise OnlineStoreUnavailable(f"Redis at {self.safe_url} is unreachable: {redact(str(exc), self.url)}") from exc

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
        return bool(self.client.ping())

    async def ping_async(self) -> bool:
        try:
            return bool(await self.async_client.ping())
        except (redis.RedisError, OSError) as exc:
            self._recover_in_background()
            raise OnlineStoreUnavailable(f"Redis at {self.safe_url} is unreachable: {redact(str(exc), self.url)}") from exc

    def _run(self, calls: list[tuple[str, pa.Array | list, list, pa.Array | list]], newest: tuple[str, int] | None) -> list:
        """Run script calls ``(script, keys, arguments, per-key arguments)`` in one round trip, then
        note the view's newest event time (kept as a maximum: it never moves back; the servers
        export its age as per-view freshness); returns the calls' results.

        Commands are packed in bulk (``resp``) and each sent as soon as it is packed, so Redis runs
        one while the next is packed. EVALSHA straight away (redis-py's scripts ask SCRIPT EXISTS
        first: a round trip more per write); a Redis that lost its scripts (a restart) gets them,
        and the calls, all idempotent, run again."""
        if newest is not None:
            calls = [*calls, ("keep_max", [self.prefix + b"newest"], list(newest), [])]
        for attempt in (1, 2):
            results = self._send(calls)
            missing = [r for r in results if isinstance(r, redis.exceptions.NoScriptError)]
            if missing and attempt == 1:
                for name in {name for name, *_ in calls}:
                    self.client.script_load(self._scripts[name].code)
                continue
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise errors[0]
            return results[:len(calls) - (newest is not None)]
        raise AssertionError("unreachable")

    def _send(self, calls: list) -> list:
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            for name, keys, args, per_key in calls:
                connection.send_packed_command([resp.command(
                    "EVALSHA", self._scripts[name].sha, len(keys), _array(keys), *args, _array(per_key))])
            results: list = []
            for _ in calls:
                try:
                    results.append(connection.read_response())
                except redis.ResponseError as exc:
                    results.append(exc)
            return results
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            connection.disconnect()
            raise OnlineStoreUnavailable(f"Redis at {self.safe_url} is unreachable: {redact(str(exc), self.url)}") from exc
        finally:
            pool.release(connection)

    async def newest_async(self) -> dict[str, int]:
        """``{view: newest event time written online, µs since the epoch}``."""
        return {k.decode(): int(v) for k, v in (await self.async_client.hgetall(self.prefix + b"newest")).items()}

    def first_use(self, key: str, fingerprint: str, now_us: int, keep_seconds: int) -> tuple[int, str]:
        """Record ``(now_us, fingerprint)`` under an idempotency key unless already there; return what is
        recorded (a retry gets the first attempt's time and fingerprint)."""
        name = self.prefix + b"idem:" + key.encode()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(name, f"{now_us}:{fingerprint}", nx=True, ex=keep_seconds)
        pipe.get(name)
        recorded = pipe.execute()[1].decode()
        first, _, recorded_fingerprint = recorded.partition(":")
        return int(first), recorded_fingerprint

    def publish(self, channel: bytes, message: str) -> None:
        """Broadcast to every subscribed server (model promotions)."""
        self.client.publish(self.prefix + channel, message)

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``, as they come; raises when Redis goes away."""
        pubsub = self.async_client.pubsub()
        await pubsub.subscribe(self.prefix + channel)
        try:
            async for message in pubsub.listen():
                if message["type"] == "message":
                    yield message["data"].decode()
        finally:
            await pubsub.aclose()

    def drop_view(self, view: str) -> None:
        """Delete every stored layout of the view (fields and event keys named ``view#<layout>``)."""
        marker = view.encode() + b"#"
        for key in self.client.scan_iter(match=self.prefix + b"*", count=1000):
            tail = key.rsplit(b":", 1)[-1]
            if tail.startswith(marker):  # an events or event-ids key
                self.client.delete(key)
            elif key.endswith(b"}"):
                fields = [f for f in self.client.hkeys(key) if f.startswith(marker)]
                if fields:
                    self.client.hdel(key, *fields)

    def close(self) -> None:
        self.client.close()
        if self.embedded is not None:
            self.embedded.stop()
