"""Redis Cluster as a transport: the same keys, values and scripts as one node.

``online_store: {type: redis_cluster, nodes: [host:port, ...]}`` or ``url: redis+cluster://h:p,h:p``
(``rediss+cluster://h:p,h:p?ssl_ca_certs=...``: TLS on every connection, as ``rediss://``).
Keys carry a hash tag per entity (``{card_id=42}``), so all of an entity's views and events
live on one slot. Writes are split by master: a call's keys, ordered by slot, are cut where
the master changes, and each master runs its part as one script call over all the slots it
holds (its keys undeclared, ahead of the arguments: declared keys must share one slot; see
``online.lua``), framed once per call (``resp.sliced``) and sent in one buffer per master,
every master fed at once by a thread of its own, so the masters work concurrently. Reads are
routed by the same slot map: each node's commands packed in one buffer, sent to every node it
touches before any reply is read, on connections of their own (on the servers, batched per node
with the other lookups of the loop turn, as on one node); from replicas too when
``read_from_replicas: true``. A read a node redirects (a slot moved or moving: MOVED / ASK) goes
again through redis-py's cluster pipeline, which follows redirections, and the slot map is read
again. While a master is failing over, its slots answer errors: the store raises
``OnlineStoreUnavailable`` (a 503), refreshes its slot map, and serves again once a replica has
taken over.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from featurestore.errors import OnlineStoreUnavailable
from featurestore.online import resp
from featurestore.online.base import CLUSTER_SCHEMES, Lookup, Range, TiledRange
from featurestore.online.batched_reads import BatchedReads, ReadConnections
from featurestore.online.lua import scripts
from featurestore.online.transport import (
    UNAVAILABLE,
    Call,
    ReplicaWait,
    as_binary,
    listen,
    read_commands,
    read_keys,
    redact,
    summary_keys,
    unavailable,
    under_way,
)

SCHEME, TLS_SCHEME = CLUSTER_SCHEMES
# what a ``rediss+cluster://`` URL's query may set (``rediss://``'s names, those every client of
# redis-py takes): files of PEM, whether to check the certificate and the host name in it
TLS_SETTINGS: dict[str, Callable[[str], Any]] = {
    "ssl_ca_certs": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": str,
    "ssl_check_hostname": lambda value: value.lower() not in ("false", "0", "no", "off"),
}
# what redis-py's cluster client raises while a master fails over: the usual errors, and from its
# pipelines and slot map now and then a lookup on a node that has just gone (seen under failover)
PIPELINE_FAILURES = (*UNAVAILABLE, AttributeError, KeyError, IndexError)
# replies of a node whose slots are moving or failing over (redis-py parses some into these), and
# what a script's own commands answer there: its keys undeclared, the node runs it and a command
# inside finds a key whose slot has left, the cluster down, or the node a replica now
NOT_HERE = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")
NOT_HERE_IN_SCRIPT = ("non local key", "while the cluster is down", "READONLY")
MOVING = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
)
REDIRECTED = redis.exceptions.AskError  # (MovedError is one)
Route = dict[str, list[int]]  # node name -> the indices of the commands it answers, in order


def _queue(
    pipe, lookups: Sequence[Lookup], ranges: Sequence[Range], windows: Sequence[TiledRange], summaries: Sequence[bytes]
):
    """An HMGET per lookup, each range's events, ``read_window.lua`` on each window (by command:
    redis-py blocks its EVALSHA method in cluster pipelines; the command routes by key), then the
    tile summaries of each events key in ``summaries``."""
    for key, fields in lookups:
        pipe.hmget(key, fields)
    for key, low, high, limit in ranges:
        if limit is None:
            pipe.zrangebyscore(key, f"({low}", high)
        else:
            pipe.zrangebyscore(key, f"({low}", high, start=0, num=limit)
    sha = scripts()["read_window"].sha
    for key, arguments in windows:
        pipe.execute_command("EVALSHA", sha, 1, key, *arguments)
    for key in summary_keys(summaries):
        pipe.hgetall(key)
    return pipe


def cluster_url(nodes: list[str]) -> str:
    """The URL form of a node list: ``redis+cluster://h1:p1,h2:p2``."""
    return SCHEME + ",".join(nodes)


def parse_nodes(url: str) -> list[tuple[str, int]]:
    nodes = []
    for item in filter(None, _netloc(url).rpartition("@")[2].split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redact(item, url)!r} in {redact(url, url)!r} is not host:port")
        nodes.append((host, int(port)))
    if not nodes:
        scheme = url.partition("://")[0]
        raise ValueError(f"{redact(url, url)!r} names no node; write {scheme}://host:port[,host:port...]")
    return nodes


def credentials(url: str) -> dict[str, Any]:
    """The username and password of ``redis+cluster://[user]:password@h:p,...`` (as ``redis://``
    writes them, percent-encoded), as redis-py's keyword arguments."""
    userinfo, at, _ = _netloc(url).rpartition("@")
    if not at:
        return {}
    user, colon, password = userinfo.partition(":")
    found = {"username": unquote(user)} if user else {}
    return {**found, "password": unquote(password)} if colon else found


def tls_settings(url: str) -> dict[str, Any] | None:
    """None for ``redis+cluster://``; for ``rediss+cluster://...[?ssl_ca_certs=...]`` the TLS
    settings of every connection to the nodes, as redis-py's keyword arguments (the query's, as
    ``rediss://`` takes them)."""
    query = parse_qs(urlsplit(url.replace("+cluster", "", 1)).query, keep_blank_values=True)
    unknown = sorted(set(query) - set(TLS_SETTINGS))
    if unknown or any(len(values) > 1 for values in query.values()):
        raise ValueError(
            f"{redact(url, url)!r}: {unknown or sorted(query)} in its query; a cluster's URL takes each of "
            f"{sorted(TLS_SETTINGS)} once, with {TLS_SCHEME}"
        )
    if not url.startswith(TLS_SCHEME):
        if query:
            raise ValueError(f"{redact(url, url)!r} sets TLS settings without TLS; write {TLS_SCHEME}")
        return None
    return {name: TLS_SETTINGS[name](values[0]) for name, values in query.items()}


def _netloc(url: str) -> str:
    return url.partition("://")[2].strip("/").split("/")[0].split("?")[0]


class ClusterRedis:
    """A ``Transport`` to a Redis Cluster: calls split by hash slot, each part to its slot's master."""

    failures: tuple[type[BaseException], ...] = PIPELINE_FAILURES

    def __init__(
        self,
        url: str,
        read_timeout_ms: int = 500,
        read_from_replicas: bool = False,
        replica_wait: ReplicaWait | None = None,
    ):
        self.url = url
        self.replica_wait = replica_wait
        self.safe_url = redact(url, url)
        self.nodes = parse_nodes(url)
        self.tls = tls_settings(url)
        # every connection's: the password, and TLS (a client's ``ssl`` turns it on; a connection's class does)
        self.credentials = credentials(url)
        self.secure = {"ssl": True, **self.tls} if self.tls is not None else {}
        self.read_timeout_ms = read_timeout_ms
        balancing = LoadBalancingStrategy.ROUND_ROBIN if read_from_replicas else None
        self._balancing = balancing
        # One attempt (Retry(NoBackoff(), 1)): during a failover a request answers 503 at once
        # rather than retrying past its timeout.
        try:  # (it reads the slot map from a node now)
            self.client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
                socket_timeout=30,
                retry=Retry(NoBackoff(), 1),
                load_balancing_strategy=balancing,
                **self.credentials,
                **self.secure,
            )
        except UNAVAILABLE as exc:
            raise self.error(exc) from exc
        self._async: aiocluster.RedisCluster | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None  # the event loop its connections belong to
        self._threads: ThreadPoolExecutor | None = None
        # (the slot map it was read from, each slot's node group as an index into the groups (-1:
        # none now) in numpy and as a list, the groups: the names of a slot's master, then its replicas)
        self._slot_table: tuple[object, np.ndarray, list[int], list[tuple[str, ...]]] | None = None
        self._turn = 0  # round robin over a slot's nodes, with read_from_replicas
        self._readers: dict[str, ReadConnections] = {}
        self._batched: dict[str, BatchedReads] = {}
        self._batched_loop: asyncio.AbstractEventLoop | None = None  # the event loop they serve
        self._refreshing: asyncio.Future | None = None

    @property
    def async_client(self) -> aiocluster.RedisCluster:
        """(A new one on each event loop: a connection belongs to the loop it was made on.)"""
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async_loop = loop
            timeout = self.read_timeout_ms / 1000
            self._async = aiocluster.RedisCluster(
                startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in self.nodes],
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=AsyncRetry(NoBackoff(), 1),
                load_balancing_strategy=self._balancing,
                **self.credentials,
                **self.secure,
            )
        return self._async

    def order(self, keys: pa.Array) -> np.ndarray | None:
        """By hash slot: each chunk of a write then spans a run of slots, held by one master or
        a few (a script call each); stable, so each entity's writes keep their order."""
        return np.argsort(_slots(keys), kind="stable")

    def read(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        """Each node's commands in one buffer, every node sent its own before a reply is read."""
        commands = read_commands(lookups, ranges, windows, summaries)
        connections: dict[str, Any] = {}
        try:
            route = self._route(read_keys(lookups, ranges, windows, summaries))
            for name, indices in route.items():
                connections[name] = self._node_readers(name).take()
                connections[name].send_packed_command([b"".join([commands[i] for i in indices])], check_health=False)
            replies: list = [None] * len(commands)
            for name, indices in route.items():
                for i in indices:
                    try:
                        replies[i] = connections[name].read_response()
                    except redis.ResponseError as exc:  # (the replies after it still come)
                        replies[i] = exc
        except PIPELINE_FAILURES as exc:
            self._forget_readers(connections)
            self._refresh_slots()
            raise self.error(exc) from exc
        except BaseException:
            self._forget_readers(connections)
            raise
        for name, connection in connections.items():
            if not self._readers[name].give_back(connection):
                connection.disconnect()
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if isinstance(error, REDIRECTED):
            self._refresh_slots()
            return self._read_redirected(lookups, ranges, windows, summaries)
        if isinstance(error, PIPELINE_FAILURES):  # (CLUSTERDOWN, TRYAGAIN)
            self._refresh_slots()
            raise self.error(error)
        if error is not None:
            raise error
        return replies

    async def read_async(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        """``read`` on the event loop: each node's part batched with the other lookups of the loop
        turn that go to it (``BatchedReads``), the nodes read concurrently."""
        commands = read_commands(lookups, ranges, windows, summaries)
        try:
            route = self._route(read_keys(lookups, ranges, windows, summaries))
            parts = [
                self._node_batches(name).read(b"".join([commands[i] for i in indices]), len(indices))
                for name, indices in route.items()
            ]
            answers: list[Any]
            if len(parts) == 1:
                answers = [await parts[0]]
            else:
                answers = await asyncio.gather(*parts, return_exceptions=True)
                for answer in answers:  # (each part ran to its end: none is left unread)
                    if isinstance(answer, BaseException):
                        raise answer
        except REDIRECTED:
            self._refresh_slots_in_background()
            return await self._read_redirected_async(lookups, ranges, windows, summaries)
        except PIPELINE_FAILURES as exc:
            self._refresh_slots_in_background()
            raise self.error(exc) from exc
        replies: list = [None] * len(commands)
        for indices, answered in zip(route.values(), answers):
            for i, reply in zip(indices, answered):
                replies[i] = reply
        return replies

    def _read_redirected(self, *reads: Sequence) -> list:
        """A read (``read``'s four arguments) a node redirected, through redis-py's cluster
        pipeline (it follows MOVED and ASK)."""
        try:
            return _queue(self.client.pipeline(transaction=False), *reads).execute()
        except PIPELINE_FAILURES as exc:
            raise self.error(exc) from exc

    async def _read_redirected_async(self, *reads: Sequence) -> list:
        try:
            return await _queue(self.async_client.pipeline(transaction=False), *reads).execute()
        except PIPELINE_FAILURES as exc:
            raise self.error(exc) from exc

    def _route(self, keys: Sequence[bytes]) -> Route:
        """Which node reads each key: its slot's master, or with ``read_from_replicas`` its
        master and replicas in turn (a read's keys of one slot go to one node)."""
        _, _, group_of, groups = self._slots()
        route: Route = defaultdict(list)
        turn = self._turn = self._turn + 1
        for i, key in enumerate(keys):
            group = group_of[key_slot(key)]
            if group < 0:
                raise redis.exceptions.SlotNotCoveredError(f"slot {key_slot(key)} has no master (failing over)")
            nodes = groups[group]
            route[nodes[turn % len(nodes)] if self._balancing else nodes[0]].append(i)
        return route

    def _node_readers(self, name: str) -> ReadConnections:
        """Connections for reads to node ``name`` (``host:port``), made as redis-py's cluster client
        makes its own (READONLY on each with ``read_from_replicas``)."""
        readers = self._readers.get(name)
        if readers is None:
            node = self.client.get_node(node_name=name)
            if node is None:  # gone from the slot map since it was routed to (a failover)
                raise redis.ConnectionError(f"node {name} left the cluster")
            pool = self.client.get_redis_connection(node).connection_pool
            readers = self._readers.setdefault(
                name, ReadConnections(lambda: pool.connection_class(**pool.connection_kwargs))
            )
        return readers

    def _forget_readers(self, connections: dict[str, Any]) -> None:
        """After a failed read: its connections may hold unread replies, and the idle ones of
        the same nodes may be to a server that is gone."""
        for name, connection in connections.items():
            connection.disconnect()
            for idle in self._readers[name].drain():
                idle.disconnect()

    def _node_batches(self, name: str) -> BatchedReads:
        """Node ``name``'s batched reads on the running event loop (connections belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._batched_loop is not loop:
            self._batched, self._batched_loop = {}, loop
        batched = self._batched.get(name)
        if batched is None:
            host, _, port = name.rpartition(":")
            timeout = self.read_timeout_ms / 1000
            # no per-call timeouts (redis-py makes a task or a timer for every send and reply): BatchedReads' watchdog
            options: dict[str, Any] = {
                "host": host,
                "port": int(port),
                "socket_timeout": None,
                "socket_connect_timeout": timeout,
                **self.credentials,
                **(self.tls or {}),
            }
            if self._balancing is not None:
                options["redis_connect_func"] = _read_only
            connection_class = aioredis.Connection if self.tls is None else aioredis.SSLConnection
            batched = self._batched[name] = BatchedReads(ReadConnections(lambda: connection_class(**options)), timeout)
        return batched

    def send(self, calls: Iterable[Call]) -> list:
        """Each call split by master, each part one script call over that master's slots; a call
        in parts replies the sum of its parts' replies (the write scripts return counts)."""
        binary: list[tuple[str, pa.Array, list, list[pa.Array]]] = [(n, as_binary(k), a, c) for n, k, a, c in calls]
        manager = self.client.nodes_manager
        queued: dict[str, list[tuple[int, bytes]]] = defaultdict(list)  # node name -> (call index, command)
        connections: dict[str, Any] = {}
        pools: dict[str, Any] = {}
        every_slot = _slots(pa.concat_arrays([keys for _, keys, _, _ in binary])) if binary else np.array([])
        ends = np.cumsum([len(keys) for _, keys, _, _ in binary]).tolist()
        try:  # (the slot map and the connections fail during a failover too: all of it is the store's error)
            _, table, _, groups = self._slots()
            for i, (name, keys, args, per_key) in enumerate(binary):
                slots = every_slot[ends[i] - len(keys) : ends[i]]
                if len(slots) > 1 and (np.diff(slots) < 0).any():  # one reorder per call, then slices per master
                    order = pa.array(np.argsort(slots, kind="stable"))
                    keys, per_key, slots = keys.take(order), [c.take(order) for c in per_key], slots[order.to_numpy()]
                masters = table[slots]
                if (masters < 0).any():
                    raise redis.exceptions.SlotNotCoveredError(
                        f"slot {slots[masters < 0][0]} has no master (failing over)"
                    )
                starts = [0, *(np.flatnonzero(np.diff(masters)) + 1).tolist()]
                bounds = list(zip(starts, [*starts[1:], len(slots)]))
                # keys undeclared (numkeys 0, then the count and the keys): one call spans a master's slots
                pieces = resp.sliced(("EVALSHA", scripts()[name].sha, 0), keys, args, per_key, bounds)
                for start, piece in zip(starts, pieces):
                    queued[groups[masters[start]][0]].append((i, piece))
            for name in queued:
                owner = manager.get_node(node_name=name)
                if owner is None:  # gone from the slot map since it was routed to (a failover)
                    raise redis.ConnectionError(f"node {name} left the cluster")
                pools[name] = self.client.get_redis_connection(owner).connection_pool
            for name in queued:
                connections[name] = pools[name].get_connection()
            wait = [self.replica_wait.command] if self.replica_wait is not None else []
            exchanges = [(connections[name], [c for _, c in commands] + wait) for name, commands in queued.items()]
            if len(exchanges) > 1:  # every master fed at once: a blocking send to one would hold back the others
                answers = list(self._node_threads().map(lambda e: _exchange(*e), exchanges))
            else:
                answers = [_exchange(*e) for e in exchanges]
            replies: list[list] = [[] for _ in binary]
            for commands, answered in zip(queued.values(), answers):
                for (i, _), reply in zip(commands, answered):
                    replies[i].append(reply)
            if self.replica_wait is not None:  # (each master's last reply: its replicas')
                for name, answered in zip(queued, answers):
                    self.replica_wait.check(answered[-1], f"Redis Cluster master {name}")
        except PIPELINE_FAILURES as exc:
            for connection in connections.values():  # replies may be left unread on them
                connection.disconnect()
            self._refresh_slots()
            raise self.error(exc) from exc
        finally:
            for name, connection in connections.items():
                pools[name].release(connection)
        results = [_combined(r) for r in replies]
        moved = [
            r
            for r in results
            if isinstance(r, MOVING)
            or (
                isinstance(r, redis.ResponseError)
                and (str(r).startswith(NOT_HERE) or any(m in str(r) for m in NOT_HERE_IN_SCRIPT))
            )
        ]
        if moved:  # a slot moved or is failing over: the writes are idempotent, a retry sends them again
            self._refresh_slots()
            raise OnlineStoreUnavailable(
                f"Redis Cluster at {self.safe_url} is resharding or failing over ({moved[0]}); retry"
            )
        return results

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """A cluster passes every message to every node, so one reachable node is enough (when it
        goes away, the caller subscribes again)."""
        for host, port in self.nodes:
            node = aioredis.Redis(
                host=host,
                port=port,
                socket_connect_timeout=self.read_timeout_ms / 1000,
                **self.credentials,
                **self.secure,
            )
            try:
                await node.ping()
            except UNAVAILABLE:
                await node.aclose()
                continue
            try:
                async for message in listen(node, channel):
                    yield message
            finally:
                await node.aclose()
        raise OnlineStoreUnavailable(f"no node of Redis Cluster {self.safe_url} answers")

    def each_node(self, *command: str) -> list:
        try:
            return [
                self.client.get_redis_connection(node).execute_command(*command) for node in self.client.get_primaries()
            ]
        except UNAVAILABLE as exc:
            raise self.error(exc) from exc

    def error(self, exc: BaseException) -> OnlineStoreUnavailable:
        return unavailable("Redis Cluster", self.url, exc, f"{SCHEME}[user]:password@host:port,... (percent-encoded)")

    def recover(self) -> None:
        """(Nothing to restart: a replica takes over a failed master.)"""

    def recover_in_background(self) -> None:
        """(As ``recover``.)"""

    def close(self) -> None:
        for readers in self._readers.values():
            for connection in readers.drain():
                connection.disconnect()
        self.client.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    def _slots(self) -> tuple[object, np.ndarray, list[int], list[tuple[str, ...]]]:
        """Each slot's nodes, as an index into the node groups (-1: no master now; as an array
        for writes and a list for reads), and the groups (a master's name, then its replicas');
        read again whenever redis-py's slot map is a new one (``_refresh_slots``). A slot that
        moved since (redis-py patches its map in place on a MOVED of its own) sends its keys to
        the old master: a write is refused (a 503, the map read again, and the retry goes where
        they live), a read redirected (``_read_redirected``)."""
        slot_map = self.client.nodes_manager.slots_cache
        if self._slot_table is None or self._slot_table[0] is not slot_map:
            groups = sorted({tuple(node.name for node in nodes) for nodes in slot_map.values() if nodes})
            table = np.full(REDIS_CLUSTER_HASH_SLOTS, -1, dtype=np.int64)
            for slot, nodes in slot_map.items():
                if nodes:
                    table[slot] = groups.index(tuple(node.name for node in nodes))
            self._slot_table = (slot_map, table, table.tolist(), groups)
        return self._slot_table

    def _node_threads(self) -> ThreadPoolExecutor:
        """A thread per master for writes (the sockets release the GIL while they wait)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="cluster-write")
        return self._threads

    def _refresh_slots(self) -> None:
        try:
            self.client.nodes_manager.initialize()
        except UNAVAILABLE:
            pass  # still failing over: the next call tries again

    def _refresh_slots_in_background(self) -> None:
        """``_refresh_slots`` off the event loop, one at a time (it connects to nodes that may hang)."""
        loop = asyncio.get_running_loop()
        if not under_way(self._refreshing, loop):
            self._refreshing = loop.run_in_executor(None, self._refresh_slots)


async def _read_only(connection: aioredis.Connection) -> None:
    """A new connection's set-up, then READONLY: a replica answers reads of its slots."""
    await connection.on_connect()
    await connection.send_command("READONLY")
    if await connection.read_response() != b"OK":
        raise redis.ConnectionError("READONLY failed")


def _exchange(connection: Any, commands: list[bytes]) -> list:
    """Send packed commands on one node's connection at once, then read their replies (errors as values)."""
    connection.send_packed_command([b"".join(commands)])
    replies: list = []
    for _ in commands:
        try:
            replies.append(connection.read_response())
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies


def _slots(keys: pa.Array) -> np.ndarray:
    """Each key's hash slot, as ``redis.crc.key_slot`` computes it (CRC16 of the hash tag, the
    bytes between the first ``{`` and the ``}`` after it when there are any, else of the key),
    over the whole array at once: a write hashes every key it sends (a Python call per key took
    most of a cluster write's own time)."""
    keys = keys.cast(pa.large_binary())
    n = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int64, count=n + 1, offset=keys.offset * 8)
    data = np.frombuffer(keys.buffers()[2], dtype=np.uint8) if keys.buffers()[2] is not None else np.zeros(0, np.uint8)
    start, stop = offsets[:-1], offsets[1:]
    opens, closes = np.flatnonzero(data == ord("{")), np.flatnonzero(data == ord("}"))
    found = np.searchsorted(opens, start)
    brace = opens[np.minimum(found, len(opens) - 1)] if len(opens) else start
    tagged = (found < len(opens)) & (brace < stop)
    after = np.searchsorted(closes, brace + 1)
    close = closes[np.minimum(after, len(closes) - 1)] if len(closes) else stop
    tagged &= (after < len(closes)) & (close < stop) & (close != brace + 1)
    first = np.where(tagged, brace + 1, start)  # what is hashed: the tag, or the whole key
    length = np.where(tagged, close, stop) - first
    crc = np.zeros(n, dtype=np.int64)
    for at in range(int(length.max(initial=0))):  # CRC16-XMODEM a byte at a time, every key at once
        byte = data[np.minimum(first + at, len(data) - 1)]
        crc = np.where(length > at, ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF], crc)
    return crc & (REDIS_CLUSTER_HASH_SLOTS - 1)


def _crc16_table() -> np.ndarray:
    table = []
    for value in range(256):
        crc = value << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return np.array(table, dtype=np.int64)


_CRC16 = _crc16_table()


def _combined(replies: list) -> Any:
    """A call's reply from its parts': the one reply, the first error, or the sum of the counts."""
    if len(replies) == 1:
        return replies[0]
    error = next((r for r in replies if isinstance(r, Exception)), None)
    return error if error is not None else sum(r or 0 for r in replies)
