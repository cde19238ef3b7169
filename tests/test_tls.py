"""A Redis reached over TLS, as managed Redis services require it (``rediss://`` for one node,
``rediss+cluster://`` for a cluster): every path of the store (writes, pushes, lookups from the
SDK and from the servers' event loop, pub/sub, per-node commands) equals the same store's over
plain Redis; a certificate the client does not trust, or TLS against a plain port, is the
store's error saying what to change. The project's redis-server has no TLS: a TLS endpoint
(``tests/tls_proxy.py``, a process of its own) fronts real servers, as a managed Redis's does."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from featurestore import FeatureStore
from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.embedded import redis_server_binary
from featurestore.online.local_cluster import free_ports, start_local_cluster, stop_local_cluster, wait_until

from .conftest import assert_every_path_serves, write_repo
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
        assert_every_path_serves(secure, {"card_id": cards}, refs, NOW, expected)
    plain.close()

    config = root / "featurestore.yaml"
    settings = config.read_text()
    config.write_text(settings.replace(query, ""))  # the CA not given: the certificate is not trusted
    with pytest.raises(OnlineStoreUnavailable) as untrusted:
        with FeatureStore(root) as store:
            store.get_online_features({"card_id": [1]}, features=refs)
    assert "ssl_ca_certs=" in str(untrusted.value) and "certificate" in str(untrusted.value), untrusted.value


@pytest.mark.parametrize("workers", ["1", "2"])  # (uvicorn's own server; a listening socket per worker)
def test_the_feature_server_serves_https_with_a_certificate_and_its_key(tmp_path, redis_url, monkeypatch, workers):
    """``featurestore serve --tls-cert --tls-key``: lookups over HTTPS, verified against the CA, equal
    the SDK's; plain HTTP gets no answer; a key that is not the certificate's is an error line."""
    import ssl
    import time

    import httpx

    from .conftest import free_port

    monkeypatch.delenv("REDIS_URL", raising=False)
    ca, cert, key = certificates(tmp_path)
    root = write_repo(tmp_path / "repo", FEATURES, {"stats": _stats(50)}, url=redis_url)
    with FeatureStore(root) as store:
        store.apply()
        store.materialize(None, NOW)
        expected = store.get_online_features({"card_id": [1, 2, 99]}, features=["stats:score"]).to_dict()
    assert expected["score"][0] is not None and expected["score"][2] is None
    trusting = ssl.create_default_context(cafile=str(ca))
    port = free_port()
    command = [sys.executable, "-m", "featurestore.cli", "serve", "--repo", str(root), "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--workers", workers, "--tls-cert", str(cert), "--tls-key", str(key)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", verify=trusting, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.poll() is None, server.stderr.read()
                time.sleep(0.2)
        body = {"features": ["stats:score"], "entities": {"card_id": [1, 2, 99]}}
        reply = httpx.post(url + "/get-online-features", json=body, verify=trusting, timeout=10).json()
        assert reply["results"][1]["values"] == expected["score"]
        with pytest.raises(httpx.HTTPError):  # (no HTTP answer on a TLS port)
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA refuses it
            httpx.get(url + "/health", timeout=5)
    finally:
        server.terminate()
        server.wait(30)
    _, other_cert, _ = certificates(tmp_path / "other")
    refused = subprocess.run(
        [*command, "--tls-cert", str(other_cert), "--tls-key", str(key)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
    assert "do not load as a certificate chain and its key" in refused.stderr, refused.stderr


def test_api_keys_served_beyond_loopback_without_tls_are_noted_at_start(tmp_path, redis_url, monkeypatch):
    """Keys in clear text on the network: the start line says so and what to do (a server behind
    a proxy that ends TLS is fine, so it is a note, not a refusal)."""
    import json
    import time

    import httpx

    from featurestore.auth import hash_key

    from .conftest import free_port

    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", FEATURES, {"stats": _stats(5)}, url=redis_url)
    entries = [{"name": "svc", "sha256": hash_key("key-svc"), "scopes": ["read"]}]
    with open(root / "featurestore.yaml", "a") as config:
        config.write("server:\n  auth:\n    keys: " + json.dumps(entries) + "\n")
    FeatureStore(root).apply()
    port = free_port()
    command = [sys.executable, "-m", "featurestore.cli", "serve", "--repo", str(root), "--host", "0.0.0.0"]
    server = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", headers={"X-API-Key": "key-svc"}).status_code == 200:
                    break
            time.sleep(0.2)
    finally:
        server.terminate()
        stderr = server.communicate(timeout=30)[1].decode()
    assert "API keys cross the network in clear text" in stderr and "--tls-cert" in stderr, stderr


def test_a_replica_takes_versions_from_a_checkpoint_engine_over_https(tmp_path, redis_url, run, monkeypatch):
    """``checkpoint-engine --tls-cert --tls-key`` at the source; a replica given its https:// URL,
    trusting its CA through SSL_CERT_FILE, copies and serves each promotion."""
    import os
    import ssl
    import time

    import httpx

    from .conftest import free_port

    monkeypatch.delenv("REDIS_URL", raising=False)
    ca, cert, key = certificates(tmp_path)
    ports = free_port(), free_port()
    engine = [sys.executable, "-m", "featurestore.cli", "checkpoint-engine", "--model", "m"]
    roots = [write_repo(tmp_path / name, "", url=redis_url) for name in ("source", "replica")]
    processes = [
        subprocess.Popen(
            [*engine, "--repo", str(roots[0]), "--port", str(ports[0]), "--tls-cert", str(cert), "--tls-key", str(key)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        ),
        subprocess.Popen(
            [*engine, "--repo", str(roots[1]), "--port", str(ports[1]), "--source", f"https://127.0.0.1:{ports[0]}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "SSL_CERT_FILE": str(ca)},
        ),
    ]
    trusting = ssl.create_default_context(cafile=str(ca))

    def until(condition) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            for process in processes:
                assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
            assert time.monotonic() < deadline, "not in time"
            time.sleep(0.1)

    def answers(url: str, **options) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/stats", **options).status_code == 200
        return False

    try:
        until(lambda: answers(f"https://127.0.0.1:{ports[0]}", verify=trusting))
        until(lambda: answers(f"http://127.0.0.1:{ports[1]}"))
        source = FeatureStore(roots[0]).model_registry()
        version = source.register("m", run)
        source.promote("m", version, "production")

        def serves() -> bool:
            with contextlib.suppress(OSError, ValueError):
                return FeatureStore(roots[1]).model_registry().aliases("m").get("production") == version
            return False

        until(serves)
        assert FeatureStore(roots[1]).model_registry().hashes("m")[version] == source.hashes("m")[version]
    finally:
        for process in processes:
            process.kill()
            process.wait()
