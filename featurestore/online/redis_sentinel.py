"""Redis behind Sentinel: ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``
(``?sentinel_password=...``, and ``sentinel_username``, where the sentinels require their own).

The sentinels name the service's master; every connection asks them for it as it connects
(redis-py's ``SentinelConnectionPool``), so after a failover new connections reach the
promoted replica, and one still open to the old master fails (its writes answer READONLY, which
redis-py turns into a connection error): the store's error, a 503, then the next call serves
again, with no restart. Everything else is one node's transport (``redis_single``). The URL's
password is the Redis nodes'; the sentinels take the query's, when given.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote

import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from featurestore.online.base import SENTINEL_SCHEME as SCHEME
from featurestore.online.redis_single import Clients
from featurestore.online.transport import redact

FORM = (
    f"{SCHEME}[user]:password@host:port,host:port/service (percent-encoded; the sentinels' own: ?sentinel_password=...)"
)
SENTINEL_SETTINGS = ("sentinel_password", "sentinel_username")
# a sentinel that does not answer in this long is skipped for the next (each is asked in turn)
SENTINEL_TIMEOUT_S = 1.0


def parse(url: str) -> tuple[list[tuple[str, int]], str, int, dict[str, Any], dict[str, Any]]:
    """The sentinels, the service's name, the database, the nodes' credentials and the sentinels'."""
    rest, _, query = (url[len(SCHEME) :] if url.startswith(SCHEME) else "").partition("?")
    settings = parse_qs(query, keep_blank_values=True)
    if set(settings) - set(SENTINEL_SETTINGS) or any(len(values) > 1 for values in settings.values()):
        raise ValueError(f"{redact(url, url)!r}: its query may set each of {list(SENTINEL_SETTINGS)} once")
    asked = {name.removeprefix("sentinel_"): values[0] for name, values in settings.items()}
    location, _, path = rest.partition("/")
    userinfo, at, hosts = location.rpartition("@")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{redact(item, url)!r} in {redact(url, url)!r} is not host:port")
        sentinels.append((host, int(port)))
    service, _, db = path.strip("/").partition("/")
    if not sentinels or not service or (db and not db.isdigit()):
        raise ValueError(f"{redact(url, url)!r} does not name sentinels and a service; write {FORM}")
    credentials: dict[str, Any] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        credentials = {"username": unquote(user)} if user else {}
        if colon:
            credentials["password"] = unquote(password)
    return sentinels, unquote(service), int(db or 0), credentials, asked


def sentinel_clients(url: str) -> Clients:
    """Clients of the master the sentinels of ``url`` name now, or of its replicas (asked again on
    every connection)."""
    sentinels, service, db, credentials, sentinel_credentials = parse(url)
    asked = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S, **sentinel_credentials}

    def make(asynchronous: bool, replica: bool = False, **options: Any) -> Any:
        manager = (aiosentinel.Sentinel if asynchronous else redis.sentinel.Sentinel)(sentinels, sentinel_kwargs=asked)
        connect = manager.slave_for if replica else manager.master_for  # (a replica: each in turn, else the master)
        return connect(service, db=db, **credentials, **options)

    return make
