"""Redis behind Sentinel (``redis+sentinel://``): real processes (a master, its replica, three
sentinels, the redis-server this project ships); every path of the store equals a plain Redis's,
and a master killed under lookups and writes fails over with no wrong value served: the
store's error (a 503) while no master answers, then the promoted replica serves the same values
and takes writes, with no restart."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from featurestore import FeatureStore
from featurestore.errors import FeatureStoreError, OnlineStoreUnavailable
from featurestore.online.embedded import COMPACT_ENCODINGS, redis_server_binary
from featurestore.online.local_cluster import free_ports, wait_until
from featurestore.retrieval.online import OnlineQuery, OnlineReader

from .conftest import assert_every_path_serves, write_repo
from .test_redis_cluster import FEATURES, NOW, _payments, _stats

SERVICE = "features"
REFS = ["stats:score", "stats:segment", "activity:count_1h", "activity:amount_sum_24h"]
CARDS = list(range(-2, 110))


class Sentinels:
    """A master, its replica and three sentinels watching them (quorum 2), on loopback."""

    def __init__(self, folder: Path, password: str | None = None, sentinel_password: str | None = None):
        """With ``password`` the nodes require it; with ``sentinel_password`` the sentinels require theirs."""
        self.master, self.replica, *self.sentinels = free_ports(5)
        self.folder, self.password = folder, password
        secret = f"sentinel auth-pass {SERVICE} {password}\n" if password else ""
        if sentinel_password:
            secret += f"requirepass {sentinel_password}\nsentinel sentinel-pass {sentinel_password}\n"
        self.processes: dict[int, subprocess.Popen] = {}
        server = redis_server_binary()
        self.start(self.master)
        self.start(self.replica, "--replicaof", "127.0.0.1", str(self.master))
        for port in self.sentinels:
            config = folder / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 500\nsentinel failover-timeout {SERVICE} 3000\n{secret}"
            )
            self.processes[port] = subprocess.Popen([server, str(config), "--sentinel"], stdout=subprocess.DEVNULL)
        sentinel = redis.Redis(port=self.sentinels[0], password=sentinel_password)
        replica = redis.Redis(port=self.replica, password=password)
        wait_until(lambda: replica.info("replication")["master_link_status"] == "up")
        wait_until(
            lambda: len(sentinel.sentinel_slaves(SERVICE)) == 1 and len(sentinel.sentinel_sentinels(SERVICE)) == 2
        )

    def start(self, port: int, *options: str) -> None:
        """(Again after a kill: empty, as with no persistence; the sentinels make it a replica.)"""
        (self.folder / str(port)).mkdir(parents=True, exist_ok=True)
        secret = ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        self.processes[port] = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            + ["--dir", str(self.folder / str(port)), *COMPACT_ENCODINGS, *secret, *options],
            stdout=subprocess.DEVNULL,
        )

    def kill(self, port: int) -> None:
        self.processes[port].kill()
        self.processes[port].wait()

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinels[:2]) + f"/{SERVICE}"

    def stop(self) -> None:
        for process in self.processes.values():
            process.kill()
            process.wait()


@pytest.fixture
def sentinels(tmp_path) -> Iterator[Sentinels]:
    started = Sentinels(tmp_path / "nodes")
    yield started
    started.stop()


def _stores(tmp_path: Path, redis_url: str, url: str, options: str = "") -> tuple[FeatureStore, FeatureStore]:
    plain = FeatureStore(write_repo(tmp_path / "plain", FEATURES, {"stats": _stats(100)}, url=redis_url))
    root = write_repo(tmp_path / "sentinel", FEATURES, {"stats": _stats(100)}, url=url, online_options=options)
    watched = FeatureStore(root)
    for store in (plain, watched):
        store.apply()
        store.materialize(None, NOW)
        store.push("payments", _payments(400, seed=8))
    return plain, watched


def _lookup(store: FeatureStore) -> dict:
    return store.get_online_features({"card_id": CARDS}, features=REFS, at=NOW).to_dict()


def test_every_path_of_the_store_works_through_sentinel(sentinels, tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    plain, watched = _stores(tmp_path, redis_url, sentinels.url)
    try:
        assert redis.Redis(port=sentinels.master).dbsize() > 0  # (on the master the sentinels name)
        assert_every_path_serves(watched, {"card_id": CARDS}, REFS, NOW, _lookup(plain))
    finally:
        plain.close()
        watched.close()


def test_a_master_killed_under_load_fails_over_with_no_wrong_value_and_no_restart(
    sentinels, tmp_path, redis_url, monkeypatch
):
    """With ``wait_for_replicas: 1`` every write the store acknowledged is on the replica: the
    master is killed right after the last one, and the promoted replica serves all of them."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    plain, watched = _stores(tmp_path, redis_url, sentinels.url, ", wait_for_replicas: 1")
    try:
        expected = _lookup(plain)
        assert _lookup(watched) == expected
        online = watched.online_store
        plan = OnlineQuery.prepare(
            watched.definitions, watched.config.project, {"card_id": CARDS}, REFS, None, False, now=NOW
        )

        async def lookups_until_served_again() -> tuple[int, int]:  # (a server's path, on one loop)
            failed = served = 0
            deadline = time.monotonic() + 60
            while served < 20:
                assert time.monotonic() < deadline, "no lookup served after the failover"
                try:
                    assert (await OnlineReader(online).read_async(plan)).to_dict() == expected
                    served += failed > 0
                except OnlineStoreUnavailable:
                    failed += 1
                    await asyncio.sleep(0.05)
            return failed, served

        sentinels.kill(sentinels.master)
        failed, _ = asyncio.run(lookups_until_served_again())
        assert failed > 0  # (the master was gone a while: an error, never a wrong value)
        master = redis.Redis(port=sentinels.sentinels[0]).sentinel_get_master_addr_by_name(SERVICE)
        assert int(master[1]) == sentinels.replica
        with pytest.raises(OnlineStoreUnavailable, match="0 of the 1 replicas"):  # (none left to acknowledge)
            watched.push("payments", _payments(50, seed=9))
        sentinels.start(sentinels.master)  # back, empty: the sentinels make it the new master's replica
        deadline = time.monotonic() + 60
        while True:  # the SDK's connections too, and writes, reach the promoted replica
            try:
                for store in (plain, watched):
                    store.push("payments", _payments(50, seed=9))
                break
            except OnlineStoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert _lookup(watched) == _lookup(plain) != expected
    finally:
        plain.close()
        watched.close()


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis+sentinel://127.0.0.1:26379", "does not name sentinels and a service"),
        ("redis+sentinel://127.0.0.1:26379/features/x", "does not name sentinels and a service"),
        ("redis+sentinel://:secret@127.0.0.1:x/features", "is not host:port"),
    ],
)
def test_a_sentinel_url_with_a_typo_is_one_error(tmp_path, monkeypatch, url, says):
    monkeypatch.setenv("REDIS_URL", url)
    (tmp_path / "featurestore.yaml").write_text("project: p\n")
    with pytest.raises(FeatureStoreError) as caught:
        FeatureStore(tmp_path)
    assert says in str(caught.value) and "secret" not in str(caught.value)


def test_writes_wait_for_the_replicas_asked_for_and_fail_without_them(sentinels, tmp_path, monkeypatch):
    """``online_store.wait_for_replicas``: a write returns once that many replicas have it (the
    replica holds every key the master does the moment it returns); asked for more replicas than
    answer within ``wait_timeout_ms``, the write is the store's error saying so (a 503 on the
    servers), and a retry once they are back converges (writes are idempotent)."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    # (pack_pushes off: no packing in the background, a write of its own, between a push and the check)
    root = write_repo(
        tmp_path / "repo", FEATURES, {"stats": _stats(100)}, url=sentinels.url, online_options=", pack_pushes: false"
    )
    config = root / "featurestore.yaml"
    written = config.read_text()
    master, replica = redis.Redis(port=sentinels.master), redis.Redis(port=sentinels.replica)
    config.write_text(written.replace("}", ", wait_for_replicas: 1}", 1))
    with FeatureStore(root) as store:
        store.apply()
        for seed in range(3):
            store.push("payments", _payments(300, seed=seed), to="online")
            assert sorted(replica.keys()) == sorted(master.keys())  # (no sleep: the write waited for it)
        assert store.online_store.first_use("retry-1", "a", 10, 60) == (10, "a")  # (a push's idempotency key)
        assert any(b"idem:retry-1" in key for key in replica.keys())
        expected = _lookup(store)
    config.write_text(written.replace("}", ", wait_for_replicas: 2, wait_timeout_ms: 200}", 1))
    with FeatureStore(root) as store:
        with pytest.raises(OnlineStoreUnavailable) as short:
            store.push("payments", _payments(300, seed=7), to="online")
        assert "1 of the 2 replicas online_store.wait_for_replicas asks for" in str(short.value), short.value
        assert "within 200 ms" in str(short.value) and "retry" in str(short.value)
    config.write_text(written.replace("}", ", wait_for_replicas: 1}", 1))
    with FeatureStore(root) as store:
        store.push("payments", _payments(300, seed=7), to="online")  # (the retry)
        assert _lookup(store) != expected


def test_nodes_and_sentinels_that_require_passwords_take_the_ones_in_the_url(tmp_path, redis_url, monkeypatch):
    """The nodes' password in the URL (percent-encoded), the sentinels' own in its query; a
    sentinel password missing is the store's error, neither password in it."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    watched = Sentinels(tmp_path / "nodes", password="n0de/pw", sentinel_password="s3nt:pw")
    try:
        hosts = ",".join(f"127.0.0.1:{p}" for p in watched.sentinels)
        url = f"redis+sentinel://:n0de%2Fpw@{hosts}/{SERVICE}"
        plain, store = _stores(tmp_path, redis_url, url + "?sentinel_password=s3nt%3Apw")
        try:
            assert _lookup(store) == _lookup(plain)
        finally:
            plain.close()
            store.close()
        (tmp_path / "sentinel" / "featurestore.yaml").write_text(f"project: p\nonline_store: {{url: '{url}'}}\n")
        with pytest.raises(OnlineStoreUnavailable) as refused:
            with FeatureStore(tmp_path / "sentinel") as store:
                store.online_store.ping()
        assert "n0de" not in str(refused.value) and "s3nt" not in str(refused.value), refused.value
        assert "refused" in str(refused.value) and "sentinel_password=" in str(refused.value), refused.value
        assert "<redis.client" not in str(refused.value)  # (each sentinel by its address, not redis-py's repr)
    finally:
        watched.stop()


def test_lookups_read_the_replicas_with_read_from_replicas(sentinels, tmp_path, redis_url, monkeypatch):
    """``read_from_replicas: true`` through Sentinel: the SDK's and the servers' lookups read a
    replica the sentinels name (its reads grow, the master's do not), equal to a plain Redis's."""
    import asyncio

    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    monkeypatch.delenv("REDIS_URL", raising=False)
    options = ", wait_for_replicas: 1, read_from_replicas: true"  # (the replica has every write: no lag to wait out)
    plain, watched = _stores(tmp_path, redis_url, sentinels.url, options)
    master, replica = redis.Redis(port=sentinels.master), redis.Redis(port=sentinels.replica)

    def reads(client: redis.Redis) -> int:
        return int(client.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0))

    try:
        before = reads(master), reads(replica)
        assert _lookup(watched) == _lookup(plain)
        plan = OnlineQuery.prepare(
            watched.definitions, watched.config.project, {"card_id": CARDS}, REFS, None, False, now=NOW
        )
        assert asyncio.run(OnlineReader(watched.online_store).read_async(plan)).to_dict() == _lookup(plain)
        assert reads(master) == before[0] and reads(replica) >= before[1] + 2
    finally:
        plain.close()
        watched.close()
