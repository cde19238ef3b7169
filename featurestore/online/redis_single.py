"""One Redis node (the embedded redis-server, any ``redis://`` / ``rediss://`` URL, or the master
Sentinel names: ``redis_sentinel``) as a transport.

Script calls go down one connection, each sent as soon as it is packed, so Redis runs one while
the next is encoded; then the replies are read. Lookups are one round trip of HMGETs and
ZRANGEBYSCOREs on a connection of their own; on the servers the lookups of one event-loop turn
share it (``batched_reads``). A connection Redis dropped (a restart) fails once: reads are safe
to resend, so they are. An embedded server that died is restarted by whoever notices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis

from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.base import Lookup, Range, TiledRange
from featurestore.online.batched_reads import BatchedReads, ReadConnections
from featurestore.online.embedded import EmbeddedRedis
from featurestore.online.transport import (
    UNAVAILABLE,
    Call,
    ReplicaWait,
    evalsha,
    listen,
    packed_reads,
    redact,
    unavailable,
    under_way,
)

# redis-py's clients of the node: (asynchronous, replica, the clients' options) -> a client (of
# one of its replicas, where it has any and ``replica``); their connections are made as the
# client's pool makes its own (``connection_class``)
Clients = Callable[..., Any]


def url_clients(url: str) -> Clients:
    """The clients of the Redis at ``url`` (its replicas unknown: the node's own)."""

    def make(asynchronous: bool, replica: bool = False, **options: Any) -> Any:
        return (aioredis.Redis if asynchronous else redis.Redis).from_url(url, **options)

    return make


class SingleRedis:
    """A ``Transport`` to one Redis node."""

    failures: tuple[type[BaseException], ...] = UNAVAILABLE

    def __init__(
        self,
        url: str,
        read_timeout_ms: int = 500,
        embedded: EmbeddedRedis | None = None,
        clients: Clients | None = None,
        password_form: str = "redis://[user]:password@host:port (percent-encoded)",
        replica_wait: ReplicaWait | None = None,
        read_from_replicas: bool = False,
    ):
        self.url = url
        self.safe_url = redact(url, url)
        self.read_timeout_ms = read_timeout_ms
        self.embedded = embedded
        self._clients = clients or url_clients(url)
        self._password_form = password_form  # (where a password goes, in an error that says one was refused)
        self.replica_wait = replica_wait
        self.read_from_replicas = read_from_replicas  # lookups read a replica (may lag the master)
        self.client = self._clients(False, socket_timeout=30)
        # (the client whose pool the reads' connections are made as: kept, its connections refer to it)
        self._read_client: Any = self._clients(False, True, socket_timeout=30) if read_from_replicas else self.client
        self._async_read_client: Any = None
        self._async: aioredis.Redis | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None  # the event loop its connections belong to
        self._readers: ReadConnections | None = None
        self._batched: BatchedReads | None = None
        self._batched_loop: asyncio.AbstractEventLoop | None = None  # the event loop it serves
        self._recovering: asyncio.Future | None = None

    @property
    def async_client(self) -> aioredis.Redis:
        """(A new one on each event loop: a connection belongs to the loop it was made on.)"""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async_loop = loop
            # short: during an outage a request answers 503 in about this long, never hangs the server
            timeout = self.read_timeout_ms / 1000
            self._async = self._clients(
                True, socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=256
            )
        return self._async

    def order(self, keys: pa.Array) -> np.ndarray | None:
        return None

    def send(self, calls: Iterable[Call]) -> list:
        pool = self.client.connection_pool
        try:
            connection = pool.get_connection()  # (connects: a Redis that is down fails here)
        except UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        try:
            sent = 0
            for call in calls:
                connection.send_packed_command([evalsha(call)])
                sent += 1
            if self.replica_wait is not None:
                connection.send_packed_command([self.replica_wait.command])
            results: list = []
            for _ in range(sent + (self.replica_wait is not None)):
                try:
                    results.append(connection.read_response())
                except redis.ResponseError as exc:
                    results.append(exc)
            if self.replica_wait is not None:
                self.replica_wait.check(results.pop(), f"Redis at {self.safe_url}")
            return results
        except UNAVAILABLE as exc:
            connection.disconnect()
            raise self._unavailable(exc) from exc
        finally:
            pool.release(connection)

    def read(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        packed, count = packed_reads(lookups, ranges, windows, summaries)
        if self._readers is None:
            pool = self._read_client.connection_pool
            self._readers = ReadConnections(lambda: pool.connection_class(**pool.connection_kwargs))
        readers = self._readers
        for attempt in (1, 2):  # a connection Redis dropped (a restart) fails once; reads are safe to resend
            connection = readers.take()
            try:
                if not connection.is_connected:  # (as a pool does: a Sentinel-managed one asks for the master)
                    connection.connect()
                connection.send_packed_command([packed], check_health=False)
                replies = []
                for _ in range(count):
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:  # (a script Redis lost: the replies after it still come)
                        replies.append(exc)
            except BaseException as exc:
                connection.disconnect()  # replies may be left unread: never reuse it
                if not isinstance(exc, UNAVAILABLE):
                    raise
                for idle in readers.drain():  # connected to the same server: as stale
                    idle.disconnect()
                if attempt == 1 and isinstance(exc, redis.ConnectionError):
                    continue
                raise self._unavailable(exc) from exc
            if not readers.give_back(connection):
                connection.disconnect()
            error = next((r for r in replies if isinstance(r, Exception)), None)
            if error is not None:
                raise error
            return replies
        raise AssertionError("unreachable")

    async def read_async(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        """``read``, batched with the other lookups of the same loop turn."""
        loop = asyncio.get_running_loop()
        if self._batched is None or self._batched_loop is not loop:  # connections and timers belong to one loop
            client = self.async_client
            if self.read_from_replicas:
                timeout = self.read_timeout_ms / 1000
                client = self._clients(True, True, socket_timeout=timeout, socket_connect_timeout=timeout)
            self._async_read_client, pool = client, client.connection_pool
            # no per-call timeouts (redis-py makes a task or a timer for every send and reply): BatchedReads' watchdog
            untimed = {**pool.connection_kwargs, "socket_timeout": None}
            self._batched = BatchedReads(
                ReadConnections(lambda: pool.connection_class(**untimed)), self.read_timeout_ms / 1000
            )
            self._batched_loop = loop
        batched = self._batched
        packed, count = packed_reads(lookups, ranges, windows, summaries)
        for attempt in (1, 2):  # as ``read``: a connection Redis dropped fails once
            try:
                return await batched.read(packed, count)
            except UNAVAILABLE as exc:
                if attempt == 1 and isinstance(exc, redis.ConnectionError):
                    continue
                self.recover_in_background()
                raise self.error(exc) from exc
        raise AssertionError("unreachable")

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        async for message in listen(self.async_client, channel):
            yield message

    def each_node(self, *command: str) -> list:
        try:
            return [self.client.execute_command(*command)]
        except UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc

    def error(self, exc: BaseException) -> OnlineStoreUnavailable:
        return unavailable("Redis", self.url, exc, self._password_form)

    def _unavailable(self, exc: BaseException) -> OnlineStoreUnavailable:
        self.recover()
        return self.error(exc)

    def recover(self) -> None:
        if self.embedded is not None:
            try:
                self.embedded.ensure_running()
            except OnlineStoreUnavailable:
                pass

    def recover_in_background(self) -> None:
        """The failing request answers 503 at once and the others keep being served (a blocking
        restart froze the whole server for seconds)."""
        loop = asyncio.get_running_loop()
        if self.embedded is None or under_way(self._recovering, loop):
            return
        self._recovering = loop.run_in_executor(None, self.recover)

    def close(self) -> None:
        for connection in self._readers.drain() if self._readers else []:
            connection.disconnect()
        self.client.close()
        if self.embedded is not None:
            self.embedded.stop()
