"""A Redis reached over TLS, as managed Redis services require it (``rediss://`` for one node,
``rediss+cluster://`` for a cluster): every path of the store (writes, pushes, lookups from the
SDK and from the servers' event loop, pub/sub, per-node commands) equals the same store's over
plain Redis; a certificate the client does not trust, or TLS against a plain port, is the
store's error saying what to change. The project's redis-server has no TLS: a TLS endpoint
(``tests/tls_proxy.py``, a process of its own) fronts real servers, as a managed Redis's does."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from featurestore import FeatureStore, capacity
from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.embedded import redis_server_binary
from featurestore.online.local_cluster import free_ports, start_local_cluster, stop_local_cluster, wait_until
from featurestore.retrieval.online import OnlineQuery, OnlineReader

from .conftest import write_repo
from .test_redis_cluster import FEATURES, NOW, _payments, _stats
from .tls_proxy import certificates


@contextlib.contextmanager
def tls_endpoint(folder: Path, ports: dict[int, int]) -> Iterator[Path]:
    """TLS on each port of ``ports``' values, relayed to its key; yields the CA's file."""
    ca, cert, key = certificates(folder)
    specs = [f"{outside}:{inside}" for inside, outside in ports.items()]
    proxy = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("tls_proxy.py")), str(cert), str(key), *specs],
        stdout=subprocess.PIPE,
    )
    try:
        assert proxy.stdout is not None and proxy.stdout.readline().strip() == b"ready"
        yield ca
    finally:
        proxy.kill()
        proxy.wait()


@pytest.fixture(params=["single", "cluster"])
def over_tls(request, tmp_path) -> Iterator[tuple[str, str]]:
    """(The URL of a Redis over TLS without its CA's file, the query that names it.)"""
    if request.param == "single":
        port, outside = free_ports(2)
        server = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
        )
        try:
            with tls_endpoint(tmp_path, {port: outside}) as ca:
                wait_until(lambda: redis.Redis(port=port).ping())
                yield f"rediss://127.0.0.1:{outside}", f"?ssl_ca_certs={ca}"
        finally:
            server.kill()
            server.wait()
        return
    # (the endpoint listens first: the nodes' connections to each other take ports of their own;
    # replicas would reach their master on its announced port, the endpoint's: masters only)
    ports = free_ports(6)
    inside, outside = ports[:3], ports[3:]
    with tls_endpoint(tmp_path, dict(zip(inside, outside))) as ca:
        procs = start_local_cluster(tmp_path / "nodes", masters=3, replicas=0, announce=dict(zip(inside, outside)))
        try:
            yield f"rediss+cluster://127.0.0.1:{outside[0]},127.0.0.1:{outside[1]}", f"?ssl_ca_certs={ca}"
        finally:
            stop_local_cluster(procs)


def test_every_path_of_the_store_works_over_tls_and_an_untrusted_one_says_what_to_give(
    over_tls, tmp_path, redis_url, monkeypatch
):
    monkeypatch.delenv("REDIS_URL", raising=False)
    url, query = over_tls
    plain = FeatureStore(write_repo(tmp_path / "plain", FEATURES, {"stats": _stats(100)}, url=redis_url))
    root = write_repo(tmp_path / "tls", FEATURES, {"stats": _stats(100)}, url=url + query)
    refs = ["stats:score", "stats:segment", "activity:count_1h", "activity:amount_sum_24h"]
    cards = list(range(-2, 110))
    with FeatureStore(root) as secure:
        for store in (plain, secure):
            store.apply()
            store.materialize(None, NOW)
            store.push("payments", _payments(400, seed=8))
        expected = plain.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
        assert secure.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
        query_plan = OnlineQuery.prepare(
            secure.definitions, secure.config.project, {"card_id": cards}, refs, None, False, now=NOW
        )
        online = secure.online_store

        async def served() -> tuple[dict, str]:  # (one event loop, as a server's)
            read = (await OnlineReader(online).read_async(query_plan)).to_dict()
            messages = online.subscribe(b"models")
            listening = asyncio.ensure_future(messages.__anext__())
            for _ in range(100):  # until the subscription is in place
                await asyncio.sleep(0.02)
                online.publish(b"models", "m:1:production")
                if listening.done():
                    break
            message = await asyncio.wait_for(listening, 5)
            await messages.aclose()
            return read, message

        assert asyncio.run(served()) == (expected, "m:1:production")
        measured = capacity.measure(online, secure.definitions, secure.config.project)  # (commands to each node)
        assert measured.keys > 0 and measured.entities_now > 0
    plain.close()

    config = root / "featurestore.yaml"
    settings = config.read_text()
    config.write_text(settings.replace(query, ""))  # the CA not given: the certificate is not trusted
    with pytest.raises(OnlineStoreUnavailable) as untrusted:
        with FeatureStore(root) as store:
            store.get_online_features({"card_id": [1]}, features=refs)
    assert "ssl_ca_certs=" in str(untrusted.value) and "certificate" in str(untrusted.value), untrusted.value
