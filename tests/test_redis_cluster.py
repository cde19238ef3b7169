"""Redis Cluster online store: a real cluster of 3 masters and 3 replicas (the redis-server this
project ships, cluster mode), lookups equal to a single Redis's, and a master killed mid-load
that ends in recovery with no wrong value served."""

from __future__ import annotations

import signal
import subprocess
import time
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from featurestore import FeatureStore
from featurestore.errors import OnlineStoreUnavailable
from featurestore.online.local_cluster import start_local_cluster, stop_local_cluster, wait_until

from .conftest import examples, write_repo

NOW = datetime.now(UTC).replace(microsecond=0)

FEATURES = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, FileSource, PushSource
from featurestore.types import Float64, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
stats = FeatureView(name="stats", entities=[card], ttl=timedelta(days=30),
    source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("score", Float64), Field("segment", String)])
payments = PushSource(name="payments", schema=[Field("payment_id", Int64), Field("card_id", Int64),
    Field("amount", Float64), Field("event_timestamp", UnixTimestamp)])
activity = FeatureView(name="activity", entities=[card], source=payments, event_id="payment_id",
    schema=[Field("payment_id", Int64), Field("amount", Float64)],
    aggregations=[Aggregation("count", timedelta(hours=1)), Aggregation("sum", timedelta(hours=24), "amount")])
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a node silent for node_timeout_ms is failed over: 1 s (the default, for quick failover tests) is
    # reached by a master starved of CPU on a busy 2-core machine, and a lookup then meets the failover
    procs = start_local_cluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1, node_timeout_ms=3000)
    yield list(procs), procs
    stop_local_cluster(procs)


def _stats(n: int) -> pa.Table:
    rng = np.random.default_rng(3)
    return pa.table(
        {
            "card_id": np.arange(n, dtype=np.int64),
            "event_timestamp": pa.array([NOW - timedelta(hours=2)] * n, pa.timestamp("us", tz="UTC")),
            "score": rng.normal(size=n),
            "segment": pa.array([f"s{i % 7}" for i in range(n)]),
        }
    )


def _stores(tmp_path, redis_url, ports, n=500):
    single = FeatureStore(write_repo(tmp_path / "single", FEATURES, {"stats": _stats(n)}, url=redis_url))
    nodes = ", ".join(f"'127.0.0.1:{p}'" for p in ports[:2])  # a few nodes are enough: the rest are discovered
    root = write_repo(tmp_path / "cluster", FEATURES, {"stats": _stats(n)})
    config = root / "featurestore.yaml"
    config.write_text(config.read_text() + f"online_store: {{type: redis_cluster, nodes: [{nodes}]}}\n")
    clustered = FeatureStore(root)
    for store in (single, clustered):
        store.apply()
        store.materialize(None, NOW)
    return single, clustered


def _payments(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "payment_id": np.arange(n, dtype=np.int64) + seed * 10_000,
            "card_id": rng.integers(0, 600, n),
            "amount": rng.integers(1, 100, n).astype(float),
            "event_timestamp": pa.array(
                [NOW - timedelta(minutes=int(m)) for m in rng.integers(0, 600, n)], pa.timestamp("us", tz="UTC")
            ),
        }
    )


def test_lookups_equal_a_single_redis(tmp_path, redis_url, cluster, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    ports, _ = cluster
    single, clustered = _stores(tmp_path, redis_url, ports)
    masters = [
        redis.Redis(port=int(name.split(":")[1]))
        for name, node in RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", ports[0])]).cluster_nodes().items()
        if "master" in node["flags"]
    ]
    try:
        for client in [redis.Redis.from_url(redis_url), *masters]:
            client.config_resetstat()
        for store in (single, clustered):
            store.push("payments", _payments(2000, seed=1))
            store.push("payments", _payments(300, seed=1))  # retried events: counted once
        # each call goes to a master whole, over all its slots: at most one script call per master
        # for each the single Redis gets (per slot, the 600 cards' writes took hundreds)
        assert _script_calls(masters) <= 3 * _script_calls([redis.Redis.from_url(redis_url)])
        refs = ["stats:score", "stats:segment", "activity:count_1h", "activity:amount_sum_24h"]
        rng = np.random.default_rng(9)
        for size in (1, 7, 100, 700):
            cards = [int(c) for c in rng.integers(-5, 620, size)]  # unknown ones too, repeats too
            a = single.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
            b = clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
            assert a == b
        from featurestore.aggregation import tiles

        cards = list(range(-2, 60))
        plain = single.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
        with monkeypatch.context() as forced:  # every card through tile summaries: read, sealed, read again
            forced.setattr(tiles, "HEAVY_PER_TILE", 0)
            forced.setattr(tiles, "SEAL_FROM", 1)
            for _ in range(2):
                assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == plain
        assert any(clustered.online_store.client.scan_iter(match=b"*|tiles"))
        offline = (
            clustered.get_historical_features(
                pd.DataFrame({"card_id": list(range(600)), "event_timestamp": [NOW] * 600}),
                features=["activity:count_1h"],
            )
            .to_df()["count_1h"]
            .tolist()
        )
        assert (
            clustered.get_online_features(
                {"card_id": list(range(600))}, features=["activity:count_1h"], at=NOW
            ).to_dict()["count_1h"]
            == offline
        )
        keys = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", ports[0])]).cluster_nodes()
        assert sum(1 for n in keys.values() if "master" in n["flags"] and "fail" not in n["flags"]) == 3
    finally:
        single.close()
        clustered.close()


def test_writes_wait_for_each_masters_replicas_when_asked(tmp_path, redis_url, cluster, monkeypatch):
    """``online_store.wait_for_replicas`` on a cluster: each master written waits for its replicas
    (one each here); asked for two, every write is the store's error naming the master."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    ports, _ = cluster
    single, clustered = _stores(tmp_path, redis_url, ports, n=50)
    config = tmp_path / "cluster" / "featurestore.yaml"
    written = config.read_text()
    try:
        refs = ["stats:score", "activity:count_1h", "activity:amount_sum_24h"]
        for wait, error in (("1", None), ("2, wait_timeout_ms: 200", "1 of the 2 replicas")):
            config.write_text(written.replace("]}", f"], wait_for_replicas: {wait}}}"))
            with FeatureStore(config.parent) as store:
                if error is None:
                    for each in (single, store):
                        each.push("payments", _payments(400, seed=4), to="online")
                    cards = list(range(-2, 600))
                    expected = single.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
                    assert store.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
                    continue
                with pytest.raises(OnlineStoreUnavailable) as short:
                    store.push("payments", _payments(400, seed=5), to="online")
                assert "Redis Cluster master 127.0.0.1:" in str(short.value) and error in str(short.value)
    finally:
        single.close()
        clustered.close()


def _script_calls(clients: list[redis.Redis]) -> int:
    return sum(int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)) for c in clients)


def test_a_master_killed_mid_load_ends_in_recovery_with_no_wrong_value(tmp_path, redis_url, cluster, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    ports, procs = cluster
    single, clustered = _stores(tmp_path, redis_url, ports, n=300)
    try:
        cards = list(range(300))
        expected = single.get_online_features({"card_id": cards}, features=["stats:score"]).to_dict()["score"]
        victim = next(
            p
            for p in ports
            if "master" in redis.Redis(host="127.0.0.1", port=p).execute_command("ROLE")[0].decode()
            and redis.Redis(host="127.0.0.1", port=p).dbsize() > 0
        )
        answers = {"ok": 0, "unavailable": 0}
        killed_at = None
        deadline = time.time() + 60
        while time.time() < deadline:
            if killed_at is None and answers["ok"] >= 20:
                procs[victim].send_signal(signal.SIGKILL)
                killed_at = time.time()
            try:
                got = clustered.get_online_features({"card_id": cards}, features=["stats:score"]).to_dict()["score"]
            except OnlineStoreUnavailable:
                answers["unavailable"] += 1
                time.sleep(0.05)
                continue
            assert got == expected  # never a wrong or missing value
            answers["ok"] += 1
            if killed_at is not None and answers["unavailable"] and answers["ok"] >= 40:
                break
        assert killed_at is not None and answers["unavailable"] > 0, answers  # the failover was seen...
        assert answers["ok"] >= 40, answers  # ...and recovered from, no restart
        clustered.push("payments", _payments(200, seed=4))  # writes work again too
        assert (
            sum(
                clustered.get_online_features({"card_id": cards}, features=["activity:count_1h"], at=NOW).to_dict()[
                    "count_1h"
                ]
            )
            > 0
        )
    finally:
        single.close()
        clustered.close()


def test_the_feature_server_on_a_cluster_answers_200_or_503_through_a_failover(
    tmp_path, redis_url, cluster, monkeypatch
):
    import sys

    from .conftest import free_port

    monkeypatch.delenv("REDIS_URL", raising=False)
    ports, procs = cluster
    single, clustered = _stores(tmp_path, redis_url, ports, n=200)
    expected = single.get_online_features({"card_id": list(range(200))}, features=["stats:score"]).to_dict()["score"]
    single.close()
    clustered.close()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve",
            "--repo",
            str(tmp_path / "cluster"),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 60, (httpx.TransportError,))
        body = {"features": ["stats:score"], "entities": {"card_id": list(range(200))}}
        alive = [p for p in ports if procs[p].poll() is None]
        masters = [p for p in alive if redis.Redis(host="127.0.0.1", port=p).execute_command("ROLE")[0] == b"master"]
        victim = next(
            p for p in masters if redis.Redis(host="127.0.0.1", port=p).execute_command("ROLE")[2]
        )  # has a replica
        statuses: dict[int, int] = {}
        killed = False
        with httpx.Client(base_url=url, timeout=10) as client:
            for i in range(400):
                if i == 20:
                    procs[victim].send_signal(signal.SIGKILL)
                    killed = True
                pushed = client.post(
                    "/push",
                    json={
                        "push_source_name": "payments",
                        "to": "online",
                        "df": {
                            "payment_id": [i],
                            "card_id": [i % 200],
                            "amount": [1.0],
                            "event_timestamp": [NOW.isoformat()],
                        },
                    },
                )
                if pushed.status_code not in (200, 503):  # (a slot map lookup outside the try gave 500s)
                    server.terminate()
                    pytest.fail(
                        f"push answered {pushed.status_code}: {server.communicate(timeout=30)[1].decode()[-3000:]}"
                    )
                response = client.post("/get-online-features", json=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    assert response.json()["results"][1]["values"] == expected
                else:
                    assert response.status_code == 503 and "redis+cluster://" in response.json()["detail"], (
                        response.text
                    )
                    time.sleep(0.05)
                if killed and statuses.get(503) and statuses.get(200, 0) >= 60:
                    break
        assert set(statuses) <= {200, 503} and statuses.get(503) and statuses[200] >= 60, statuses
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_hash_slots_are_redis_pys_for_any_key():
    """The cluster write hashes all its keys at once (numpy); each slot is redis-py's ``key_slot``:
    hash tags, empty and unclosed braces, braces twice, any bytes, arrays that are slices."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from redis.crc import key_slot

    from featurestore.online.redis_cluster import _slots

    pieces = st.sampled_from([b"{", b"}", b"{}", b"card_id=7", b"\xff\x00", b"x", b""])
    keys = st.lists(st.lists(pieces | st.binary(max_size=6), max_size=6).map(b"".join), min_size=1, max_size=40)

    @settings(max_examples=examples(200), deadline=None)
    @given(keys=keys, cut=st.integers(0, 5))
    def check(keys, cut):
        array = pa.array([b"pad"] * cut + keys, pa.binary()).slice(cut)
        assert _slots(array).tolist() == [key_slot(k) for k in keys]

    check()


def test_lookups_follow_a_slot_moving_between_masters_and_read_from_replicas(tmp_path, redis_url, cluster, monkeypatch):
    """Reads go to each slot's node directly; a slot moving (its keys half migrated: ASK) and
    moved (MOVED) are followed with no wrong value, and then read directly again. With
    ``read_from_replicas`` the replicas answer lookups."""
    import asyncio

    from redis.crc import key_slot

    from featurestore.online import redis_cluster
    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    monkeypatch.delenv("REDIS_URL", raising=False)
    ports, procs = cluster
    ports = [p for p in ports if procs[p].poll() is None]  # (the tests before kill masters)
    single, clustered = _stores(tmp_path, redis_url, ports, n=200)
    redirected = []
    for name in ("_read_redirected", "_read_redirected_async"):  # (counted: which way each read went)
        slow_path = getattr(redis_cluster.ClusterRedis, name)
        monkeypatch.setattr(
            redis_cluster.ClusterRedis, name, lambda *a, slow_path=slow_path: redirected.append(1) or slow_path(*a)
        )
    refs = ["stats:score", "stats:segment", "activity:count_1h"]
    cards = list(range(-3, 200))

    def served() -> dict:  # the servers' path
        query = OnlineQuery.prepare(
            clustered.definitions, clustered.config.project, {"card_id": cards}, refs, None, False, now=NOW
        )
        return asyncio.run(OnlineReader(clustered.online_store).read_async(query)).to_dict()

    try:
        for store in (single, clustered):
            store.push("payments", _payments(500, seed=6))
        expected = single.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
        assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
        assert served() == expected
        assert not redirected  # (read directly)
        nodes = {p: redis.Redis(host="127.0.0.1", port=p) for p in ports}
        masters = {p: c for p, c in nodes.items() if c.execute_command("ROLE")[0] == b"master"}
        key = next(k for k in clustered.online_store.client.scan_iter(match=b"*card_id=7}*") if b"|" not in k)
        slot = key_slot(key)
        source = next(p for p, c in masters.items() if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
        target = next(p for p in masters if p != source)
        ids = {p: c.execute_command("CLUSTER", "MYID").decode() for p, c in masters.items()}
        masters[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        masters[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        in_slot = masters[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        assert key in in_slot and len(in_slot) > 1
        masters[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", key)  # the rest stay
        assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
        assert redirected  # (ASK)
        redirected.clear()
        assert served() == expected
        assert redirected
        masters[source].execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *(set(in_slot) - {key}))
        for client in masters.values():
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        redirected.clear()
        assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
        assert redirected  # (MOVED: the slot map read again)
        redirected.clear()
        assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
        assert not redirected
    finally:
        clustered.close()
    config = tmp_path / "cluster" / "featurestore.yaml"
    config.write_text(
        config.read_text().replace("type: redis_cluster,", "type: redis_cluster, read_from_replicas: true,")
    )
    replicas = [c for c in nodes.values() if c.execute_command("ROLE")[0] == b"slave"]
    for client in masters.values():  # (the writes above reached the replicas)
        if client.info("replication")["connected_slaves"]:
            client.execute_command("WAIT", 1, 5000)
    before = _reads(replicas)
    with FeatureStore(tmp_path / "cluster") as from_replicas:
        for _ in range(4):
            assert from_replicas.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
    assert _reads(replicas) > before
    single.close()


def _reads(clients: list[redis.Redis]) -> int:
    return sum(int(c.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)) for c in clients)


def test_a_cluster_that_requires_a_password_is_reached_with_the_one_in_the_url(tmp_path, redis_url, monkeypatch):
    """``redis+cluster://[user]:password@h:p,...`` (percent-encoded, as ``redis://``): writes,
    lookups on both paths, pushes; without it or with a wrong one, the store's error, the
    password never in it."""
    import asyncio

    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    monkeypatch.delenv("REDIS_URL", raising=False)
    secret = "s3cret/pa:ss@"
    procs = start_local_cluster(tmp_path / "nodes", masters=3, replicas=0, password=secret)
    try:
        hosts = ",".join(f"127.0.0.1:{p}" for p in list(procs)[:2])
        single = FeatureStore(write_repo(tmp_path / "single", FEATURES, {"stats": _stats(100)}, url=redis_url))
        root = write_repo(tmp_path / "cluster", FEATURES, {"stats": _stats(100)})
        config = root / "featurestore.yaml"
        plain = config.read_text()
        config.write_text(plain + "online_store: {url: 'redis+cluster://:s3cret%2Fpa%3Ass%40@" + hosts + "'}\n")
        refs = ["stats:score", "stats:segment", "activity:count_1h"]
        cards = list(range(-2, 110))
        with FeatureStore(root) as clustered:
            for store in (single, clustered):
                store.apply()
                store.materialize(None, NOW)
                store.push("payments", _payments(400, seed=8))
            expected = single.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
            assert clustered.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict() == expected
            query = OnlineQuery.prepare(
                clustered.definitions, clustered.config.project, {"card_id": cards}, refs, None, False, now=NOW
            )
            assert asyncio.run(OnlineReader(clustered.online_store).read_async(query)).to_dict() == expected
        single.close()
        for userinfo in ("", ":wrong-one@"):
            config.write_text(plain + f"online_store: {{url: 'redis+cluster://{userinfo}{hosts}'}}\n")
            with pytest.raises(OnlineStoreUnavailable) as refused:
                with FeatureStore(root) as store:
                    store.get_online_features({"card_id": [1]}, features=refs)
            assert "redis+cluster://" in str(refused.value) and "wrong-one" not in str(refused.value)
            assert "refused" in str(refused.value) and "password@host:port" in str(refused.value), refused.value
    finally:
        stop_local_cluster(procs)
