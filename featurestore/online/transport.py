"""How the Redis online store reaches Redis: one node, or a cluster's slots (``Transport``).

The store (``online.redis_store``) decides what to send: keys, values, which script; a transport
decides where it goes and how. ``redis_single`` sends everything on one connection (lookups of
one event-loop turn batched together); ``redis_cluster`` splits each call by hash slot and sends
each part to its slot's master, the masters working concurrently. A failure is the store's
error (``OnlineStoreUnavailable``, a 503 on the servers), never redis-py's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import redis
import redis.asyncio as aioredis

from featurestore.errors import OnlineStoreUnavailable
from featurestore.online import resp
from featurestore.online.base import SUMMARIES_SUFFIX, Lookup, Range, TiledRange
from featurestore.online.lua import scripts

# what Redis answers a connection without the password it requires, or with a wrong one
AUTH_REFUSED = (
    "NOAUTH",
    "WRONGPASS",
    "Authentication required",
    "invalid username-password",
    "without any password",
    "client already authenticated",  # (HELLO before AUTH)
)

# a redis-py client as its repr names it (Sentinel's errors list one per sentinel asked): its host:port
_CLIENT_REPR = re.compile(r"<redis\.client\.Redis\(<.*?host=([^,)]+),port=(\d+).*?\)>\)>\)>")

# A script call: the script's name, its keys, its arguments, then its per-key argument columns.
Call = tuple[str, "pa.Array | list", list, "list[pa.Array]"]

# what a Redis that is down, hung, or failing over raises (a cluster: no master for a slot yet)
UNAVAILABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
    OSError,
)


@dataclass(frozen=True)
class ReplicaWait:
    """Writes return once ``replicas`` replicas of each master written have them (Redis's WAIT
    after a write's commands, on their connection), waiting at most ``timeout_ms``; else the
    store's error: a failover then loses no write it acknowledged."""

    replicas: int
    timeout_ms: int

    @property
    def command(self) -> bytes:
        return resp.command("WAIT", self.replicas, self.timeout_ms)

    def check(self, reply: Any, where: str) -> None:
        """``reply``: WAIT's (the replicas that acknowledged), or the error it answered."""
        if isinstance(reply, int) and reply >= self.replicas:
            return
        got = f"{reply} of the {self.replicas}" if isinstance(reply, int) else f"none of the {self.replicas} ({reply})"
        raise OnlineStoreUnavailable(
            f"{where} has the write, but {got} replicas online_store.wait_for_replicas asks for acknowledged it "
            f"within {self.timeout_ms} ms (a failover now could lose it); retry once the replicas are back: "
            "writes are idempotent"
        )


class Transport(Protocol):
    url: str
    safe_url: str  # for messages and logs: never the password
    client: Any  # redis-py's client (``Redis`` or ``RedisCluster``), for plain commands
    failures: tuple[type[BaseException], ...]  # what its pipelines raise when Redis is unreachable

    @property
    def async_client(self) -> Any:
        """redis-py's asyncio client, with the read timeout."""
        ...

    def order(self, keys: pa.Array) -> np.ndarray | None:
        """The order to write rows with these keys in (a cluster: by hash slot, stable); None: as given."""
        ...

    def send(self, calls: Iterable[Call]) -> list:
        """EVALSHA every call in one round trip (per node), each sent as it comes; the replies,
        errors as values. A call split across nodes replies the sum of its parts' (the write
        scripts return counts)."""
        ...

    def read(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        """One round trip: an HMGET per lookup, then the events of each range, then ``read_window.lua``
        on each window, then the tile summaries of each events key in ``summaries`` (its
        hash, as HGETALL replies). A Redis that lost its scripts answers ``NoScriptError``."""
        ...

    async def read_async(
        self,
        lookups: Sequence[Lookup],
        ranges: Sequence[Range],
        windows: Sequence[TiledRange],
        summaries: Sequence[bytes],
    ) -> list:
        """``read`` on the event loop."""
        ...

    def subscribe(self, channel: bytes) -> AsyncIterator[str]:
        """Messages published on ``channel``, as text; raises when Redis goes away."""
        ...

    def each_node(self, *command: str) -> list:
        """A plain command (``DBSIZE``, ``INFO memory``) on each node holding the data (the one
        node, or each master: a cluster client sends it to one node of its choosing), their replies."""
        ...

    def error(self, exc: BaseException) -> OnlineStoreUnavailable:
        """What a failed call raises."""
        ...

    def recover(self) -> None:
        """Restart an embedded server that died (whoever notices does it)."""
        ...

    def recover_in_background(self) -> None:
        """``recover`` off the event loop, one at a time."""
        ...

    def close(self) -> None: ...


def as_binary(values: pa.Array | list) -> pa.Array:
    return values if isinstance(values, pa.Array) else pa.array(values, pa.binary())


def read_commands(
    lookups: Sequence[Lookup], ranges: Sequence[Range], windows: Sequence[TiledRange], summaries: Sequence[bytes]
) -> list[bytes]:
    """``Transport.read``'s commands, each packed (``read_keys``: the key each one reads)."""
    sha = scripts()["read_window"].sha
    commands = resp.reads(lookups, ranges)
    commands += [resp.command("EVALSHA", sha, 1, key, *arguments) for key, arguments in windows]
    return commands + [resp.whole_hash(key) for key in summary_keys(summaries)]


def read_keys(
    lookups: Sequence[Lookup], ranges: Sequence[Range], windows: Sequence[TiledRange], summaries: Sequence[bytes]
) -> list[bytes]:
    """The key each of ``read_commands``' commands reads."""
    return [key for key, _ in lookups] + [r[0] for r in ranges] + [key for key, _ in windows] + summary_keys(summaries)


def packed_reads(
    lookups: Sequence[Lookup], ranges: Sequence[Range], windows: Sequence[TiledRange], summaries: Sequence[bytes]
) -> tuple[bytes, int]:
    """``Transport.read``'s commands in one buffer, and how many replies they get."""
    commands = read_commands(lookups, ranges, windows, summaries)
    return b"".join(commands), len(commands)


def summary_keys(events_keys: Sequence[bytes]) -> list[bytes]:
    """The hashes holding these events keys' tile summaries."""
    return [key + SUMMARIES_SUFFIX for key in events_keys]


def evalsha(call: Call) -> bytes:
    """A script call packed as one EVALSHA command (``resp``)."""
    name, keys, args, per_key = call
    return resp.command("EVALSHA", scripts()[name].sha, len(keys), as_binary(keys), *args, *per_key)


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


def unavailable(what: str, url: str, exc: BaseException, form: str) -> OnlineStoreUnavailable:
    """The store's error for ``exc``: ``what`` at ``url`` is unreachable, refused its password
    (then how to give one: ``form``), or its TLS certificate is not trusted here (then how to
    name the CA); the password never in it."""
    text, safe = _CLIENT_REPR.sub(r"\1:\2", redact(str(exc), url)), redact(url, url)
    if any(refusal in text for refusal in AUTH_REFUSED):
        given = "the password in its URL" if safe != url else "a connection without a password"
        return OnlineStoreUnavailable(
            f"{what} at {safe} refused {given} ({text}); write the password in the URL: {form}"
        )
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return OnlineStoreUnavailable(
            f"{what} at {safe} presented a TLS certificate this host does not accept ({text}); name the file "
            "of the CA that signed it in the URL's query: ?ssl_ca_certs=/path/to/ca.pem"
        )
    return OnlineStoreUnavailable(f"{what} at {safe} is unreachable: {text}")


def under_way(work: asyncio.Future | None, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``work`` (background work a transport started on an event loop) is still under way
    on ``loop`` (work of a loop that has closed never ends)."""
    return work is not None and work.get_loop() is loop and not work.done()


def redact(text: str, url: str) -> str:
    """``text`` with the passwords of ``url`` (``redis://user:secret@host``, and a query's
    ``...password=secret``) replaced by ``***``, as written and decoded."""
    from urllib.parse import unquote, urlsplit

    try:
        parts = urlsplit(url)
        secrets = [parts.password or ""]
    except ValueError:
        return text
    for setting in parts.query.split("&"):
        name, _, value = setting.partition("=")
        if "password" in name:
            secrets.append(value)
    for secret in sorted({*secrets, *map(unquote, secrets)} - {""}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
