"""Online store on Redis Cluster: the same keys, values and scripts as ``redis_store``.

``online_store: {type: redis_cluster, nodes: [host:port, ...]}`` or ``url: redis+cluster://h:p,h:p``.
Keys carry a hash tag per entity (``{card_id=42}``), so all of an entity's views and events
live on one slot. A script may only touch keys of one slot, so writes are split by slot and
each slot's calls go to its master; the masters work concurrently (everything is sent before
any reply is read). Reads go through redis-py's cluster pipeline (one batch per node, request
order kept, MOVED/ASK followed), from replicas when ``read_from_replicas: true``. While a
master is failing over, its slots answer errors: the store raises ``OnlineStoreUnavailable``
(a 503), refreshes its slot map, and serves again once a replica has taken over.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.base import Lookup, Range, Seal, TiledRange
from featurestore.online.codec import entity_keys
from featurestore.online.redis_store import UNAVAILABLE, Call, RedisOnlineStore, _array, _flat, listen, redact

SCHEME = "redis+cluster://"
# what redis-py's cluster client raises while a master fails over: the usual errors, and from its
# pipelines and slot map now and then a lookup on a node that has just gone (seen under failover)
PIPELINE_FAILURES = (*UNAVAILABLE, AttributeError, KeyError, IndexError)
# replies of a node whose slots are moving or failing over (redis-py parses some into these)
MOVING = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
)


def _queue(pipe, lookups: Sequence[Lookup], ranges: Sequence[Range]):
    """An HMGET per lookup, then each range's events."""
    for key, fields in lookups:
        pipe.hmget(key, fields)
    for key, low, high, limit in ranges:
        if limit is None:
            pipe.zrangebyscore(key, f"({low}", high)
        else:
            pipe.zrangebyscore(key, f"({low}", high, start=0, num=limit)
    return pipe


def cluster_url(nodes: list[str]) -> str:
    """The URL form of a node list: ``redis+cluster://h1:p1,h2:p2``."""
    return SCHEME + ",".join(nodes)


def parse_nodes(url: str) -> list[tuple[str, int]]:
    hosts = url[len(SCHEME) :].strip("/").split("/")[0]
    nodes = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{item!r} in {url!r} is not host:port")
        nodes.append((host, int(port)))
    if not nodes:
        raise ValueError(f"{url!r} names no node; write {SCHEME}host:port[,host:port...]")
    return nodes


class RedisClusterOnlineStore(RedisOnlineStore):
    def __init__(self, url: str, project: str, read_timeout_ms: int = 500, read_from_replicas: bool = False):
        self.nodes = parse_nodes(url)
        self.read_from_replicas = read_from_replicas
        super().__init__(url, project, None, read_timeout_ms)

    # One attempt (Retry(NoBackoff(), 1)): during a failover a request answers 503 at once rather
    # than retrying past its timeout.
    def _connect(self) -> RedisCluster:  # type: ignore[override]
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
            socket_timeout=30,
            retry=Retry(NoBackoff(), 1),
            load_balancing_strategy=self._balancing(),
        )

    def _connect_async(self, timeout: float) -> aiocluster.RedisCluster:  # type: ignore[override]
        return aiocluster.RedisCluster(
            startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in self.nodes],
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=AsyncRetry(NoBackoff(), 1),
            load_balancing_strategy=self._balancing(),
        )

    def _balancing(self) -> LoadBalancingStrategy | None:
        return LoadBalancingStrategy.ROUND_ROBIN if self.read_from_replicas else None

    def write_latest(self, view: str, rows: pa.Table, join_keys: Sequence[str], *args, **kwargs) -> int:  # type: ignore[override]
        return super().write_latest(view, rows.take(self._slot_order(rows, join_keys)), join_keys, *args, **kwargs)

    def write_events(
        self,
        view: str,
        rows: pa.Table,
        join_keys: Sequence[str],
        features: Sequence,
        event_ids: np.ndarray,
        *args,
        accepted: np.ndarray | None = None,
        **kwargs,
    ) -> int:  # type: ignore[override]
        order = self._slot_order(rows, join_keys)  # stable: each entity's writes keep their order
        return super().write_events(
            view,
            rows.take(order),
            join_keys,
            features,
            event_ids[order],
            *args,
            accepted=accepted[order] if accepted is not None else None,
            **kwargs,
        )

    def _error(self, exc: BaseException) -> OnlineStoreUnavailable:
        return OnlineStoreUnavailable(f"Redis Cluster at {self.safe_url} is unreachable: {redact(str(exc), self.url)}")

    def read(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        """Through redis-py's cluster pipeline: one batch per node, request order kept."""
        try:
            return _queue(self.client.pipeline(transaction=False), lookups, ranges).execute()
        except PIPELINE_FAILURES as exc:
            raise self._error(exc) from exc

    async def read_async(self, lookups: Sequence[Lookup], ranges: Sequence[Range] = ()) -> list:
        try:
            return await _queue(self.async_client.pipeline(transaction=False), lookups, ranges).execute()
        except PIPELINE_FAILURES as exc:
            raise self._error(exc) from exc

    def read_tiles(self, windows: Sequence[TiledRange]) -> list:
        """One EVALSHA per window, each to its key's node (the scripts sum no lists, unlike ``_send``)."""
        sha = self._scripts["read_window"].sha
        for attempt in (1, 2):  # a node that lost its scripts (a restart, a promoted replica) gets them
            try:
                pipe = self.client.pipeline(transaction=False)
                for (
                    key,
                    arguments,
                ) in windows:  # (EVALSHA's method is blocked in cluster pipelines; the command routes by key)
                    pipe.execute_command("EVALSHA", sha, 1, key, *arguments)
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                with self._calling():
                    for script in self._scripts.values():
                        self.client.script_load(script.code)
            except PIPELINE_FAILURES as exc:
                raise self._error(exc) from exc
        raise AssertionError("unreachable")

    async def read_tiles_async(self, windows: Sequence[TiledRange]) -> list:
        """``read_tiles`` on the event loop: the async cluster pipeline, by command (its EVALSHA method is blocked too)."""
        sha = self._scripts["read_window"].sha
        for attempt in (1, 2):
            try:
                pipe = self.async_client.pipeline(transaction=False)
                for key, arguments in windows:
                    pipe.execute_command("EVALSHA", sha, 1, key, *arguments)
                return await pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                try:
                    for script in self._scripts.values():
                        await self.async_client.script_load(script.code)
                except PIPELINE_FAILURES as exc:
                    raise self._error(exc) from exc
            except PIPELINE_FAILURES as exc:
                raise self._error(exc) from exc
        raise AssertionError("unreachable")

    async def seal_async(self, seals: Sequence[Seal]) -> None:
        """``seal`` on the event loop, one script call per key (each on its key's node)."""
        sha = self._scripts["seal"].sha
        try:
            for key, tile_us, tiles in seals:
                try:
                    await self.async_client.execute_command("EVALSHA", sha, 1, key, tile_us, *_flat(tiles))
                except redis.exceptions.NoScriptError:
                    await self.async_client.script_load(self._scripts["seal"].code)
                    await self.async_client.execute_command("EVALSHA", sha, 1, key, tile_us, *_flat(tiles))
        except PIPELINE_FAILURES as exc:
            raise self._error(exc) from exc

    def _slot_order(self, rows: pa.Table, join_keys: Sequence[str]) -> np.ndarray:
        """Rows ordered by hash slot: each chunk of a write then spans few slots (one script call
        per slot), not one call per row."""
        slots = np.fromiter(
            (key_slot(k) for k in entity_keys(self.project, rows, join_keys).to_pylist()),
            dtype=np.int64,
            count=rows.num_rows,
        )
        return np.argsort(slots, kind="stable")

    def _send(self, calls: Iterable[Call]) -> list:
        """Each call split by hash slot, each part sent to its slot's master; a call's result is
        the sum of its parts' (the scripts return counts)."""
        calls = list(calls)
        manager = self.client.nodes_manager
        queued: dict[str, list[tuple[int, bytes]]] = defaultdict(list)  # node name -> (call index, command)
        results: list = [0] * len(calls)
        connections = {}
        try:  # (the slot map and the connections fail during a failover too: all of it is the store's error)
            for i, (name, keys, args, per_key) in enumerate(calls):
                keys = _array(keys)
                slots = np.fromiter((key_slot(k) for k in keys.to_pylist()), dtype=np.int64, count=len(keys))
                if len(slots) > 1 and (np.diff(slots) < 0).any():  # one reorder per call, then slices per slot
                    order = pa.array(np.argsort(slots, kind="stable"))
                    keys, per_key, slots = keys.take(order), [c.take(order) for c in per_key], slots[order.to_numpy()]
                starts = [0, *(np.flatnonzero(np.diff(slots)) + 1).tolist(), len(slots)]
                for start, end in zip(starts, starts[1:]):
                    node = manager.get_node_from_slot(int(slots[start]))
                    queued[node.name].append(
                        (
                            i,
                            self._command(
                                name,
                                keys.slice(start, end - start),
                                args,
                                [c.slice(start, end - start) for c in per_key],
                            ),
                        )
                    )
            pools = {
                name: self.client.get_redis_connection(manager.get_node(node_name=name)).connection_pool
                for name in queued
            }
            for name, commands in queued.items():
                connections[name] = pools[name].get_connection()
                connections[name].send_packed_command([command for _, command in commands])
            for name, commands in queued.items():
                for i, _ in commands:
                    try:
                        reply = connections[name].read_response()
                    except redis.ResponseError as exc:
                        reply = exc
                    if isinstance(reply, Exception):
                        results[i] = reply
                    elif not isinstance(results[i], Exception):
                        results[i] += reply or 0
        except PIPELINE_FAILURES as exc:
            for connection in connections.values():  # replies may be left unread on them
                connection.disconnect()
            self._refresh_slots()
            raise self._error(exc) from exc
        finally:
            for name, connection in connections.items():
                pools[name].release(connection)
        moved = [
            r
            for r in results
            if isinstance(r, MOVING)
            or (isinstance(r, redis.ResponseError) and str(r).startswith(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")))
        ]
        if moved:  # a slot moved or is failing over: the writes are idempotent, a retry sends them again
            self._refresh_slots()
            raise OnlineStoreUnavailable(
                f"Redis Cluster at {self.safe_url} is resharding or failing over ({moved[0]}); retry"
            )
        return results

    async def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``: a cluster passes every message to every node, so one
        reachable node is enough (when it goes away, the caller subscribes again)."""
        for host, port in self.nodes:
            node = aioredis.Redis(host=host, port=port, socket_connect_timeout=self.read_timeout_ms / 1000)
            try:
                await node.ping()
            except UNAVAILABLE:
                await node.aclose()
                continue
            try:
                async for message in listen(node, self.prefix + channel):
                    yield message
            finally:
                await node.aclose()
        raise OnlineStoreUnavailable(f"no node of Redis Cluster {self.safe_url} answers")

    def _refresh_slots(self) -> None:
        try:
            self.client.nodes_manager.initialize()
        except UNAVAILABLE:
            pass  # still failing over: the next call tries again
