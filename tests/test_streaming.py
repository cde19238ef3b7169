"""Stream sources: a real consumer process, killed mid-stream and restarted, loses nothing and counts nothing twice."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from featurestore import FeatureStore
from featurestore.online.base import EVENT_SCORES
from featurestore.streaming import GROUP, StreamConsumer, publish, stream_key

from .conftest import write_repo

FEATURES = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, StreamSource
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
payments = StreamSource(name="payments", schema=[
    Field("payment_id", Int64), Field("card_id", Int64), Field("amount", Float64), Field("event_timestamp", UnixTimestamp)])
activity = FeatureView(
    name="activity", entities=[card], source=payments, event_id="payment_id",
    schema=[Field("payment_id", Int64), Field("amount", Float64)],
    aggregations=[Aggregation("count", timedelta(hours=30)), Aggregation("sum", timedelta(hours=30), "amount")],
)
"""
NOW = datetime.now(UTC).replace(microsecond=0)


def _events(n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    return [
        {
            "payment_id": i,
            "card_id": rnd.randint(1, 20),
            "amount": float(rnd.randint(1, 500)),
            "event_timestamp": NOW - timedelta(minutes=rnd.randint(0, 600)),
        }
        for i in range(n)
    ]


@pytest.fixture
def stream_repo(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", FEATURES, url=redis_url)
    store = FeatureStore(root)
    store.apply()
    yield root, store
    store.close()


def _entry_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id in order: (milliseconds, sequence)."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq)


def _expected(events: list[dict]) -> dict[int, tuple[int, float]]:
    out: dict[int, tuple[int, float]] = {}
    for e in {e["payment_id"]: e for e in events}.values():
        count, total = out.get(e["card_id"], (0, 0.0))
        out[e["card_id"]] = (count + 1, total + e["amount"])
    return out


def _assert_stores_match(store: FeatureStore, events: list[dict]) -> None:
    expected = _expected(events)
    cards = sorted(expected)
    online = store.get_online_features(
        {"card_id": cards}, features=["activity:count_30h", "activity:amount_sum_30h"], at=NOW
    )
    assert list(zip(online.values[1], online.values[2])) == [expected[c] for c in cards]
    entity_df = pd.DataFrame({"card_id": cards, "event_timestamp": [NOW] * len(cards)})
    offline = store.get_historical_features(
        entity_df, features=["activity:count_30h", "activity:amount_sum_30h"]
    ).to_df()
    assert list(zip(offline["count_30h"], offline["amount_sum_30h"])) == [expected[c] for c in cards]


def test_consumer_killed_mid_stream_resumes_without_loss_or_double_counting(stream_repo):
    root, store = stream_repo
    events = _events(3000, seed=1)
    stream = stream_key(store.config.project, store.definitions.push_source("payments"))
    retried = events + random.Random(2).sample(events, 200)  # producers retry: duplicate entries
    ids = publish(store.online_store.client, stream, retried[:1500])
    bad = publish(
        store.online_store.client,
        stream,
        [{"payment_id": 99999, "card_id": 1, "amount": "lots", "event_timestamp": NOW.isoformat()}],
    )
    ids += bad + publish(store.online_store.client, stream, retried[1500:])

    def delivered() -> int:  # (entries consumed are trimmed from the stream: counted by their ids)
        last = _entry_id(client.xinfo_groups(stream)[0]["last-delivered-id"])
        return sum(1 for i in ids if _entry_id(i) <= last)

    command = [
        sys.executable,
        "-m",
        "featurestore.cli",
        "stream",
        "payments",
        "--repo",
        str(root),
        "--batch",
        "40",
        "--consumer",
        "c1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = store.online_store.client
    deadline = time.time() + 120
    while time.time() < deadline:  # kill it once it is well under way
        if client.xinfo_groups(stream) and delivered() > 600:  # (the consumer creates the group when it starts)
            break
        if first.poll() is not None:
            pytest.fail(first.stderr.read().decode()[-2000:])
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert delivered() < len(ids), "the consumer finished before it was killed: nothing was tested"

    second = subprocess.run([*command, "--until-idle"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert client.xpending(stream, GROUP)["pending"] == 0
    dead = client.xrange(stream + ":dead")
    assert [fields[b"_entry_id"] for _, fields in dead] == bad
    assert b"amount" in dead[0][1][b"_reason"]
    _assert_stores_match(store, events)


def test_consumers_killed_under_their_default_names_lose_nothing_and_log_each_entry_once(stream_repo):
    """``featurestore stream payments`` without ``--consumer``, SIGKILLed while events flowed: each
    restart had a new name (host-pid), so what the dead ones had pending stayed pending for good
    (payments missing in both stores, poison entries never dead-lettered), and redelivered
    entries were stored again in the raw push log. Idle pending entries are now claimed whatever
    their consumer's name, and an entry's ingest time and push id come from its entry id."""

    from featurestore.sources import open_push_log

    root, store = stream_repo
    events = _events(1500, seed=5)
    stream = stream_key(store.config.project, store.definitions.push_source("payments"))
    client = store.online_store.client
    publish(client, stream, events[:700])
    bad = publish(
        client, stream, [{"payment_id": 88888, "card_id": 1, "amount": "lots", "event_timestamp": NOW.isoformat()}]
    )
    publish(client, stream, events[700:])
    command = [
        sys.executable,
        "-m",
        "featurestore.cli",
        "stream",
        "payments",
        "--repo",
        str(root),
        "--batch",
        "25",
        "--claim-idle",
        "0.3",
    ]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    rnd = random.Random(7)

    def joined() -> set[bytes]:
        return {c["name"] for c in client.xinfo_consumers(stream, GROUP)} if client.xinfo_groups(stream) else set()

    for _ in range(3):  # killed at random moments once it has joined, each time under a new default name
        before = joined()
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120  # (on a busy machine its start alone may take seconds)
        while time.time() < deadline and joined() <= before and process.poll() is None:
            time.sleep(0.05)
        time.sleep(rnd.uniform(0.1, 1.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
    consumers = joined()
    assert len(consumers) >= 2  # every restart joined under another name
    final = subprocess.run([*command, "--until-idle"], env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert client.xpending(stream, GROUP)["pending"] == 0
    assert [fields[b"_entry_id"] for _, fields in client.xrange(stream + ":dead")] == bad
    _assert_stores_match(store, events)
    store.flush()
    log = open_push_log(store.config.push_logs, "payments").to_pyarrow_table()
    assert log.num_rows == len(events) and len(set(log["payment_id"].to_pylist())) == len(events)


def test_a_push_source_is_not_a_stream(stream_repo, tmp_path):
    _, store = stream_repo
    from featurestore.errors import NotFoundError

    with pytest.raises(NotFoundError, match="not a StreamSource"):
        StreamConsumer(
            FeatureStore(write_repo(tmp_path / "plain", FEATURES.replace("StreamSource", "PushSource"))), "payments"
        )


def test_consumed_entries_leave_the_stream_once_every_group_has_them(stream_repo, tmp_path, monkeypatch):
    """Consumed entries stayed in the stream for good: Redis's memory grew with every event ever
    streamed, and the dead-letter stream with every bad one. A consumer now trims what every
    consumer group has acknowledged (another application's group included: its pending entries
    and those after them stay), and the dead letters keep their newest ``DEAD_LETTERS_KEPT``; a
    stream the source names is its owner's and is left whole."""
    from featurestore import streaming

    _, store = stream_repo
    client = store.online_store.client
    stream = stream_key(store.config.project, store.definitions.push_source("payments"))
    events = _events(300, seed=8)
    consumer = StreamConsumer(store, "payments", batch=50)
    client.xgroup_create(stream, "other", id="0")  # another application reading the stream
    publish(client, stream, events)
    consumer.run(until_idle=True)
    assert consumer.stats.consumed == 300 and client.xlen(stream) == 300  # ("other" read none)

    read = client.xreadgroup("other", "o1", {stream: ">"}, count=100)[0][1]
    client.xack(stream, "other", *[entry_id for entry_id, _ in read[:60]])
    consumer.run(until_idle=True)
    assert client.xrange(stream, count=1)[0][0] == read[60][0] and client.xlen(stream) == 240
    client.xack(stream, "other", *[entry_id for entry_id, _ in read[60:]])
    rest = client.xreadgroup("other", "o1", {stream: ">"})[0][1]
    client.xack(stream, "other", *[entry_id for entry_id, _ in rest])
    consumer.run(until_idle=True)
    assert client.xlen(stream) == 0
    _assert_stores_match(store, events)

    monkeypatch.setattr(streaming, "DEAD_LETTERS_KEPT", 10)
    bad = [
        {"payment_id": 10**6 + i, "card_id": 1, "amount": "lots", "event_timestamp": NOW.isoformat()} for i in range(25)
    ]
    ids = publish(client, stream, bad)
    consumer.run(until_idle=True)
    assert [fields[b"_entry_id"] for _, fields in client.xrange(stream + ":dead")] == ids[-10:]

    named = FeatureStore(
        write_repo(
            tmp_path / "named",
            FEATURES.replace('name="payments",', 'name="payments", stream="owned",'),
            url=store.config.online.url,
        )
    )
    named.apply()
    publish(client, "owned", events[:40])
    owned = StreamConsumer(named, "payments")
    owned.run(until_idle=True)
    assert owned.stats.consumed == 40 and client.xlen("owned") == 40
    named.close()


def test_view_status_shows_the_consumer_groups_lag(stream_repo):
    """The web UI's freshness for a stream view: entries not yet consumed, newest online event."""
    from featurestore.catalog import view_status
    from featurestore.streaming import publish, stream_key

    _, store = stream_repo
    source = store.definitions.push_source("payments")
    consumer = StreamConsumer(store, "payments", batch=20)
    publish(store.online_store.client, stream_key(store.config.project, source), _events(50, seed=4))
    consumer.run(stop=lambda: consumer.stats.consumed >= 20)
    status = view_status(store.registry, store.offline_store, store.online_store, store.config.project, "activity")
    (group,) = status["stream"]["groups"]  # (the 20 consumed trimmed from the stream)
    assert status["stream"]["length"] == 30 and group["pending"] == 0 and group["lag"] == 30
    assert status["newest_online_event"] is not None and status["online_error"] is None


def test_the_consumer_summarizes_the_tiles_it_wrote_once_they_have_ended(tmp_path, redis_url, monkeypatch):
    """Entries pushed a few at a time never hold a tile whole, so no push summarizes it: the
    consumer packs and summarizes the tiles of the entities it wrote, a tile after they end."""
    from featurestore.online import packed

    from .test_aggregations import _events_key

    monkeypatch.delenv("REDIS_URL", raising=False)
    fast = FEATURES.replace("timedelta(hours=30)", "timedelta(minutes=2)")  # tiles of 1 s
    with FeatureStore(write_repo(tmp_path / "fast", fast, url=redis_url)) as store:
        store.apply()
        source = store.definitions.push_source("payments")
        consumer = StreamConsumer(store, "payments", batch=1, to="online")  # (one entry a push)
        second = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)  # a whole second, ended
        rows = [
            {
                "payment_id": i,
                "card_id": 1,
                "amount": float(i),
                "event_timestamp": second + timedelta(milliseconds=60 * i),
            }
            for i in range(15)
        ]
        publish(store.online_store.client, stream_key(store.config.project, source), rows)
        consumer.run(until_idle=True)
        time.sleep(2.5)  # its tile ended, and the one after (for stragglers)
        consumer.run(until_idle=True)  # (nothing new: its loop starts the packing, in the background)
        store.pack_pushed(wait=True)
        client, key = store.online_store.client, _events_key(store, 1)
        assert client.hlen(key + b"|tiles") == 1
        assert (
            packed.event_count(client.zrangebyscore(key, *EVENT_SCORES)) == 15
        )  # (in a block where Redis keeps small ones compact)
        counts = store.get_online_features({"card_id": [1]}, features=["activity:count_2m", "activity:amount_sum_2m"])
        assert counts.to_dict()["count_2m"] == [15] and counts.to_dict()["amount_sum_2m"] == [105.0]


def test_stream_text_is_an_integer_only_when_it_is_the_integers_own():
    """A stream carries every value as text. An integer column took any text Arrow parses:
    "017" became key 17 (and "+17", " 17" the same), which lookups and pushes refuse as no
    integer's own text. Now such an entry is refused (dead-lettered, naming the column); numbers
    with a fraction, times and text parse as before."""
    from featurestore import Field, StreamSource
    from featurestore.errors import RequestError
    from featurestore.streaming import entries_to_table
    from featurestore.types import Float64, Int64, UnixTimestamp

    source = StreamSource(
        name="s",
        schema=[Field("card_id", Int64), Field("amount", Float64), Field("event_timestamp", UnixTimestamp)],
    )

    def entry(card: bytes) -> tuple[bytes, dict[bytes, bytes]]:
        return b"1-0", {b"card_id": card, b"amount": b"1.5", b"event_timestamp": b"2024-05-01T10:00:00Z"}

    table = entries_to_table([entry(b"17"), entry(b"-3")], source)
    assert table["card_id"].to_pylist() == [17, -3] and table["amount"].to_pylist() == [1.5, 1.5]
    for bad in (b"017", b"+17", b" 17", b"1.0", b"1e3"):
        with pytest.raises(RequestError, match="card_id"):
            entries_to_table([entry(b"17"), entry(bad)], source)
