"""``featurestore capacity``: memory per layout, Redis time per lookup and per event, on a real Redis."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from featurestore import FeatureStore
from featurestore.online.embedded import EmbeddedRedis
from tests.conftest import write_repo

FEATURES = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
payments = PushSource(name="payments", schema=[
    Field("payment_id", Int64), Field("card_id", Int64), Field("amount", Float64),
    Field("event_timestamp", UnixTimestamp)])
profiles = PushSource(name="profiles", schema=[
    Field("card_id", Int64), Field("segment", String), Field("event_timestamp", UnixTimestamp)])
activity = FeatureView(name="activity", entities=[card], source=payments, event_id="payment_id",
    schema=[Field("payment_id", Int64), Field("amount", Float64)],
    aggregations=[Aggregation("sum", timedelta(days=7), "amount"), Aggregation("count", timedelta(hours=1))])
profile = FeatureView(name="profile", entities=[card], source=profiles, schema=[Field("segment", String)])
"""
CARDS = 30
TS = pa.timestamp("us", tz="UTC")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repo on a Redis of its own: card i has a profile and i + 1 payments in the last days."""
    folder = tmp_path_factory.mktemp("capacity")
    server = EmbeddedRedis(folder / "redis")
    root = write_repo(folder / "repo", FEATURES, url=server.ensure_running())
    _write_cards(root)
    yield root
    server.stop()


def _write_cards(root) -> None:
    """Card i has a profile and i + 1 payments in the last days."""
    now = datetime.now(UTC)
    with FeatureStore(root) as store:
        store.apply()
        cards = list(range(1, CARDS + 1))
        store.push(
            "profiles",
            pa.table({"card_id": cards, "segment": ["s"] * CARDS, "event_timestamp": pa.array([now] * CARDS, TS)}),
            to="online",
        )
        paying = [card for card in cards for _ in range(card)]
        store.push(
            "payments",
            pa.table(
                {
                    "payment_id": list(range(len(paying))),
                    "card_id": paying,
                    "amount": [float(i % 7) for i in range(len(paying))],
                    "event_timestamp": pa.array([now - timedelta(minutes=3 * i) for i in range(len(paying))], TS),
                }
            ),
            to="online",
        )


def test_capacity_measures_each_layout_of_the_repos_own_keys(repo):
    from featurestore import capacity

    with FeatureStore(repo) as store:
        client = store.online_store.client
        keys_before = sorted(client.keys())
        events = [k for k in keys_before if b":ev:" in k and b"|" not in k]
        events_before = {k: client.zcard(k) for k in events}
        measured = capacity.measure(store.online_store, store.definitions, store.config.project)
        assert sorted(client.keys()) == keys_before  # the write probe's keys are gone, the repo's untouched
        assert {k: client.zcard(k) for k in events_before} == events_before
        hashes = [k for k in keys_before if k.endswith(b"}")]
        hash_bytes = sum(client.memory_usage(k, samples=0) for k in hashes) / len(hashes)
        event_bytes = sum(
            sum(client.memory_usage(part, samples=0) or 0 for part in (k, k + b"|ids", k + b"|tiles")) for k in events
        ) / len(events)
    layouts = {c.name: c for c in measured.layouts}
    assert set(layouts) == {"latest values (card_id)", "activity events"}
    latest, activity = layouts["latest values (card_id)"], layouts["activity events"]
    assert (latest.entities, activity.entities) == (CARDS, CARDS) and measured.sampled == CARDS
    assert latest.bytes_per_entity == hash_bytes and latest.events_per_entity is None
    assert activity.bytes_per_entity == event_bytes
    assert activity.events_per_entity == sum(range(1, CARDS + 1)) / CARDS
    assert measured.entities_now == CARDS  # every key of the Redis is the project's
    assert measured.lookup_us is not None and measured.lookup_us > 0
    assert measured.event_write_us is not None and measured.event_write_us > 0
    assert measured.memory_for(10**8) == 10**8 * (hash_bytes + event_bytes)
    per_event = event_bytes / activity.events_per_entity
    assert measured.memory_for(10**8, 100) == pytest.approx(10**8 * (hash_bytes + 100 * per_event))
    report = measured.describe(10**8, 100, capacity.parse_size("25GB"))
    nodes = -(-measured.memory_for(10**8, 100) // 25e9)
    assert f"→ {nodes:.0f} Redis nodes of 25.0 GB" in report and "lookups/s per Redis core" in report
    light_load = measured.describe(10**8, 100, capacity.parse_size("25GB"), lookups_per_second=1)
    assert f"size for {nodes:.0f} (the memory decides" in light_load


def test_capacity_on_a_cluster_counts_every_masters_keys_memory_and_cpu(tmp_path, monkeypatch):
    """On a Redis Cluster the measurement failed (redis-py refuses RANDOMKEY pipelined), and its
    keys, memory and Redis CPU were one node's (the node redis-py's client chose): now every
    master's, summed."""
    import redis

    from featurestore import capacity
    from featurestore.online.local_cluster import start_local_cluster, stop_local_cluster

    monkeypatch.delenv("REDIS_URL", raising=False)
    procs = start_local_cluster(tmp_path / "nodes", masters=3, replicas=0)
    try:
        root = write_repo(tmp_path / "repo", FEATURES)
        nodes = ", ".join(f"'127.0.0.1:{p}'" for p in list(procs)[:2])
        config = root / "featurestore.yaml"
        config.write_text(config.read_text() + f"online_store: {{type: redis_cluster, nodes: [{nodes}]}}\n")
        _write_cards(root)
        with FeatureStore(root) as store:
            measured = capacity.measure(store.online_store, store.definitions, store.config.project)
        masters = [redis.Redis(port=port) for port in procs]
        assert measured.keys == sum(m.dbsize() for m in masters) and measured.keys > max(m.dbsize() for m in masters)
        assert measured.entities_now == CARDS and measured.sampled == CARDS
        memory = sum(m.info("memory")["used_memory"] for m in masters)
        assert abs(measured.used_memory - memory) < 0.1 * memory
        assert measured.event_write_us is not None and measured.event_write_us > 0
    finally:
        stop_local_cluster(procs)


def _cli(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "capacity", *args, "--repo", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_capacity_command_prints_the_model_and_refuses_bad_input(repo, tmp_path):
    done = _cli(repo, "--entities", "100000000", "--events-per-entity", "100", "--node-memory", "64GiB")
    assert done.returncode == 0, done.stderr
    assert "activity events" in done.stdout and "events/s per Redis core" in done.stdout
    assert "100,000,000 entities per layout × 100 events" in done.stdout
    bad = _cli(repo, "--node-memory", "lots")
    assert bad.returncode != 0 and "a size is a number and a unit" in bad.stderr and "Traceback" not in bad.stderr
    server = EmbeddedRedis(tmp_path / "redis")
    empty = write_repo(tmp_path / "empty", FEATURES, url=server.ensure_running())
    try:
        with FeatureStore(empty) as store:
            store.apply()
        nothing = _cli(empty)
    finally:
        server.stop()
    assert nothing.returncode != 0 and "holds no entities of this project" in nothing.stderr
    assert "Traceback" not in nothing.stderr


def test_capacity_sizes_a_load_of_lookups_and_writes_in_redis_cores_and_nodes(repo):
    """A load of lookups and events a second costs Redis cores at the measured cost of each; a
    node is sized to be at most half busy, and the larger of what memory and load need decides."""
    done = _cli(repo, "--entities", "1000", "--lookups-per-second", "300000", "--events-per-second", "400000")
    assert done.returncode == 0, done.stderr
    lookup_us = float(re.search(r"per lookup of 1 entity, every view: ([0-9.]+) µs", done.stdout).group(1))
    write_us = float(re.search(r"per event written \(256 a call\): ([0-9.]+) µs", done.stdout).group(1))
    line = re.search(
        r"300,000 lookups/s and 400,000 events/s: ([0-9.,]+) cores of Redis CPU → (\d+) Redis node", done.stdout
    )
    assert line, done.stdout
    cores, nodes = float(line.group(1).replace(",", "")), int(line.group(2))
    # (the report's µs are rounded to 0.1 and 0.01: the cores it prints may differ by that much)
    assert cores == pytest.approx((300_000 * lookup_us + 400_000 * write_us) / 1e6, abs=0.03)
    assert nodes == math.ceil(cores / 0.5) and f"size for {nodes} (the load decides" in done.stdout
    refused = _cli(repo, "--events-per-second", "10", "--no-probe-writes")
    assert refused.returncode != 0 and "needs the cost of a write" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_capacity_says_how_to_pack_from_fewer_events_on_a_redis_with_the_default_compact_limit(repo):
    """A Redis keeping sorted sets compact only up to 64-byte members (its default) makes blocks wait
    for 16 events: the report says what to set; on the embedded server (1 KB) it says nothing."""
    from featurestore import capacity

    with FeatureStore(repo) as store:
        measured = capacity.measure(store.online_store, store.definitions, store.config.project, probe=False)
        assert measured.compact_value_limit == 1024 and "CONFIG SET" not in measured.describe(None, None, 25 * 10**9)
        client = store.online_store.client
        setting = next(iter(client.config_get("zset-max-*-value")))  # (listpack from Redis 7, ziplist before)
        client.config_set(setting, 64)
        try:
            with FeatureStore(repo) as fresh:
                default = capacity.measure(fresh.online_store, fresh.definitions, fresh.config.project, probe=False)
                assert fresh.online_store.pack_from() == 16
        finally:
            client.config_set(setting, 1024)
    report = default.describe(None, None, 25 * 10**9)
    assert default.compact_value_limit == 64
    assert "CONFIG SET zset-max-listpack-value 1024" in report and "from 8" in report, report


def test_capacity_counts_the_events_in_the_window_and_the_bytes_of_what_is_kept_past_it(tmp_path):
    """A card a window on keeps its previous window's blocks, whose directories record the writes
    the duplicate rule needs for a dedup window (the longest window): its events per entity are
    those of the window, its bytes all it holds, so a steady store's sample sizes a steady store.
    Counting every event held, as before, halved such a card's bytes per event."""
    from featurestore import capacity
    from featurestore.online import packed
    from featurestore.online.base import EVENT_SCORES

    server = EmbeddedRedis(tmp_path / "redis")
    root = write_repo(tmp_path / "repo", FEATURES, url=server.ensure_running())
    now = datetime.now(UTC).replace(microsecond=0)
    try:
        with FeatureStore(root) as store:
            store.apply()
            view = store.get_feature_view("activity")
            schema = store.definitions.history_schema(view)
            for k, writer in enumerate((now - timedelta(days=7), now)):  # the previous window, then this one
                times = pa.array([writer - timedelta(hours=1 + 4 * i) for i in range(40)], TS)
                rows = {"card_id": [1] * 40, "event_timestamp": times, "created_timestamp": times, "_run_id": [k] * 40}
                rows |= {"_row_id": range(40), "payment_id": range(40 * k, 40 * k + 40), "amount": [1.0] * 40}
                store.materializer().write_online(view, pa.table(rows).cast(schema), writer)
            client, key = store.online_store.client, next(store.online_store.client.scan_iter(b"*:ev:*[^s]"))
            held = client.zrangebyscore(key, *EVENT_SCORES)
            assert packed.event_count(held) > 40 and any(packed.is_block(m) for m in held)  # (older blocks kept)
            measured = capacity.measure(store.online_store, store.definitions, store.config.project, probe=False)
            total = sum(client.memory_usage(part, samples=0) or 0 for part in (key, key + b"|ids", key + b"|tiles"))
    finally:
        server.stop()
    activity = next(c for c in measured.layouts if c.name == "activity events")
    assert activity.events_per_entity == 40 and activity.bytes_per_entity == total


def test_capacity_says_when_entities_hold_values_of_layouts_no_longer_read(tmp_path):
    """After a definition change (or an upgrade) re-sent under a new layout, entities also hold
    their values under the earlier one, read by nothing: capacity says how many of those it
    sampled, and what deletes them; after ``drop_old_layouts``, nothing."""
    from featurestore import capacity

    server = EmbeddedRedis(tmp_path / "redis")
    root = write_repo(tmp_path / "repo", FEATURES, url=server.ensure_running())
    now = datetime.now(UTC)
    profiles = pa.table({"card_id": [1, 2, 3], "segment": ["s"] * 3, "event_timestamp": pa.array([now] * 3, TS)})
    try:
        with FeatureStore(root) as store:
            store.apply()
            store.push("profiles", profiles, to="online")
        tier = 'Field("segment", String), Field("tier", String)'
        changed = FEATURES.replace('Field("segment", String)', tier)
        (root / "features.py").write_text(changed)
        with FeatureStore(root) as store:
            store.apply()  # (a column more: the profile view's values are written under a new layout)
            store.push("profiles", profiles.slice(0, 2).append_column("tier", pa.array(["t"] * 2)), to="online")

            def measured() -> capacity.Capacity:
                return capacity.measure(store.online_store, store.definitions, store.config.project, probe=False)

            report = measured()
            assert report.earlier_layouts == 3  # (card 3 holds only the earlier layout's value)
            assert "3 of the sampled entities" in report.describe(None, None, capacity.parse_size("25GB"))
            assert "`featurestore compact --drop-old-layouts`" in report.describe(None, None, 10**9)
            store.drop_old_layouts()
            report = measured()
            assert report.earlier_layouts == 0 and "--drop-old-layouts" not in report.describe(None, None, 10**9)
    finally:
        server.stop()


def test_capacity_counts_the_keys_and_bytes_of_events_of_layouts_no_longer_read(tmp_path):
    """A longer window re-lays an aggregated view out: the earlier layout's events keys stay until
    they expire. Capacity counts them (their share of the keys its scan met, of the project's keys:
    here every key) and their bytes, apart from the layouts it sizes; after ``drop_old_layouts``,
    none."""
    from featurestore import capacity

    server = EmbeddedRedis(tmp_path / "redis")
    root = write_repo(tmp_path / "repo", FEATURES, url=server.ensure_running())
    now = datetime.now(UTC)

    def payments(cards: list[int], first_id: int) -> pa.Table:
        return pa.table(
            {
                "payment_id": list(range(first_id, first_id + len(cards))),
                "card_id": cards,
                "amount": [1.5] * len(cards),
                "event_timestamp": pa.array([now - timedelta(minutes=i) for i in range(len(cards))], TS),
            }
        )

    try:
        with FeatureStore(root) as store:
            store.apply()
            store.push("payments", payments([1, 1, 2, 3, 4], 0), to="online")
            client = store.online_store.client
            earlier = set(client.keys(b"*:ev:*"))
        (root / "features.py").write_text(FEATURES.replace("timedelta(days=7)", "timedelta(days=14)"))
        with FeatureStore(root) as store:
            store.apply()
            store.push("payments", payments([1, 2], 100), to="online")
            assert not earlier & set(client.keys(b"*:ev:*")) - earlier  # (the new layout's keys are others)

            def measured() -> capacity.Capacity:
                return capacity.measure(store.online_store, store.definitions, store.config.project, probe=False)

            report = measured()
            assert report.earlier_event_keys == len(earlier) > 0
            assert report.earlier_event_bytes == sum(client.memory_usage(k, samples=0) for k in earlier)
            assert {c.name: c.entities for c in report.layouts} == {"activity events": 2}  # (cards 1 and 2: now)
            assert f"About {len(earlier):,} keys" in report.describe(None, None, 10**9)
            store.drop_old_layouts()
            report = measured()
            assert report.earlier_event_keys == 0 and "About" not in report.describe(None, None, 10**9)
    finally:
        server.stop()
