"""The push path: Arrow typing equal to the SQL one, row ids that survive materialization, bulk
RESP packing equal to redis-py's, scripts reloaded after a Redis restart, and a pushing process
killed at random points that loses nothing and counts nothing twice."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from redis.connection import Connection

from featurestore.materialization.compute import compute, pushed_rows
from featurestore.online import resp
from featurestore.online.codec import datetime_to_micros, micros_to_datetime
from featurestore.sources import INGESTED_AT, PUSH_ID, connection

from .test_aggregations import FEATURES, TS, _frame

NOW = datetime.now(UTC).replace(microsecond=0)


def _payments(n: int, seed: int, first_id: int = 0, cards: int = 5, now: datetime = NOW) -> list[dict]:
    rnd = random.Random(seed)
    return [
        {
            "payment_id": first_id + i,
            "card_id": rnd.randint(1, cards),
            "amount": float(rnd.randint(1, 500)) / 4,
            "kind": rnd.choice(["web", "pos"]),
            "event_timestamp": now - timedelta(minutes=rnd.randint(0, 170)),
        }
        for i in range(n)
    ]


def test_arrow_typing_of_pushed_rows_equals_the_sql_one(make_store):
    store = make_store(FEATURES)
    view, defs = store.definitions.view("activity"), store.definitions
    schema = defs.history_schema(view)
    for seed in range(40):  # random pushes, with and without nulls in the features
        rows = _payments(1 + seed % 12, seed)
        if seed % 2:
            rows[0]["amount"] = None
            rows[-1]["kind"] = None
        table = _frame(rows)
        n = table.num_rows
        table = table.append_column(INGESTED_AT, pa.array([NOW] * n, TS)).append_column(
            PUSH_ID, pa.array(range(seed, seed + n), pa.int64())
        )
        fast = pushed_rows(
            table, view, defs.key_types["activity"], schema, NOW, timedelta(seconds=5)
        )  # a push's run: its ingest time
        con = connection()
        con.register("view_rows", table)
        slow = compute(
            con, view, defs.key_types["activity"], schema, 77, NOW, future_tolerance=timedelta(seconds=5)
        ).rows
        assert fast is not None and fast.equals(slow), seed


def test_arrow_typing_of_pushed_rows_with_a_created_time_equals_the_sql_one(make_store):
    """A push source with ``created_timestamp_field`` (corrections: "as known at"): its rows took
    the query path on every push (~6 ms for one row); typed in Arrow they equal the query's, the
    created column as each row's created time. A null created time (the query gives it the ingest
    time) takes the query path."""
    store = make_store(
        """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, String, UnixTimestamp

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
src = PushSource(name="scores", schema=[Field("user_id", Int64), Field("score", Float64), Field("tag", String),
                 Field("event_timestamp", UnixTimestamp), Field("known_at", UnixTimestamp)],
                 created_timestamp_field="known_at")
scores = FeatureView(name="scores", entities=[user], source=src, schema=[Field("score", Float64), Field("tag", String)])
"""
    )
    view, defs = store.definitions.view("scores"), store.definitions
    schema, keys = defs.history_schema(view), defs.key_types["scores"]
    rnd = random.Random(3)
    for seed in range(30):
        n = 1 + seed % 9
        events = [NOW - timedelta(minutes=rnd.randint(0, 50)) for _ in range(n)]
        table = pa.table(
            {
                "user_id": pa.array([rnd.randint(1, 4) for _ in range(n)], pa.int64()),
                "score": pa.array([rnd.choice([None, 1.5, -0.0, 7.0]) for _ in range(n)], pa.float64()),
                "tag": pa.array([rnd.choice([None, "a", "b"]) for _ in range(n)], pa.string()),
                "event_timestamp": pa.array(events, TS),
                "known_at": pa.array([e + timedelta(seconds=rnd.choice([0, 1, 90])) for e in events], TS),
                INGESTED_AT: pa.array([NOW] * n, TS),
                PUSH_ID: pa.array(range(seed, seed + n), pa.int64()),
            }
        )
        fast = pushed_rows(table, view, keys, schema, NOW, timedelta(seconds=5))
        con = connection()
        con.register("view_rows", table)
        slow = compute(con, view, keys, schema, 77, NOW, future_tolerance=timedelta(seconds=5)).rows
        assert fast is not None and fast.equals(slow), seed
        unknown = table.set_column(4, "known_at", pa.array([None] * n, TS))
        assert pushed_rows(unknown, view, keys, schema, NOW, timedelta(seconds=5)) is None
    store.push("scores", table.drop_columns([INGESTED_AT, PUSH_ID]), to="online")
    assert store.get_online_features({"user_id": [1, 2, 3, 4]}, features=["scores:score"]).statuses[1].count(
        "PRESENT"
    ) == len(set(table["user_id"].to_pylist()))


def test_rows_that_need_explaining_take_the_sql_path(make_store):
    store = make_store(FEATURES)
    with pytest.raises(Exception, match="null join key card_id"):
        store.push("payments", _frame([{**_payments(1, 1)[0], "card_id": None}]))
    with pytest.raises(Exception, match="in the future"):
        store.push("payments", _frame([{**_payments(1, 1)[0], "event_timestamp": NOW + timedelta(days=1)}]))


def test_pushed_rows_keep_their_identity_when_the_push_log_is_materialized(make_store):
    store = make_store(FEATURES)
    store.push("payments", _frame(_payments(30, seed=3)))
    store.push("payments", _frame(_payments(30, seed=3)))  # the same rows again: a new fact (reverts must win)
    store.flush()
    history = DeltaTable(str(store.offline_store.table_path(store.layout("activity").history_table)))
    assert history.to_pyarrow_table().num_rows == 60
    store.materialize_incremental()  # reads the push log: the same 60 rows, by their push ids
    assert DeltaTable(str(history.table_uri)).to_pyarrow_table().num_rows == 60


def test_bulk_resp_packing_equals_redis_py(make_store):
    rnd = random.Random(5)
    packer = Connection()
    for n in (0, 1, 5, resp.SHORT - 1, resp.SHORT, 200):
        values = [rnd.randbytes(rnd.randint(0, 40)) for _ in range(n)]
        array = pa.array(values, pa.binary())
        ours = resp.command("EVALSHA", "abc", n, array, 17, array)
        theirs = b"".join(packer.pack_command("EVALSHA", "abc", n, *values, 17, *values))
        assert ours == theirs
        keys = pa.array(values, pa.binary())
        assert resp.suffixed(keys, b":a", b":b").to_pylist() == [v + s for v in values for s in (b":a", b":b")]
        # a call cut per hash slot (the cluster's writes): each piece as redis-py packs that slice
        for skip in (0, min(n, 2)):  # (an array that is a slice itself: its offsets do not start at 0)
            part, rows = keys.slice(skip), values[skip:]
            cuts = sorted({0, len(rows), *(rnd.randint(0, len(rows)) for _ in range(3))})
            bounds = list(zip(cuts, cuts[1:]))
            other = pa.array([rnd.randbytes(3) for _ in rows], pa.binary())
            pieces = resp.sliced(("EVALSHA", "abc"), part, [7, "x"], [other], bounds)
            assert len(pieces) == len(bounds)
            for (a, b), piece in zip(bounds, pieces):
                theirs = packer.pack_command("EVALSHA", "abc", b - a, *rows[a:b], 7, "x", *other.to_pylist()[a:b])
                assert piece == b"".join(theirs)


def test_writes_go_on_after_redis_lost_its_scripts(make_store):
    store = make_store(FEATURES)
    store.push("payments", _frame(_payments(3, seed=1)), to="online")
    store.online_store.client.script_flush()  # as after a restart of Redis
    store.push("payments", _frame(_payments(3, seed=2, first_id=10)), to="online")
    counts = store.get_online_features({"card_id": [1, 2, 3, 4, 5]}, features=["activity:count_1h"], at=NOW).to_dict()
    assert sum(counts["count_1h"]) == sum(
        1 for p in _payments(3, 1) + _payments(3, 2, 10) if p["event_timestamp"] > NOW - timedelta(hours=1)
    )


PUSHER = textwrap.dedent("""
    import os, sys
    from datetime import datetime
    from pathlib import Path
    from featurestore import FeatureStore
    from tests.test_aggregations import _frame
    from tests.test_push_path import _batch

    root, done = Path(sys.argv[1]), Path(sys.argv[2])
    batches, now = int(sys.argv[3]), datetime.fromisoformat(sys.argv[4])
    start = len(done.read_text().splitlines()) if done.exists() else 0
    with FeatureStore(root) as store:
        store.push_buffer.max_rows = 40  # frequent drains: kills land in Delta commits too
        for i in range(start, batches):
            # a batch whose push was cut off is retried with its key: kept once whatever had happened
            store.push("payments", _frame(_batch(i, now)), to="online_and_offline", idempotency_key=f"batch-{i}")
            with open(done, "a") as f:
                f.write(f"{i}\\n"); f.flush(); os.fsync(f.fileno())
""")


def _batch(i: int, now: datetime = NOW) -> list[dict]:
    return _payments(15, seed=1000 + i, first_id=i * 100, cards=8, now=now)


def _run_killed(script: list[str], done: Path, batches: int, kills: int, rnd: random.Random) -> None:
    """Run ``python -c *script`` (which appends each batch it finishes to ``done``) until it has done
    ``batches``, SIGKILLing it ``kills`` times at a random point after it finished two more."""
    env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "PYTHONPATH": os.getcwd()}
    killed = 0
    for _ in range(kills + 20):
        child = subprocess.Popen([sys.executable, "-c", *script], env=env, stderr=subprocess.PIPE)
        if killed < kills:
            before = len(done.read_text().splitlines()) if done.exists() else 0
            deadline = time.time() + 60
            while (len(done.read_text().splitlines()) if done.exists() else 0) < before + 2 and child.poll() is None:
                assert time.time() < deadline, "the writer made no progress"
                time.sleep(0.01)
            time.sleep(rnd.uniform(0, 0.03))  # somewhere in a write, a background commit or between them (~2 ms a push)
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
                killed += 1
        code = child.wait(timeout=120)
        if code == 0:
            break
        assert code == -signal.SIGKILL, child.stderr.read().decode()[-3000:]
    assert killed == kills and len(done.read_text().splitlines()) == batches


@pytest.mark.parametrize("kills", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_a_pushing_process_killed_at_random_points_loses_nothing_and_counts_nothing_twice(make_store, tmp_path, kills):
    store = make_store(FEATURES)
    root = store.config.repo_path
    done, batches = tmp_path / "done.txt", 25 * kills  # enough that every kill lands before the last batch
    _run_killed([PUSHER, str(root), str(done), str(batches), NOW.isoformat()], done, batches, kills, random.Random(11))

    store.flush()
    events = [e for i in range(batches) for e in _batch(i)]
    cards = sorted({e["card_id"] for e in events})
    expected = {
        c: (
            sum(1 for e in events if e["card_id"] == c and e["event_timestamp"] > NOW - timedelta(hours=3)),
            sum(e["amount"] for e in events if e["card_id"] == c and e["event_timestamp"] > NOW - timedelta(hours=3)),
        )
        for c in cards
    }
    refs = ["activity:amount_count_3h", "activity:amount_sum_3h"]
    online = store.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
    assert list(zip(online["amount_count_3h"], online["amount_sum_3h"])) == [expected[c] for c in cards]
    entity_df = pd.DataFrame({"card_id": cards, "event_timestamp": [NOW] * len(cards)})
    offline = store.get_historical_features(entity_df, features=refs).to_df()
    assert list(zip(offline["amount_count_3h"], offline["amount_sum_3h"])) == [expected[c] for c in cards]
    history = DeltaTable(str(store.offline_store.table_path("activity"))).to_pyarrow_table()
    assert sorted(history["payment_id"].to_pylist()) == sorted(e["payment_id"] for e in events)  # each once
    log = DeltaTable(str(store.config.data_dir / "push" / "payments")).to_pyarrow_table()
    assert sorted(log["payment_id"].to_pylist()) == sorted(e["payment_id"] for e in events)


SEALER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from featurestore import FeatureStore
    from tests.test_aggregations import _frame
    from tests.test_push_path import _whole_tile

    root, done, batches = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    tile_us, first_tile = int(sys.argv[4]), int(sys.argv[5])
    start = len(done.read_text().splitlines()) if done.exists() else 0
    with FeatureStore(root) as store:
        for i in range(start, batches):
            # a whole ended tile: the write seals its summary (and packs what it holds whole); a batch
            # cut off is pushed again, its events then duplicates of those that landed
            store.push("payments", _frame(_whole_tile(i, tile_us, first_tile)), to="online")
            if i % 3 == 2:
                store.pack_online(["activity"])  # what `featurestore compact` runs
            with open(done, "a") as f:
                f.write(f"{i}\\n"); f.flush(); os.fsync(f.fileno())
""")


def _whole_tile(i: int, tile_us: int, first_tile: int) -> list[dict]:
    """Batch ``i``: 30 events of card 1 or 2, all of tile ``first_tile + i // 2``."""
    rnd = random.Random(2000 + i)
    first = (first_tile + i // 2) * tile_us
    return [
        {
            "payment_id": i * 100 + j,
            "card_id": 1 + i % 2,
            "amount": rnd.randint(-400, 400) / 4,
            "kind": rnd.choice(["web", "pos", "card", None]),
            "event_timestamp": micros_to_datetime(first + j * (tile_us // 30)),
        }
        for j in range(30)
    ]


def test_a_writer_killed_while_it_seals_and_packs_leaves_exact_windows(make_store, tmp_path, monkeypatch):
    """Writes of whole tiles seal their summaries and pack blocks in the round trip of their events,
    and the packer re-packs; a process doing both, killed at random points and run again, leaves
    windows that read, from summaries and blocks, exactly as the events define them."""
    from featurestore.aggregation import tiles
    from featurestore.online import packed

    from .test_aggregations import AGGS, _events_key, reference, same

    store = make_store(FEATURES)
    root, tile_us = store.config.repo_path, tiles.tile_us(store.get_feature_view("activity"))
    first_tile = (datetime_to_micros(NOW) - 20 * 3600 * 10**6) // tile_us  # ended hours ago, in the longest window
    done, batches, kills = tmp_path / "done.txt", 40, 3
    script = [SEALER, str(root), str(done), str(batches), str(tile_us), str(first_tile)]
    _run_killed(script, done, batches, kills, random.Random(5))

    client = store.online_store.client
    for card in (1, 2):  # (what the test is about: summaries and blocks are there)
        key = _events_key(store, card)
        assert any(packed.is_block(m) for m in client.zrange(key, 0, -1)) and client.hlen(key + b"|tiles") > 0
    events = [e for i in range(batches) for e in _whole_tile(i, tile_us, first_tile)]
    names = [n for n in AGGS if n.split("_")[-2] not in ("stddev", "variance", "2", "distinct")]  # the summarized
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 1)  # every card reads summaries
    cuts = [micros_to_datetime((first_tile + k) * tile_us + 7 * 60 * 10**6) for k in (3, 9, 14, 19)]  # inside tiles
    for at in [NOW, *cuts]:
        got = store.get_online_features({"card_id": [1, 2]}, features=[f"activity:{n}" for n in names], at=at)
        values = got.to_dict()
        for row, card in enumerate((1, 2)):
            for n in names:
                want = reference(events, card, at, AGGS[n])
                assert same(values[n][row], want, inexact=False), (at, card, n, values[n][row], want)


def test_pushes_pack_and_summarize_the_tiles_they_wrote_once_the_tile_after_has_ended(make_store):
    """A push of a few events holds no tile whole, so it packed and summarized none: cards fed one
    event at a time kept every event plain (until ``featurestore compact``) and the first lookup
    of a heavy one after each tile ended summarized it. Pushes now note the entities they wrote,
    and once the tile after theirs has ended those are packed and summarized off the pushing call:
    by the next push, or by a server's loop when no push comes. Lookups read the same before and
    after."""
    import asyncio

    from featurestore.online import packed
    from featurestore.online.base import EVENT_SCORES
    from serving.reload import RegistryWatcher

    from .test_aggregations import _events_key

    fast = FEATURES.replace("H = timedelta(hours=1)", "H = timedelta(seconds=2)")  # tiles of 1 s
    root = make_store(fast).config.repo_path
    watcher = RegistryWatcher(root, interval=0.2)  # (a server's store, and the loop it runs)
    store, names = watcher.current, ["not_card_count_30h", "amount_sum_6s", "amount_max_6s", "kind_last_6s"]

    def push_one_by_one(card: int) -> datetime:
        second = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)  # a whole second, ended
        for i in range(20):
            row = {"payment_id": card * 100 + i, "card_id": card, "amount": float(i), "kind": "web"}
            store.push("payments", _frame([{**row, "event_timestamp": second + timedelta(milliseconds=40 * i)}]))
        return second

    def state(card: int, second: datetime) -> tuple[list[bytes], int, dict]:
        client, key = store.online_store.client, _events_key(store, card)
        at = second + timedelta(seconds=2)
        lookup = store.get_online_features({"card_id": [card]}, features=[f"activity:{n}" for n in names], at=at)
        return client.zrangebyscore(key, *EVENT_SCORES), client.hlen(key + b"|tiles"), lookup.to_dict()

    def packed_and_summarized(card: int, second: datetime, before: dict) -> None:
        members, summaries, after = state(card, second)
        assert len(members) == 1 and packed.is_block(members[0]) and packed.event_count(members) == 20
        assert summaries == 1 and after == before

    second = push_one_by_one(1)
    members, summaries, before = state(1, second)
    if time.time() < second.timestamp() + 3:  # (else a late push of these may have packed the first ones)
        assert len(members) == 20 and summaries == 0  # plain: no push held the tile whole
    assert before["not_card_count_30h"] == [20] and before["amount_sum_6s"] == [190.0]
    time.sleep(2.2)  # the tile of the pushes ended, and the one after
    store.push(
        "payments", _frame([{"payment_id": 1, "card_id": 3, "amount": 1.0, "kind": "pos", "event_timestamp": NOW}])
    )
    store.pack_pushed(wait=True)  # (the push started it in the background)
    packed_and_summarized(1, second, before)

    second = push_one_by_one(2)
    before = state(2, second)[2]

    async def serve_a_while() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watcher.run(), timeout=3.0)

    asyncio.run(serve_a_while())  # no push after these: the server's loop packs them
    store.pack_pushed(wait=True)
    packed_and_summarized(2, second, before)
    store.close()


def _counted_per_card():
    """A view counting each card's events over 30 s: tiles of 1 s, blocks of 32 s."""
    from featurestore import Aggregation, Entity, FeatureView, Field, PushSource
    from featurestore.types import Int64, UnixTimestamp

    card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
    source = PushSource(name="p", schema=[Field("card_id", Int64), Field("event_timestamp", UnixTimestamp)])
    aggregations = [Aggregation("count", timedelta(seconds=30))]
    return FeatureView(name="v", entities=[card], source=source, schema=[], aggregations=aggregations)


def _cards_at(cards: list[int], at: datetime) -> pa.Table:
    """Rows of ``_counted_per_card``'s source: an event of each card listed, at ``at``."""
    return pa.table({"card_id": pa.array(cards, pa.int64()), "event_timestamp": pa.array([at] * len(cards), TS)})


def test_the_entities_kept_to_pack_are_bounded_and_due_once_worth_packing(caplog):
    """What pushes wrote is kept to pack up to a bound of entities: an entity's rows are merged
    (events added) before any is given up, and what is given up is logged (``featurestore
    compact`` packs it). An entity is due once the tile after its own has ended and it was
    written as many events as a block needs and as were packed for it in the current block (a
    block is re-packed about doubling, not once a tile), or its events' block has ended (their
    last packing); one not due is carried, and what was packed is forgotten with its block."""
    from featurestore.materialization.pushed_entities import PushedEntities
    from featurestore.online.packed import BLOCK_TILES

    view = _counted_per_card()  # (tiles of 1 s, blocks of 32 s)
    second = 10**6
    now = [(datetime_to_micros(NOW) // (BLOCK_TILES * second) + 1) * BLOCK_TILES * second]  # a block's start

    def note(cards: list[int], at: int | None = None) -> None:
        pushed.note(view, _cards_at(cards, micros_to_datetime(now[0] if at is None else at)), "event_timestamp")

    def due(after_seconds: int = 2) -> dict[int, int]:
        """{card: the µs its events are read from} of what a run packs ``after_seconds`` on."""
        now[0] += after_seconds * second
        packs: list = []
        pushed.pack_due(packs.append, least=3)
        pushed.wait()
        return {card: p.since_us for p in packs for card in p.keys["card_id"].to_pylist()}

    pushed = PushedEntities(most=10, clock=lambda: now[0])
    start, early = now[0], now[0] - 5 * 60 * second  # (early: its block has ended)

    def block_of(us: int) -> int:
        return us // (BLOCK_TILES * second) * BLOCK_TILES * second

    for _ in range(4):
        note([1, 2, 3])  # 12 rows: merged to 3 entities of 4 events at the bound
    note([4, 4, 5])  # 2 events and 1
    note([6], early)  # 1 event, in an ended block
    note(list(range(10, 20)))  # past the bound: given up
    assert due(after_seconds=1) == {}  # the tile after theirs has not ended
    with caplog.at_level("WARNING", logger="featurestore.materialization.pushed_entities"):
        taken = due(after_seconds=1)
    assert "10 left to `featurestore compact`" in caplog.text
    assert taken == {1: start, 2: start, 3: start, 6: block_of(early)}  # (each read from its earliest block)
    assert due() == {}  # taken once; 4 and 5 carried
    pushed.most = 100  # (from here on, no bound: past it, what was packed is forgotten first)
    note([4, 5])
    assert due() == {4: start}  # 3 events now, from its first; 5 has 2
    written_at = now[0]
    note([1, 1, 1])
    assert due() == {}  # 3 events, but 4 were packed for it in this block: it waits for 4
    note([1])
    assert due() == {1: block_of(written_at)}
    note([1] * 7)
    assert due() == {}  # 7 < the 8 packed for it now
    now[0] += BLOCK_TILES * second  # a block on: what was packed is forgotten
    note([1, 1, 1])
    # 1: 7 + 3 events, nothing packed in this block; 5: its events' block has ended (their last packing)
    assert due() == {1: block_of(written_at), 5: start}
    pushed.close()


def test_a_servers_loop_goes_on_through_an_outage_of_the_online_store(make_store, caplog):
    """A server's loop packs what pushes wrote (``pack_pushed``), which asks Redis how many events
    a block needs: while Redis is unreachable that raised, ending the loop and with it the
    server's registry reloads. It now says so and goes on; a push to history alone, with nothing
    to pack, does not ask Redis at all."""
    import asyncio

    from serving.reload import RegistryWatcher

    fast = FEATURES.replace("H = timedelta(hours=1)", "H = timedelta(seconds=2)")  # tiles of 1 s
    root = make_store(fast).config.repo_path
    config = root / "featurestore.yaml"
    config.write_text(re.sub(r"url: '[^']*'", "url: 'redis://127.0.0.1:1/0'", config.read_text()))
    watcher = RegistryWatcher(root, interval=0.1)
    rows = _frame([{"payment_id": 1, "card_id": 1, "amount": 1.0, "kind": "web", "event_timestamp": NOW}])
    with caplog.at_level("WARNING", logger="featurestore.feature_store"):
        assert watcher.current.push("payments", rows, to="offline") == 1  # (Redis is not asked)
    assert "not packing" not in caplog.text
    watcher.current._pushed.note(watcher.current.get_feature_view("activity"), rows, "event_timestamp")  # (as a push)
    time.sleep(2.1)  # (due)

    async def serve_a_while() -> None:
        await asyncio.wait_for(watcher.run(), timeout=1.0)

    with caplog.at_level("WARNING", logger="featurestore.feature_store"), pytest.raises(TimeoutError):
        asyncio.run(serve_a_while())  # (runs until stopped: no other error)
    assert "not packing what pushes wrote for now" in caplog.text and "127.0.0.1:1" in caplog.text
    watcher.current.close()


def test_a_forked_child_packs_what_its_own_pushes_wrote():
    """A process forked while its parent packed in the background has none of the parent's
    threads: the run it inherited never ends there, so the child waited on it for ever (closing
    its store hung) and never packed, and the lock a parent's thread held at the fork was never
    released (its next push hung). It now drops both and starts its own run."""
    from featurestore.materialization.pushed_entities import PushedEntities

    view = _counted_per_card()
    now = [datetime_to_micros(NOW)]
    pushed = PushedEntities(clock=lambda: now[0])

    def note_and_run(pack) -> None:
        pushed.note(view, _cards_at([1] * 9, NOW), "event_timestamp")
        now[0] += 3 * 10**6
        pushed.pack_due(pack, least=3)

    note_and_run(lambda due: time.sleep(3))  # the parent's run, still going when it forks
    child = os.fork()
    if child == 0:  # (the child: exits 0 only if its own run packs, and waiting for it ends)
        signal.alarm(20)  # (a child that hangs is killed: a failure, not a hung suite)
        packs: list = []
        note_and_run(packs.append)
        pushed.close()
        os._exit(0 if [p.keys["card_id"].to_pylist() for p in packs] == [[1]] else 1)
    _, status = os.waitpid(child, 0)
    pushed.close()
    assert os.waitstatus_to_exitcode(status) == 0
