"""The online-store contract, run on every back end: a single Redis and a real local Redis Cluster
(3 masters). Each test states one thing a caller relies on (``featurestore.online.base``) and
must hold on both transports, the async paths and heavy entities' tile reads included."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
import redis

from featurestore import FeatureStore
from featurestore.aggregation import tiles
from featurestore.online.local_cluster import start_local_cluster, stop_local_cluster
from featurestore.online.lua import HEAP_MOST_KB
from featurestore.retrieval.online import OnlineQuery, OnlineReader

from .conftest import a_message_published, write_repo

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
    aggregations=[Aggregation("count", timedelta(hours=1)), Aggregation("sum", timedelta(hours=24), "amount"),
                  Aggregation("max", timedelta(hours=6), "amount")])
"""
TS = pa.timestamp("us", tz="UTC")


@pytest.fixture(scope="module")
def cluster_nodes(tmp_path_factory):
    procs = start_local_cluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=0)
    yield list(procs)
    stop_local_cluster(procs)


@pytest.fixture(params=["single", "cluster"])
def backend(request, tmp_path, redis_url, monkeypatch):
    """A fresh repo (its own project: its own keys) on the back end, applied."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    stats = pa.table(
        {
            "card_id": np.arange(50, dtype=np.int64),
            "event_timestamp": pa.array([NOW - timedelta(hours=2)] * 50, TS),
            "score": np.arange(50, dtype=np.float64) / 4,
            "segment": pa.array([f"s{i % 7}" for i in range(50)]),
        }
    )
    if request.param == "single":
        root = write_repo(tmp_path, FEATURES, {"stats": stats}, url=redis_url)
    else:
        ports = request.getfixturevalue("cluster_nodes")
        root = write_repo(tmp_path, FEATURES, {"stats": stats})
        config = root / "featurestore.yaml"
        nodes = ", ".join(f"'127.0.0.1:{p}'" for p in ports[:2])  # a few are enough: the rest are discovered
        config.write_text(config.read_text() + f"online_store: {{type: redis_cluster, nodes: [{nodes}]}}\n")
    store = FeatureStore(root)
    store.apply()
    yield store
    store.close()


def _payments(ids: range, cards: int = 40) -> pa.Table:
    n = len(ids)
    rng = np.random.default_rng(ids.start)
    return pa.table(
        {
            "payment_id": np.array(ids, dtype=np.int64),
            "card_id": rng.integers(0, cards, n),
            "amount": rng.integers(1, 100, n).astype(float),
            "event_timestamp": pa.array([NOW - timedelta(minutes=int(m)) for m in rng.integers(0, 600, n)], TS),
        }
    )


def _reference(events: pa.Table, cards: list[int]) -> dict[str, list]:
    """The aggregates by a loop over the distinct events."""
    rows = {r["payment_id"]: r for r in events.to_pylist()}.values()
    out: dict[str, list] = {"count_1h": [], "amount_sum_24h": [], "amount_max_6h": []}
    for card in cards:
        mine = [r for r in rows if r["card_id"] == card]
        within = lambda hours: [r["amount"] for r in mine if r["event_timestamp"] > NOW - timedelta(hours=hours)]
        out["count_1h"].append(len(within(1)))
        out["amount_sum_24h"].append(float(sum(within(24))))
        out["amount_max_6h"].append(max(within(6), default=None))
    return out


REFS = ["activity:count_1h", "activity:amount_sum_24h", "activity:amount_max_6h"]


def test_latest_values_are_written_once_and_never_regress(backend):
    backend.materialize(None, NOW)
    cards = [-1, *range(50), 10_000]
    got = backend.get_online_features({"card_id": cards}, features=["stats:score", "stats:segment"]).to_dict()
    assert got["score"] == [None, *(i / 4 for i in range(50)), None]
    older = pa.table(
        {
            "card_id": pa.array([3], pa.int64()),
            "event_timestamp": pa.array([NOW - timedelta(hours=5)], TS),
            "score": [99.0],
            "segment": ["old"],
        }
    )
    backend.write_to_online_store("stats", older)  # older than what is stored: must not replace it
    assert backend.get_online_features({"card_id": [3]}, features=["stats:score"]).to_dict()["score"] == [0.75]
    newer = older.set_column(1, "event_timestamp", pa.array([NOW - timedelta(minutes=1)], TS))
    backend.write_to_online_store("stats", newer)
    assert backend.get_online_features({"card_id": [3]}, features=["stats:score"]).to_dict()["score"] == [99.0]


def test_events_count_once_per_id_on_the_sync_and_async_paths(backend):
    first = _payments(range(0, 800))
    backend.push("payments", first, to="online")
    backend.push("payments", first.slice(100, 300), to="online")  # retried: counted once
    cards = list(range(-2, 42))
    want = _reference(first, cards)
    assert backend.get_online_features({"card_id": cards}, features=REFS, at=NOW).to_dict() == {
        "card_id": cards,
        **want,
    }

    async def served():
        query = OnlineQuery.prepare(
            backend.definitions, backend.config.project, {"card_id": cards}, REFS, None, False, now=NOW
        )
        return (await OnlineReader(backend.online_store).read_async(query)).to_dict()

    assert asyncio.run(served()) == {"card_id": cards, **want}


def test_heavy_entities_read_tile_summaries_sync_and_async_with_the_events_values(backend, monkeypatch):
    """A lookup reading two or more heavy windows failed on Redis Cluster's async path: the store
    used the single Redis's ``read_tiles_async``, whose ``evalsha`` redis-py blocks in cluster
    pipelines, outside the ``try`` that maps store errors to 503."""
    from featurestore.retrieval.online.plan import _WindowPlan

    events = _payments(range(0, 2000))
    backend.push("payments", events, to="online")
    cards = list(range(0, 40))
    want = {"card_id": cards, **_reference(events, cards)}
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)  # every card through tile summaries
    monkeypatch.setattr(tiles, "SEAL_FROM", 1)

    reader = OnlineReader(backend.online_store)

    def query():
        return OnlineQuery.prepare(
            backend.definitions, backend.config.project, {"card_id": cards}, REFS, None, False, now=NOW
        )

    async def served():  # the servers' path first: tiles read, then their summaries stored, on the event loop
        answers = []
        for _ in range(2):  # summaries stored after the first lookup, read by the second
            answers.append((await reader.read_async(query())).to_dict())
            await reader.drain()
        return answers

    assert asyncio.run(served()) == [want, want]
    assert any(backend.online_store.client.scan_iter(match=backend.online_store.prefix + b"*|tiles"))
    for _ in range(2):  # the SDK's path, on those summaries
        assert reader.read(query()).to_dict() == want
    # heavy from 20 events: a card of fewer members (its events packed) is read whole, its
    # summaries beside its plain read (HGETALL: RESP3's map on one node, a dict from the cluster's pipeline)
    monkeypatch.setattr(_WindowPlan, "heavy_from", lambda self: 20)
    reader.heavy.clear()
    members = [backend.online_store.client.zcard(key) for key, *_ in query().ranges]
    assert any(n < 20 for n in members)
    assert reader.read(query()).to_dict() == want  # (the servers' path places replies alike)


def test_a_redis_that_lost_its_scripts_gets_them_again_sync_and_async(backend, monkeypatch):
    events = _payments(range(5000, 5600))
    backend.push("payments", events, to="online")
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)
    cards = list(range(0, 40))
    want = {"card_id": cards, **_reference(events, cards)}
    backend.online_store.client.script_flush()  # as after a restart
    backend.push("payments", events.slice(0, 10), to="online")  # writes: reloaded, retried, still once
    assert backend.get_online_features({"card_id": cards}, features=REFS, at=NOW).to_dict() == want
    backend.online_store.client.script_flush()

    reader = OnlineReader(backend.online_store)

    def query():
        return OnlineQuery.prepare(
            backend.definitions, backend.config.project, {"card_id": cards}, REFS, None, False, now=NOW
        )

    async def served():  # (one event loop, as a server's: the async clients belong to it)
        first = (await reader.read_async(query())).to_dict()
        # the cards now known heavy: their summaries are read in the lookup's first round trip
        backend.online_store.client.script_flush()
        return first, (await reader.read_async(query())).to_dict()

    assert asyncio.run(served()) == (want, want)
    backend.online_store.client.script_flush()
    assert reader.read(query()).to_dict() == want


def test_freshness_health_broadcast_and_idempotency(backend):
    store = backend.online_store
    backend.materialize(None, NOW)
    assert store.newest()["stats"] == int((NOW - timedelta(hours=2)).timestamp() * 1_000_000)
    assert store.ping()
    assert store.first_use("retry-1", "a", 10, 60) == (10, "a")
    assert store.first_use("retry-1", "b", 20, 60) == (10, "a")  # a retry gets the first attempt's
    token = backend.registry.watermark("stats").online_token  # the materialization's sync token, on both sides
    assert token is not None and store.sync_token("stats") == token and store.sync_token("nope") is None

    async def served():  # (one event loop, as a server's: the async clients belong to it)
        return await store.newest_async(), await store.ping_async(), await a_message_published(store)

    assert asyncio.run(served()) == (store.newest(), True, "m:1:production")


def test_writes_leave_no_lua_garbage_for_the_scripts_after_them(backend, request):
    """Redis's Lua collects garbage as later scripts allocate: the megabytes a large write left were
    swept during the next scripts to run, a lookup's among them (several times its Redis time).
    Each write script takes out its own instead (``featurestore.online.lua``) once it left more
    than ``GARBAGE_KB`` or the heap past ``HEAP_MOST_KB``: by what it left first, not by the heap's
    size, which the scripts' own code nearly filled (a whole collection after every small write,
    a packing run's of a few events, cost Redis more than the write)."""
    if request.node.callspec.params["backend"] == "single":
        nodes = [backend.online_store.client]
    else:
        nodes = [redis.Redis(port=port) for port in request.getfixturevalue("cluster_nodes")]

    def garbage_kb() -> list[float]:  # each node's Lua heap less what a whole collection keeps
        measured = (
            "local held = collectgarbage('count'); collectgarbage(); return tostring(held - collectgarbage('count'))"
        )
        return [float(node.eval(measured, 0)) for node in nodes]

    backend.push("payments", _payments(range(0, 20_000), cards=3), to="online")  # heavy: tiles sealed, packed
    backend.materialize(None, NOW)
    backend.pack_pushed(wait=True)  # (the pushes' packing runs in the background: done before measuring)
    for node in nodes:  # (+ the measuring eval's own)
        assert float(node.eval("return tostring(collectgarbage('count'))", 0)) < HEAP_MOST_KB + 32
    garbage_kb()  # (collected)
    # tens of KB of garbage, in tiles that have not ended (nothing for the pushes' packing to do
    # in the background: its scripts' allocations would step Lua's collection while measuring)
    now = _payments(range(20_000, 20_200), cards=3)
    now = now.set_column(3, "event_timestamp", pa.array([datetime.now(UTC)] * now.num_rows, TS))
    backend.push("payments", now, to="online")
    assert 16 < max(garbage_kb()) < HEAP_MOST_KB  # left to Lua's own collection: no whole collection for it


def test_earlier_layouts_are_deleted_on_request_and_what_is_read_now_stays(backend):
    """A definition change that changes how a view is stored (a column gone, a longer window) or
    an upgrade that does leaves the earlier layout's fields and event keys behind, read by
    nothing; a ttl-less view's never expire. ``featurestore compact --drop-old-layouts`` deletes
    them, and only them: lookups answer the same before and after."""
    backend.push("payments", _payments(range(0, 300)), to="online_and_offline")
    backend.materialize(None, NOW)
    client, prefix, root = backend.online_store.client, backend.online_store.prefix, backend.config.repo_path
    old = {backend.layout(name).online_field.encode() for name in ("stats", "activity")}
    changed = FEATURES.replace('Field("segment", String)])', "])").replace(
        '"amount")])', '"amount"), Aggregation("count", timedelta(hours=48))])'
    )
    (root / "features.py").write_text(changed)
    with FeatureStore(root) as edited:
        edited.apply()
        edited.materialize(None, NOW)  # (re-sends both views under their new layouts)
        new = {edited.layout(name).online_field.encode() for name in ("stats", "activity")}
        assert not new & old
        refs, cards = ["stats:score", *REFS], {"card_id": [-1, *range(45)]}
        before = edited.get_online_features(cards, features=refs).to_dict()

        def layouts() -> set[bytes]:  # the view#layout names Redis holds
            held = set()
            for key in client.scan_iter(match=prefix + b"*"):
                tail = key.rsplit(b":", 1)[-1].split(b"|")[0]
                names = [tail] if b"#" in tail else client.hkeys(key) if key.endswith(b"}") else []
                held |= {n for n in names if n.split(b"#")[0] in (b"stats", b"activity")}
            return held

        assert layouts() == old | new
        command = [sys.executable, "-m", "featurestore.cli", "compact", "--drop-old-layouts", "--repo", str(root)]
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "keys and fields of earlier layouts deleted" in result.stdout
        assert layouts() == new
        assert edited.get_online_features(cards, features=refs).to_dict() == before
        assert before["score"][1:] == [i / 4 for i in range(45)] and sum(before["count_1h"][1:]) > 0


def test_dropping_a_view_removes_its_values_and_events_only(backend):
    backend.materialize(None, NOW)
    backend.push("payments", _payments(range(0, 200)), to="online")
    assert backend.online_store.sync_token("activity") is not None
    backend.online_store.drop_view("activity")
    assert backend.online_store.sync_token("activity") is None and backend.online_store.sync_token("stats") is not None
    got = backend.get_online_features({"card_id": [1, 2]}, features=["stats:score", *REFS], at=NOW).to_dict()
    assert got["score"] == [0.25, 0.5]
    assert got["count_1h"] == [0, 0] and got["amount_max_6h"] == [None, None]
    assert not any(backend.online_store.client.scan_iter(match=backend.online_store.prefix + b"*activity#*"))


def test_a_store_serves_lookups_on_one_event_loop_after_another(backend, monkeypatch):
    """An SDK user's ``asyncio.run`` twice (or a test's): connections made on a loop that has
    closed are not reused on the next one (the cluster's async client failed with "Event loop
    is closed")."""
    events = _payments(range(9000, 10000))
    backend.push("payments", events, to="online")
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)  # every card through tile summaries: sealed on the loop
    monkeypatch.setattr(tiles, "SEAL_FROM", 1)
    cards = list(range(0, 40))
    want = {"card_id": cards, **_reference(events, cards)}
    reader = OnlineReader(backend.online_store)

    async def served() -> dict:
        query = OnlineQuery.prepare(
            backend.definitions, backend.config.project, {"card_id": cards}, REFS, None, False, now=NOW
        )
        got = (await reader.read_async(query)).to_dict()
        await reader.drain()
        assert await backend.online_store.ping_async()
        assert await backend.online_store.newest_async()
        return got

    for _ in range(3):
        assert asyncio.run(served()) == want
