"""Windowed aggregations: offline and online against a naive reference on random event streams.

The reference is the definition itself, a Python loop: the value at t aggregates the
entity's events with event time in (t - window, t], each event id counted once (the first
push wins). Streams have equal timestamps, query times on window edges, late and
out-of-order pushes, retried (duplicate) pushes, nulls, NaN and infinities.
"""

from __future__ import annotations

import bisect
import itertools
import math
from datetime import datetime, timedelta, timezone

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featurestore.errors import DefinitionError

BASE = datetime(2024, 3, 10, tzinfo=timezone.utc)
TS = pa.timestamp("us", tz="UTC")
STEP = timedelta(minutes=30)  # event and query times sit on this grid (± 1 µs), so edges coincide

FEATURES = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
payments = PushSource(name="payments", schema=[
    Field("payment_id", Int64), Field("card_id", Int64), Field("amount", Float64), Field("kind", String),
    Field("event_timestamp", UnixTimestamp)])
H = timedelta(hours=1)
activity = FeatureView(
    name="activity", entities=[card], source=payments, event_id="payment_id",
    schema=[Field("payment_id", Int64), Field("amount", Float64), Field("kind", String)],
    aggregations=[
        Aggregation("count", H),
        Aggregation("count", 3 * H, "amount"),
        Aggregation("sum", 3 * H, "amount"),
        Aggregation("mean", 3 * H, "amount"),
        Aggregation("min", H, "amount"),
        Aggregation("max", 3 * H, "amount"),
        Aggregation("stddev", 3 * H, "amount"),
        Aggregation("variance", H, "amount"),
        Aggregation("last", 3 * H, "kind"),
        Aggregation("last_n", 3 * H, "amount", n=2),
        Aggregation("count_distinct", 3 * H, "kind"),
        Aggregation("sum", 3 * H, "amount", name="online_sum_3h", where=("kind", "==", "web")),
        Aggregation("count", 30 * H, name="not_card_count_30h", where=("kind", "not in", ["card"])),
    ],
)
"""

INEXACT = {"amount_sum_3h", "amount_mean_3h", "amount_stddev_3h", "amount_variance_1h", "online_sum_3h"}


def reference(events: list[dict], card: int, t: datetime, agg: dict) -> object:
    """The definition as a loop: first-pushed copy of each id, window (t - w, t], nulls skipped."""
    seen: dict[int, dict] = {}
    for e in events:
        seen.setdefault(e["payment_id"], e)
    window = [e for e in seen.values() if e["card_id"] == card and t - agg["window"] < e["event_timestamp"] <= t]
    if agg.get("where"):
        window = [e for e in window if agg["where"](e)]
    window.sort(key=lambda e: (e["event_timestamp"], e["payment_id"]))
    column = agg.get("column")
    values = [1] * len(window) if column is None else [e[column] for e in window if e[column] is not None]
    f = agg["function"]
    if f == "count":
        return len(values)
    if f == "count_distinct":
        return len({"NaN" if isinstance(v, float) and math.isnan(v) else v for v in values})
    if f == "sum":
        return float(sum(values))
    if f == "last_n":
        return values[::-1][:2]
    if not values:
        return None
    if f == "mean":
        return sum(values) / len(values)
    if f == "min":  # NaN sorts above all numbers, as in DuckDB
        finite = [v for v in values if not math.isnan(v)]
        return min(finite) if finite else math.nan
    if f == "max":
        return math.nan if any(math.isnan(v) for v in values) else max(values)
    if f == "last":
        return values[-1]
    if f in ("variance", "stddev"):
        if len(values) < 2:
            return None
        m = sum(values) / len(values)
        var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
        return var if f == "variance" else math.sqrt(var) if var == var else var
    raise AssertionError(f)


H = timedelta(hours=1)
AGGS = {
    "count_1h": {"function": "count", "window": H},
    "amount_count_3h": {"function": "count", "window": 3 * H, "column": "amount"},
    "amount_sum_3h": {"function": "sum", "window": 3 * H, "column": "amount"},
    "amount_mean_3h": {"function": "mean", "window": 3 * H, "column": "amount"},
    "amount_min_1h": {"function": "min", "window": H, "column": "amount"},
    "amount_max_3h": {"function": "max", "window": 3 * H, "column": "amount"},
    "amount_stddev_3h": {"function": "stddev", "window": 3 * H, "column": "amount"},
    "amount_variance_1h": {"function": "variance", "window": H, "column": "amount"},
    "kind_last_3h": {"function": "last", "window": 3 * H, "column": "kind"},
    "amount_last_2_3h": {"function": "last_n", "window": 3 * H, "column": "amount"},
    "kind_count_distinct_3h": {"function": "count_distinct", "window": 3 * H, "column": "kind"},
    "online_sum_3h": {"function": "sum", "window": 3 * H, "column": "amount", "where": lambda e: e["kind"] == "web"},
    "not_card_count_30h": {"function": "count", "window": 30 * H, "where": lambda e: e["kind"] is not None and e["kind"] != "card"},
}


def same(got: object, want: object, inexact: bool) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(same(g, w, inexact) for g, w in zip(got, want))
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, float):
        if math.isnan(want):
            return isinstance(got, float) and math.isnan(got)
        if inexact:
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        return got == want
    return got == want


amounts = st.one_of(
    st.none(), st.floats(-1000, 1000, allow_nan=False).map(lambda x: round(x, 2)),
    st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e15]),
)
event = st.fixed_dictionaries({
    "card_id": st.integers(0, 2),
    "slot": st.integers(0, 16),
    "nudge_us": st.sampled_from([0, 0, 1, -1]),
    "amount": amounts,
    "kind": st.sampled_from([None, "web", "card", "atm"]),
})
_cards = itertools.count()


@pytest.fixture(scope="module")
def activity_store(tmp_path_factory, redis_url):
    from featurestore import FeatureStore
    from tests.conftest import write_repo

    root = write_repo(tmp_path_factory.mktemp("agg"), FEATURES, url=redis_url, online_options=", event_retention: 100000d")
    store = FeatureStore(root)
    store.apply()
    yield store
    store.close()


def _frame(events: list[dict]) -> pd.DataFrame:
    columns = ["payment_id", "card_id", "amount", "kind", "event_timestamp"]
    return pa.Table.from_pylist([{c: e[c] for c in columns} for e in events], pa.schema([
        ("payment_id", pa.int64()), ("card_id", pa.int64()), ("amount", pa.float64()), ("kind", pa.string()), ("event_timestamp", TS),
    ]))


@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    raw=st.lists(event, min_size=0, max_size=25),
    batches=st.integers(1, 3),
    retries=st.lists(st.integers(0, 24), max_size=4),
    changed=st.lists(st.tuples(st.integers(0, 24), amounts), max_size=2),
    queries=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.sampled_from([0, 0, 1, -1])), min_size=1, max_size=8),
)
def test_offline_and_online_match_the_reference(activity_store, raw, batches, retries, changed, queries):
    store = activity_store
    offset = next(_cards) * 10          # fresh cards (and payment ids) per example
    events = [
        {"payment_id": offset * 100 + i, "card_id": offset + e["card_id"], "amount": e["amount"], "kind": e["kind"],
         "event_timestamp": BASE + e["slot"] * STEP + timedelta(microseconds=e["nudge_us"])}
        for i, e in enumerate(raw)
    ]
    # pushes in several batches, out of time order; then retried copies and same-id changes (first push wins)
    pushes = [events[i::batches] for i in range(batches)]
    pushes.append([events[i] for i in retries if i < len(events)])
    pushes.append([{**events[i], "amount": a} for i, a in changed if i < len(events)])
    pushed: list[dict] = []
    for batch in pushes:
        if batch:
            store.push("payments", _frame(batch), to="online_and_offline")
            pushed += batch
    rows = [(offset + c, BASE + slot * STEP / 2 + timedelta(microseconds=n)) for c, slot, n in queries]
    entity_df = pd.DataFrame({"card_id": [c for c, _ in rows], "event_timestamp": [t for _, t in rows]})
    names = list(AGGS)
    offline = store.get_historical_features(entity_df, features=[f"activity:{n}" for n in names]).to_arrow().to_pylist()
    for (card, t), off in zip(rows, offline):
        online = store.get_online_features([{"card_id": card}], features=[f"activity:{n}" for n in names], at=t).to_dict()
        for name in names:
            want = reference(pushed, card, t, AGGS[name])
            assert same(off[name], want, name in INEXACT), (name, "offline", card, t, off[name], want)
            assert same(online[name][0], want, name in INEXACT), (name, "online", card, t, online[name][0], want)


TILED = ["count_1h", "amount_count_3h", "amount_sum_3h", "amount_mean_3h", "amount_min_1h", "amount_max_3h", "kind_last_3h",
         "online_sum_3h", "not_card_count_30h"]


@settings(max_examples=max(10, settings.default.max_examples // 4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(
    raw=st.lists(event, min_size=1, max_size=30),
    late=st.lists(event, max_size=8),
    queries=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 0, 1, -1])), min_size=1, max_size=6),
)
def test_lookups_from_tile_summaries_equal_lookups_from_events(activity_store, monkeypatch, raw, late, queries):
    """Heavy entities read sealed tile summaries (``aggregation.tiles``) instead of every event.
    Forced on for every entity here (and a summary for every tile with an event): the values
    must be the reference's and bit-identical to reading the events, before and after sealing,
    and after late events land in sealed tiles (which must drop their summaries)."""
    from featurestore.aggregation import tiles

    store = activity_store
    offset = next(_cards) * 10 + 3_000_000
    card = offset

    def events_of(drawn, first_id):
        return [{"payment_id": offset * 100 + first_id + i, "card_id": card, "amount": e["amount"], "kind": e["kind"],
                 "event_timestamp": BASE + e["slot"] * STEP + timedelta(microseconds=e["nudge_us"])} for i, e in enumerate(drawn)]

    def lookup(t, tiled: bool):
        monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0 if tiled else 10**9)
        return store.get_online_features([{"card_id": card}], features=[f"activity:{n}" for n in TILED], at=t).to_dict()

    monkeypatch.setattr(tiles, "SEAL_FROM", 1)
    pushed = events_of(raw, 0)
    store.push("payments", _frame(pushed), to="online")
    times = [BASE + slot * STEP / 2 + timedelta(microseconds=n) for slot, n in queries]
    for round_ in ("before sealing", "sealed", "after late events"):
        if round_ == "after late events" and late:
            more = events_of(late, 1000)
            store.push("payments", _frame(more), to="online")
            pushed += more
        for t in times:
            tiled, plain = lookup(t, tiled=True), lookup(t, tiled=False)
            for name in TILED:
                want = reference(pushed, card, t, AGGS[name])
                assert same(tiled[name][0], plain[name][0], inexact=False), (round_, name, t, tiled[name][0], plain[name][0])
                assert same(tiled[name][0], want, name in INEXACT), (round_, name, t, tiled[name][0], want)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), st.floats(-1e16, 1e16), st.floats(-1, 1)),
                              st.sampled_from([None, "web", "card"])), min_size=1, max_size=60),
    sealed_every=st.integers(1, 5),
    now_slot=st.integers(0, 45),
)
def test_merged_tile_states_equal_the_events_evaluation(activity_store, values, sealed_every, now_slot):
    """The merge itself, without Redis: events split into tiles, some summarized (partials,
    JSON and back), the rest read as events, give exactly what the events give, float sums
    included (values of very different magnitudes, where a plain sum would round differently)."""
    from featurestore.aggregation import tiles
    from featurestore.aggregation.evaluate import WindowEvaluator

    view = activity_store.get_feature_view("activity")
    spec = tiles.TileSpec.of(view)
    tiled = tiles.TiledEvaluator(view, spec)
    wanted = [i for i, a in enumerate(spec.aggregations) if a.output_name in TILED]
    plain = WindowEvaluator(view, [spec.aggregations[i] for i in wanted])
    size, start = spec.tile_us, 10**15 // spec.tile_us * spec.tile_us
    events = sorted((start + slot * size // 2 + i, amount, kind) for i, (slot, amount, kind) in enumerate(values))
    columns_of = {f.name: i for i, f in enumerate(view.schema)}
    columns = {columns_of["amount"]: [e[1] for e in events], columns_of["kind"]: [e[2] for e in events]}
    times = [e[0] for e in events]
    now = start + now_slot * size // 2 + 3
    cut = {(now - w + 1) // size for w in plain.windows_us} | {now // size}
    summaries, kept = {}, []
    for tile in sorted({t // size for t in times}):
        a, b = bisect.bisect_left(times, tile * size), bisect.bisect_left(times, (tile + 1) * size)
        states = tiled.states(columns, a, b, compact=True)
        summary = tiled.encode(times[b - 1], states) if states is not None else None
        if tile not in cut and tile % sealed_every == 0 and (tile + 1) * size <= now and summary is not None:
            summaries[tile] = tiled.decode(summary)[1]
        else:
            kept += range(a, b)
    raw_columns = {i: [c[k] for k in kept] for i, c in columns.items()}
    got = tiles.evaluate_tiled(tiled, wanted, plain.windows_us, summaries, [times[k] for k in kept], raw_columns, now)
    want = plain.evaluate(times, columns, now)
    assert [s for s in got[1]] == want[1]
    assert all(same(g, w, inexact=False) for g, w in zip(got[0], want[0])), (got, want)


def test_a_late_event_drops_its_tiles_summary_and_lookups_stay_exact(activity_store, monkeypatch):
    """The mechanism under the property above, step by step: a lookup seals the tiles it read
    whole; the next reads them; an event arriving late in a sealed tile drops its summary (the
    write script), and a summary computed before that event is refused (the seal script)."""
    from featurestore.aggregation import tiles

    store = activity_store
    card = next(_cards) * 10 + 4_000_000
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)
    monkeypatch.setattr(tiles, "SEAL_FROM", 1)
    events = [{"payment_id": card * 100 + i, "card_id": card, "amount": float(i), "kind": "web",
               "event_timestamp": BASE + i * STEP} for i in range(12)]  # one per 30 min: tiles of 15 min
    store.push("payments", _frame(events), to="online")
    key = b"fs:" + store.config.project.encode() + b":{card_id=%d}:ev:" % card + store.get_feature_view("activity").online_field.encode()
    tiles_key = key + b"|tiles"
    at = BASE + 11 * STEP + timedelta(minutes=5)  # in the tile of the last event

    def count_30h():
        return store.get_online_features([{"card_id": card}], features=["activity:not_card_count_30h", "activity:amount_sum_3h"],
                                         at=at).to_dict()

    assert count_30h() == {"card_id": [card], "not_card_count_30h": [12], "amount_sum_3h": [float(6 + 7 + 8 + 9 + 10 + 11)]}
    client = store.online_store.client
    sealed = {int(t) for t in client.hkeys(tiles_key)}
    size = 15 * 60 * 10**6
    first_tile = (events[0]["event_timestamp"] - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1) // size
    # every tile with an event, but those holding the lookup time (22) and the 3 h window's start (10)
    assert sealed == {first_tile + 2 * i for i in range(12)} - {first_tile + 10, first_tile + 22}
    assert count_30h()["not_card_count_30h"] == [12]  # from the summaries
    late = {**events[1], "payment_id": card * 100 + 50, "amount": 100.0}  # in the sealed tile of event 1
    store.push("payments", _frame([late]), to="online")
    assert first_tile + 2 not in {int(t) for t in client.hkeys(tiles_key)}
    assert count_30h()["not_card_count_30h"] == [13]
    # a summary computed before an event landed is refused: its tile's event count has changed
    stale = [(first_tile + 4, 0, client.hget(tiles_key, str(first_tile + 4)))]
    client.hdel(tiles_key, str(first_tile + 4))
    store.online_store.seal([(key, size, stale)])
    assert not client.hexists(tiles_key, str(first_tile + 4))


def test_servers_read_and_seal_tiles_on_the_event_loop(activity_store, monkeypatch):
    """The servers' path: ``read_online_async`` reads heavy entities' summaries (a second round
    trip), and ``seal_in_background`` stores the tiles a lookup summarized without holding it."""
    import asyncio

    from featurestore.aggregation import tiles
    from featurestore.retrieval.online import OnlineQuery, read_online, read_online_async
    from serving.common import _sealing, seal_in_background

    store = activity_store
    card = next(_cards) * 10 + 5_000_000
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)
    monkeypatch.setattr(tiles, "SEAL_FROM", 1)
    monkeypatch.setattr(tiles, "SEALS_PER_LOOKUP", 8)  # fewer than the whole tiles: two lookups summarize them
    store.push("payments", _frame([{"payment_id": card * 100 + i, "card_id": card, "amount": i / 3, "kind": "web",
                                    "event_timestamp": BASE + i * STEP / 3} for i in range(30)]), to="online")
    refs = [f"activity:{n}" for n in TILED]
    at = BASE + 10 * STEP + timedelta(minutes=7)

    def query():
        return OnlineQuery.prepare(store.definitions, store.config.project, {"card_id": [card, card + 1]}, refs, None, False, now=at)

    async def served():
        responses, sealed = [], []
        for _ in range(6):  # each lookup summarizes at most 8 tiles, in the background
            q = query()
            responses.append((await read_online_async(store.online_store, q)).to_dict())
            sealed.append(sum(len(tiles_) for _, _, tiles_ in q.seals))
            seal_in_background(store, q.seals)
            await asyncio.gather(*_sealing)
        return responses, sealed

    store.online_store.client.script_flush()  # a Redis that lost its scripts: the heavy cards' reads load them again
    responses, sealed = asyncio.run(served())
    first = responses[0]
    assert all(r == first for r in responses) and first == read_online(store.online_store, query()).to_dict()
    assert sealed[:2] == [8, 8] and sealed[-1] == 0  # the whole tiles summarized over lookups, then read
    assert first["count_1h"] == [5, 0] and first["not_card_count_30h"] == [30, 0]


def test_a_card_known_heavy_reads_its_summaries_at_once(activity_store, monkeypatch):
    """A heavy card's lookup first read its window plainly up to the threshold (~1,500 events,
    ~1 ms of Redis), dropped that and read its tile summaries. Once found heavy, its next lookups
    skip the plain read; the answer is the same. The hints are bounded and expire."""
    from featurestore.aggregation import tiles
    from featurestore.retrieval.online import HEAVY_KEYS, OnlineQuery, _HeavyKeys, read_online

    store = activity_store
    card = next(_cards) * 10 + 7_000_000
    store.push("payments", _frame([{"payment_id": card * 100 + i, "card_id": card, "amount": i / 3, "kind": "web",
                                    "event_timestamp": BASE + i * STEP / 3} for i in range(30)]), to="online")
    refs = [f"activity:{n}" for n in TILED]
    client = store.online_store.client

    def lookup():
        query = OnlineQuery.prepare(store.definitions, store.config.project, {"card_id": [card]}, refs, None, False, now=BASE + 10 * STEP)
        before = client.info("commandstats").get("cmdstat_zrangebyscore", {}).get("calls", 0)
        response = read_online(store.online_store, query).to_dict()
        return query, response, client.info("commandstats").get("cmdstat_zrangebyscore", {}).get("calls", 0) - before

    expected = lookup()[1]  # every event (the default threshold: 30 events are light)
    monkeypatch.setattr(tiles, "HEAVY_PER_TILE", 0)  # every card is heavy
    first, found, range_reads = lookup()  # (READ_WINDOW reads ranges too: Redis counts those)
    assert not first.known_heavy and found == expected
    again, found, fewer_range_reads = lookup()
    assert again.known_heavy == {0} and fewer_range_reads == range_reads - 1 and found == expected

    hints = _HeavyKeys(size=3, seconds=60)
    for key in (b"a", b"b", b"c", b"d"):
        hints.add(key)
    assert len(hints) == 3 and b"a" not in hints and b"d" in hints
    hints.seconds = -1.0
    hints.add(b"e")
    assert b"e" not in hints
    HEAVY_KEYS.clear()


def test_servers_assemble_many_events_off_the_event_loop(activity_store, monkeypatch):
    """A cold heavy card's first lookups decode and aggregate its whole window (~25 ms at 50,000
    events), which held a server's event loop and every other request on it. Past
    ``OFF_LOOP_EVENTS`` the assembly runs on a thread; the answer is the same."""
    import asyncio
    import threading

    from featurestore.retrieval import online
    from featurestore.retrieval.online import OnlineQuery, read_online

    store = activity_store
    card = next(_cards) * 10 + 6_000_000
    store.push("payments", _frame([{"payment_id": card * 100 + i, "card_id": card, "amount": i / 3, "kind": "web",
                                    "event_timestamp": BASE + i * STEP / 3} for i in range(30)]), to="online")
    refs = [f"activity:{n}" for n in TILED]
    at = BASE + 10 * STEP

    def query():
        return OnlineQuery.prepare(store.definitions, store.config.project, {"card_id": [card]}, refs, None, False, now=at)

    threads = []
    assemble = OnlineQuery.assemble
    monkeypatch.setattr(OnlineQuery, "assemble", lambda self, raw: threads.append(threading.current_thread()) or assemble(self, raw))

    async def served(limit: int):
        monkeypatch.setattr(online, "OFF_LOOP_EVENTS", limit)
        return (await online.read_online_async(store.online_store, query())).to_dict()

    expected = read_online(store.online_store, query()).to_dict()
    assert asyncio.run(served(limit=100)) == expected and threads[-1] is threading.main_thread()  # 30 events: on the loop
    assert asyncio.run(served(limit=10)) == expected and threads[-1] is not threading.main_thread()


def test_statuses_say_whether_the_window_had_events(activity_store):
    store = activity_store
    card = next(_cards) * 10 + 1_000_000
    store.push("payments", _frame([
        {"payment_id": card * 100, "card_id": card, "amount": None, "kind": "web", "event_timestamp": BASE},
    ]))
    response = store.get_online_features(
        [{"card_id": card}], features=["activity:count_1h", "activity:amount_mean_3h", "activity:amount_sum_3h"], at=BASE)
    assert response.to_dict() == {"card_id": [card], "count_1h": [1], "amount_mean_3h": [None], "amount_sum_3h": [0.0]}
    assert [s[0] for s in response.statuses[1:]] == ["PRESENT", "NULL_VALUE", "PRESENT"]
    later = store.get_online_features([{"card_id": card}], features=["activity:count_1h"], at=BASE + H)
    assert later.to_dict()["count_1h"] == [0] and later.statuses[1] == ["NOT_FOUND"]


def test_created_mode_counts_only_events_known_at_t(activity_store):
    store = activity_store
    card = next(_cards) * 10 + 2_000_000
    now = datetime.now(timezone.utc)
    store.push("payments", _frame([
        {"payment_id": card * 100, "card_id": card, "amount": 1.0, "kind": "web", "event_timestamp": now - timedelta(minutes=5)},
    ]))
    entity_df = pd.DataFrame({"card_id": [card, card], "event_timestamp": [now - timedelta(minutes=1), datetime.now(timezone.utc)]})
    by_event = store.get_historical_features(entity_df, features=["activity:count_1h"]).to_df()["count_1h"].tolist()
    by_created = store.get_historical_features(entity_df, features=["activity:count_1h"], as_of="created").to_df()["count_1h"].tolist()
    assert by_event == [1, 1]
    assert by_created == [0, 1]  # pushed after the first row's time


def test_events_older_than_the_retention_are_not_kept_online(make_store):
    store = make_store(FEATURES)
    store.apply()
    old = datetime.now(timezone.utc) - timedelta(hours=40)  # beyond the longest window (30 h), no extra retention
    store.push("payments", _frame([{"payment_id": 1, "card_id": 1, "amount": 1.0, "kind": "web", "event_timestamp": old}]))
    key = b"fs:" + store.config.project.encode() + b":{card_id=1}:ev:" + store.get_feature_view("activity").online_field.encode()
    assert store.online_store.client.zcard(key) == 0
    entity_df = pd.DataFrame({"card_id": [1], "event_timestamp": [old]})
    assert store.get_historical_features(entity_df, features=["activity:count_1h"]).to_df()["count_1h"].tolist() == [1]


def test_old_events_their_ids_and_summaries_are_trimmed_as_time_passes(make_store):
    """Online storage stays within the horizon (longest window + retention): when a newer event
    extends an entity's keys, events before the cutoff leave the sorted set, their ids the
    first-write-wins hash, and tiles before it their summaries (the write script's trim)."""
    store = make_store(FEATURES)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    events = [{"payment_id": i, "card_id": 1, "amount": 1.0, "kind": "web", "event_timestamp": now - timedelta(hours=h)}
              for i, h in ((1, 25), (2, 5), (3, 0))]
    store.push("payments", _frame(events[:2]), to="online_and_offline")
    store.push("payments", _frame(events[2:]), to="offline")  # history only: written online below, hours "later"
    store.flush()
    view = store.get_feature_view("activity")
    key = b"fs:" + store.config.project.encode() + b":{card_id=1}:ev:" + view.online_field.encode()
    client = store.online_store.client
    client.hset(key + b"|tiles", b"1", b"an old summary")
    assert client.zcard(key) == 2 and client.hlen(key + b"|ids") == 2
    import duckdb

    con = duckdb.connect()
    store.offline_store.register(con, view.history_table, "history", store.definitions.history_schema(view))
    third = con.sql("SELECT * FROM history WHERE payment_id = 3").to_arrow_table().cast(store.definitions.history_schema(view))
    store.materializer().write_online(view, third, now + timedelta(hours=8))  # the cutoff is now 22 h back
    members = client.zrange(key, 0, -1)
    assert len(members) == 2 and client.hlen(key + b"|ids") == 2  # the 25 h old event is gone from both
    assert not client.hexists(key + b"|tiles", b"1")
    at = store.get_online_features([{"card_id": 1}], features=["activity:not_card_count_30h"], at=now).to_dict()
    assert at["not_card_count_30h"] == [2]


@pytest.mark.parametrize("change, message", [
    ('Aggregation("median", H, "amount")', "function 'median' is not one of"),
    ('Aggregation("sum", H, "kind")', "sum needs a numeric column"),
    ('Aggregation("max", H, "fee")', "column 'fee' is not in the view's schema"),
    ('Aggregation("last_n", H, "amount")', "last_n needs n="),
    ('Aggregation("count", timedelta(0))', "window must be a positive timedelta"),
    ('Aggregation("count", H, where=("kind", "~", "x"))', "where-operator '~'"),
    ('Aggregation("count", H), Aggregation("count", H)', "two aggregations are named 'count_1h'"),
])
def test_bad_aggregations_are_reported(make_store, change, message):
    features = FEATURES.replace('Aggregation("count", H),\n', change + ",\n", 1)
    store = make_store(features, apply=False)
    with pytest.raises(DefinitionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        store.definitions


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(
    st.integers(-3, 3), st.integers(-2**62, 2**62), st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
    st.one_of(st.none(), st.floats(width=32)), st.one_of(st.none(), st.floats()), st.one_of(st.none(), st.booleans()),
    st.one_of(st.none(), st.integers(-10**15, 10**15))), max_size=40),
    low=st.integers(-4, 2), high=st.integers(-2, 4), with_text=st.booleans())
def test_events_decoded_at_once_equal_events_decoded_one_by_one(events, low, high, with_text):
    """Online aggregations decode an entity's events at once (their heads as one numpy record
    array): the same events, order ((time, id), equal times included), values, nulls, NaN,
    float32, bool, strings, bytes and arrays as the one-by-one decoder after ``events_between``."""
    import numpy as np

    from featurestore.online.codec import encode_events, events_between, make_decoder, make_events_decoder
    from featurestore.types import from_name

    names = ["Int32", "Float32", "Float64", "Bool", "UnixTimestamp", *(["String", "Bytes", "Array(Float64)"] if with_text else [])]
    features = [(f"c{k}", from_name(n)) for k, n in enumerate(names)]
    us = pa.timestamp("us", tz="UTC")
    table = pa.table({
        "event_timestamp": pa.array([e[0] for e in events], pa.int64()).cast(us),
        "created_timestamp": pa.array([0] * len(events), pa.int64()).cast(us),
        "_run_id": pa.array([1] * len(events), pa.int64()), "_row_id": pa.array(range(len(events)), pa.int64()),
        "c0": pa.array([e[2] for e in events], pa.int32()), "c1": pa.array([e[3] for e in events], pa.float32()),
        "c2": pa.array([e[4] for e in events], pa.float64()), "c3": pa.array([e[5] for e in events], pa.bool_()),
        "c4": pa.array([e[6] for e in events], pa.int64()).cast(us),
        **({"c5": pa.array([None if e[2] is None else str(e[2]) for e in events], pa.string()),
            "c6": pa.array([None if e[5] is None else bytes([e[0] % 256]) * ((e[2] or 0) % 5) for e in events], pa.binary()),
            "c7": pa.array([None if e[3] is None else [e[4], e[3]] for e in events], pa.list_(pa.float64()))} if with_text else {}),
    })
    members = encode_events(table, features, np.array([e[1] for e in events], dtype=np.int64)).to_pylist()
    wanted = list(range(len(features)))
    times, columns = make_events_decoder(features, wanted, at_once_from=0)(members, low, high)
    one = make_decoder(features, wanted)
    expected = [one(m[8:]) for m in events_between(members, low, high)]
    def same(a, b) -> bool:  # NaN equals NaN, in arrays too
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    assert times == [t for t, _ in expected]
    for k in wanted:
        got, want = columns[k], [row[k] for _, row in expected]
        assert len(got) == len(want) and all(same(a, b) and type(a) is type(b) for a, b in zip(got, want)), (names[k], got, want)
