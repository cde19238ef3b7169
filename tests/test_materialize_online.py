"""Materialization into both stores, online statuses, monotonic writes, crash recovery, consistency."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featurestore.catalog import view_status
from featurestore.errors import BadRowsError, RequestError

NOW = datetime.now(UTC).replace(microsecond=0)
TS = pa.timestamp("us", tz="UTC")

ALL_TYPES = """
from datetime import timedelta
from featurestore import Entity, FeatureView, Field, FileSource, PushSource
from featurestore.types import *

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
src = FileSource(path="data/users.parquet", timestamp_field="ts", created_timestamp_field="created")
users = FeatureView(
    name="users", entities=[user], source=src, ttl=timedelta(days={ttl_days}),
    schema=[Field("i32", Int32), Field("i64", Int64), Field("f32", Float32), Field("f64", Float64),
            Field("s", String), Field("b", Bool), Field("raw", Bytes), Field("when", UnixTimestamp),
            Field("ai", Array(Int64)), Field("as_", Array(String)), Field("af", Array(Float32))],
)
pushed = PushSource(name="user_push", schema=[Field("user_id", Int64), Field("score", Float64),
                                              Field("event_timestamp", UnixTimestamp)])
scores = FeatureView(name="scores", entities=[user], source=pushed, schema=[Field("score", Float64)])
"""


def random_users(n_users: int, n_rows: int, seed: int) -> pa.Table:
    rnd = random.Random(seed)
    maybe = lambda v: None if rnd.random() < 0.15 else v  # noqa: E731
    rows = []
    for _ in range(n_rows):
        event = NOW - timedelta(hours=rnd.randint(1, 24 * 20))
        rows.append(
            {
                "user_id": rnd.randint(1, n_users),
                "ts": event,
                "created": event + timedelta(minutes=rnd.choice([0, 0, 5])),
                "i32": maybe(rnd.randint(-(2**31), 2**31 - 1)),
                "i64": maybe(rnd.randint(-(2**63), 2**63 - 1)),
                "f32": maybe(rnd.uniform(-1e3, 1e3)),
                "f64": maybe(rnd.uniform(-1e9, 1e9)),
                "s": maybe(rnd.choice(["", "a", "ünïcode", "x" * 50])),
                "b": maybe(rnd.random() < 0.5),
                "raw": maybe(bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 8)))),
                "when": maybe(NOW - timedelta(seconds=rnd.randint(0, 10**7), microseconds=rnd.randint(0, 999999))),
                "ai": maybe([rnd.randint(-100, 100) for _ in range(rnd.randint(0, 4))]),
                "as_": maybe([rnd.choice(["p", "q", "r,s"]) for _ in range(rnd.randint(0, 3))]),
                "af": maybe([rnd.uniform(-1, 1) for _ in range(rnd.randint(0, 3))]),
            }
        )
    schema = pa.schema(
        [
            ("user_id", pa.int64()),
            ("ts", TS),
            ("created", TS),
            ("i32", pa.int32()),
            ("i64", pa.int64()),
            ("f32", pa.float32()),
            ("f64", pa.float64()),
            ("s", pa.string()),
            ("b", pa.bool_()),
            ("raw", pa.binary()),
            ("when", TS),
            ("ai", pa.list_(pa.int64())),
            ("as_", pa.list_(pa.string())),
            ("af", pa.list_(pa.float32())),
        ]
    )
    return pa.Table.from_pylist(rows, schema)


FEATURES = ["i32", "i64", "f32", "f64", "s", "b", "raw", "when", "ai", "as_", "af"]


@pytest.fixture
def users_store(make_store):
    def build(table: pa.Table, ttl_days: int = 30):
        return make_store(ALL_TYPES.replace("{ttl_days}", str(ttl_days)), {"users": table})

    return build


def online_vs_offline(store, ids, at):
    refs = [f"users:{f}" for f in FEATURES]
    online = store.get_online_features([{"user_id": i} for i in ids], features=refs, full_feature_names=False)
    entity_df = pd.DataFrame({"user_id": ids, "event_timestamp": [at] * len(ids)})
    offline = store.get_historical_features(entity_df, features=refs).to_arrow()
    return online, offline


def test_online_equals_offline_for_every_type(users_store):
    store = users_store(random_users(n_users=40, n_rows=600, seed=1))
    report = store.materialize(None, NOW)
    assert report.views[0].computed_rows == 600 and report.views[0].rejected_rows == 0
    ids = list(range(1, 46))  # 41..45 are unknown
    online, offline = online_vs_offline(store, ids, NOW)
    values = online.to_dict()
    for f in FEATURES:
        typ = offline.schema.field(f).type
        online_col = pa.array(values[f], typ)  # same dtype, so float32/list<float32> compare bit for bit
        assert online_col.equals(offline[f].combine_chunks()), f
    statuses = online.to_rest()["results"]
    assert {s for col in statuses[1:] for s in col["statuses"]} <= {"PRESENT", "NULL_VALUE", "NOT_FOUND"}
    assert all(s == "NOT_FOUND" for col in statuses[1:] for s in col["statuses"][40:])


def test_each_status_and_ttl_enforced_online(users_store):
    t = pa.table(
        {
            "user_id": [1, 2, 3],
            "ts": pa.array([NOW - timedelta(hours=1), NOW - timedelta(days=3), NOW - timedelta(hours=1)], TS),
        }
    )
    base = random_users(3, 3, seed=2).drop_columns(["user_id", "ts"])
    table = pa.table({**{c: t[c] for c in t.column_names}, **{c: base[c] for c in base.column_names}})
    table = table.set_column(table.schema.get_field_index("i64"), "i64", pa.array([5, 6, None], pa.int64()))
    store = users_store(table, ttl_days=2)
    store.materialize(None, NOW)
    response = store.get_online_features(
        [{"user_id": 1}, {"user_id": 2}, {"user_id": 3}, {"user_id": 4}], features=["users:i64"]
    )
    column = response.to_rest()["results"][1]
    assert column["statuses"] == ["PRESENT", "OUTSIDE_MAX_AGE", "NULL_VALUE", "NOT_FOUND"]
    assert column["values"] == [5, None, None, None]
    assert column["event_timestamps"][1].year > 1970 and column["event_timestamps"][3].year == 1970  # Feast's "no time"
    # offline agrees: the 3-day-old row is outside the 2-day ttl at NOW
    offline = store.get_historical_features(
        pd.DataFrame({"user_id": [1, 2, 3], "event_timestamp": [NOW] * 3}), features=["users:i64"]
    ).to_arrow()
    assert offline["i64"].to_pylist() == [5, None, None]


def test_a_lookup_at_a_time_before_the_stored_value_does_not_see_it(users_store):
    """A lookup ``at`` a time before the stored row's event time (a replay, a backtest) answered
    PRESENT with that later value, which a historical query at that time cannot see (a leak from
    its future). It is NOT_FOUND: Redis keeps only the latest row, so what held then is not known
    online. (Without ``at``, a row stamped ahead within ``future_tolerance`` is served.)"""
    store = users_store(random_users(2, 5, seed=5))
    t0 = NOW - timedelta(hours=3)
    store.push("user_push", {"user_id": [4], "score": [5.0], "event_timestamp": [t0]})
    for at, status in [
        (t0, "PRESENT"),
        (t0 - timedelta(microseconds=1), "NOT_FOUND"),
        (t0 - timedelta(days=1), "NOT_FOUND"),
    ]:
        online = store.get_online_features([{"user_id": 4}], features=["scores:score"], at=at).to_rest()["results"][1]
        offline = store.get_historical_features(
            pd.DataFrame({"user_id": [4], "event_timestamp": [at]}), features=["scores:score"]
        ).to_df()["score"]
        assert online["statuses"] == [status], at
        assert (online["values"] == [5.0]) == (offline.tolist() == [5.0])
        if status == "NOT_FOUND":  # (as for an entity never written, the time included)
            unknown = store.get_online_features([{"user_id": 99}], features=["scores:score"], at=at).to_rest()
            assert online == unknown["results"][1]
    soon = datetime.now(UTC) + timedelta(seconds=2)  # a producer's clock ahead, within the tolerance
    store.push("user_push", {"user_id": [5], "score": [6.0], "event_timestamp": [soon]})
    assert store.get_online_features([{"user_id": 5}], features=["scores:score"]).to_dict()["score"] == [6.0]


def test_same_event_time_correction_wins_online_and_offline(users_store, tmp_path):
    event = NOW - timedelta(hours=2)
    first = random_users(1, 1, seed=3)
    store = users_store(first)
    store.materialize(None, NOW)
    # a correction: same event time, later created time, new value
    corrected = first.set_column(
        first.schema.get_field_index("created"), "created", pa.array([event + timedelta(hours=1)], TS)
    )
    corrected = corrected.set_column(
        corrected.schema.get_field_index("ts"), "ts", pa.array([first["ts"][0].as_py()], TS)
    )
    corrected = corrected.set_column(corrected.schema.get_field_index("i64"), "i64", pa.array([424242], pa.int64()))
    pq.write_table(pa.concat_tables([first, corrected]), store.config.repo_path / "data" / "users.parquet")
    store.materialize(None, NOW)
    online, offline = online_vs_offline(store, [1], NOW)
    assert online.to_dict()["i64"] == [424242] == offline["i64"].to_pylist()
    # and the stale value does not come back when the old row is re-materialized alone
    pq.write_table(first, store.config.repo_path / "data" / "users.parquet")
    store.materialize(None, NOW)
    assert store.get_online_features([{"user_id": 1}], features=["users:i64"]).to_dict()["i64"] == [424242]


def test_older_push_never_overwrites_newer(users_store):
    store = users_store(random_users(2, 5, seed=4))
    new = {"user_id": [7], "score": [2.0], "event_timestamp": [NOW - timedelta(minutes=1)]}
    old = {"user_id": [7], "score": [1.0], "event_timestamp": [NOW - timedelta(hours=1)]}
    store.push("user_push", pd.DataFrame(new))
    store.push("user_push", pd.DataFrame(old))
    assert store.get_online_features([{"user_id": 7}], features=["scores:score"]).to_dict()["score"] == [2.0]
    history = store.get_historical_features(
        pd.DataFrame({"user_id": [7, 7], "event_timestamp": [NOW - timedelta(minutes=30), NOW]}),
        features=["scores:score"],
    ).to_df()
    assert history["score"].tolist() == [1.0, 2.0]


def test_push_rejects_bad_input_and_loses_nothing(users_store):
    store = users_store(random_users(2, 5, seed=5))
    with pytest.raises(RequestError, match="lacks column"):
        store.push("user_push", {"user_id": [1]})
    with pytest.raises(RequestError, match="to"):
        store.push("user_push", {"user_id": [1], "score": [1.0], "event_timestamp": [NOW]}, to="everywhere")
    with pytest.raises(RequestError, match="null join key"):
        store.push(
            "user_push",
            pa.table(
                {
                    "user_id": pa.array([None, 3], pa.int64()),
                    "score": [1.0, 2.0],
                    "event_timestamp": pa.array([NOW, NOW], TS),
                }
            ),
        )
    assert store.get_online_features([{"user_id": 3}], features=["scores:score"]).to_rest()["results"][1][
        "statuses"
    ] == ["NOT_FOUND"]
    with pytest.raises(Exception, match="not found"):
        store.push("no_such_source", {"x": [1]})


def test_pushed_values_convert_only_where_their_meaning_is_kept(users_store):
    """Pushed columns were cast by Arrow's rules: epoch seconds in a DataFrame's integer column
    became µs (an event in January 1970, served OUTSIDE_MAX_AGE and joined as such), a bool key
    became entity 1, 2 a true flag, "1.5" a score, 2.5 a name. Now epoch numbers are read in the
    unit their size says, as over REST, and only conversions that keep a value's meaning are made."""
    store = users_store(random_users(2, 5, seed=5))
    when = NOW - timedelta(minutes=3)
    epoch_s, epoch_ms = int(when.timestamp()), int(when.timestamp() * 1000)
    store.push("user_push", {"user_id": [7, 8], "score": [1.0, 2.0], "event_timestamp": [epoch_s, epoch_ms]})
    store.push("user_push", {"user_id": ["9"], "score": [3], "event_timestamp": [when.timestamp()]})  # (text, int)
    # nanoseconds are truncated, as everywhere (Arrow's cast refused them: "would lose data")
    late_ns = pd.Timestamp(when) + pd.Timedelta(nanoseconds=700)
    store.push("user_push", pd.DataFrame({"user_id": [6], "score": [0.5], "event_timestamp": [late_ns]}))
    categorical = pd.DataFrame({"user_id": pd.Categorical([12]), "score": [1.5], "event_timestamp": [when]})
    store.push("user_push", categorical)  # (pandas' categoricals are their values)
    assert store.get_online_features([{"user_id": 12}], features=["scores:score"]).to_dict()["score"] == [1.5]
    online = store.get_online_features([{"user_id": i} for i in (7, 8, 9, 6)], features=["scores:score"]).to_rest()
    assert online["results"][1]["values"] == [1.0, 2.0, 3.0, 0.5]
    assert online["results"][1]["event_timestamps"] == [when] * 4
    history = store.get_historical_features(
        pd.DataFrame({"user_id": [7, 8, 9, 6], "event_timestamp": [when] * 4}), features=["scores:score"]
    ).to_df()
    assert history["score"].tolist() == [1.0, 2.0, 3.0, 0.5]
    row = {"user_id": [10], "score": [1.0], "event_timestamp": [when]}
    for column, values, message in [
        ("user_id", [True], "holds bool values, not Int64"),
        ("user_id", ["010"], "not an integer's own"),
        ("score", ["1.5"], "holds string values, not Float64"),
        ("score", [False], "holds bool values"),
        ("event_timestamp", [float("nan")], "NaN"),
    ]:
        with pytest.raises(RequestError, match=message):
            store.push("user_push", {**row, column: values})
    assert store.get_online_features([{"user_id": 10}], features=["scores:score"]).statuses[1] == ["NOT_FOUND"]
    # Feast's write_to_online_store went through SQL's casts: a key of 10.5 was rounded to entity 11
    with pytest.raises(RequestError, match="truncated"):
        store.write_to_online_store("scores", {**row, "user_id": [10.5]})
    with pytest.raises(RequestError, match="holds bool values"):
        store.write_to_online_store("scores", {**row, "user_id": [True]})
    assert (
        store.get_online_features([{"user_id": i} for i in (1, 10, 11)], features=["scores:score"]).statuses[1]
        == ["NOT_FOUND"] * 3
    )
    store.write_to_online_store("scores", {**row, "event_timestamp": [epoch_ms]})
    assert store.get_online_features([{"user_id": 10}], features=["scores:score"]).to_rest()["results"][1][
        "event_timestamps"
    ] == [when]


def test_bad_source_rows_go_to_rejects_or_fail_the_run(users_store):
    table = random_users(3, 6, seed=6)
    ids = table["user_id"].to_pylist()
    ids[0] = None
    table = table.set_column(0, "user_id", pa.array(ids, pa.int64()))
    ts = table["ts"].to_pylist()
    ts[1] = None
    table = table.set_column(1, "ts", pa.array(ts, TS))
    store = users_store(table)
    with pytest.raises(BadRowsError, match="2 source rows"):
        store.materialize(None, NOW, on_bad_rows="fail")
    assert store.offline_store.version("users") is None  # nothing written
    report = store.materialize(None, NOW)
    assert (report.views[0].rejected_rows, report.views[0].computed_rows) == (2, 4)
    store.materialize(None, NOW)  # a re-run meets the same bad rows: kept once
    rejects = store.offline_store.rejects("users").to_pylist()
    assert sorted(r["reason"] for r in rejects) == ["null event timestamp", "null join key user_id"]
    assert '"user_id":null' in next(r["row"] for r in rejects if "join key" in r["reason"]).replace(" ", "")


def test_materialization_is_idempotent_and_incremental_catches_late_rows(users_store):
    table = random_users(10, 100, seed=7)
    store = users_store(table)
    store.materialize(None, NOW)
    assert store.materialize(None, NOW).views[0].new_offline_rows == 0
    assert store.offline_store.version("users") == 0
    # a late row: event time long ago, arriving after the last run, newest for user 99
    late = random_users(1, 1, seed=8)
    late = late.set_column(0, "user_id", pa.array([99], pa.int64()))
    pq.write_table(pa.concat_tables([table, late]), store.config.repo_path / "data" / "users.parquet")
    report = store.materialize_incremental(views=["users"])
    assert report.views[0].new_offline_rows == 1 and report.views[0].online_rows == 1
    online, offline = online_vs_offline(store, [99], NOW)
    assert online.to_dict()["i64"] == offline["i64"].to_pylist()
    assert online.to_rest()["results"][1]["statuses"][0] in ("PRESENT", "NULL_VALUE")


def test_crash_between_stores_then_rerun_converges(users_store, monkeypatch):
    table = random_users(20, 200, seed=9)
    store = users_store(table)
    online_store = store.online_store

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-materialization")

    monkeypatch.setattr(online_store, "write_latest", crash)
    with pytest.raises(KeyboardInterrupt):
        store.materialize(None, NOW)
    monkeypatch.undo()
    assert store.registry.watermark("users").online_synced is False
    store.materialize(None, NOW)  # history already has every row; Redis must still get them all
    online, offline = online_vs_offline(store, list(range(1, 21)), NOW)
    for f in FEATURES:
        assert pa.array(online.to_dict()[f], offline.schema.field(f).type).equals(offline[f].combine_chunks()), f


def test_recovery_converges_whatever_ran_in_between(users_store):
    """Issue #10: history holding rows Redis lacks must reach Redis at the next online write,
    whatever runs in between: a push used to clear the mark, a windowed run never looked back."""
    store = users_store(random_users(3, 20, seed=11))
    row = lambda user, score: pd.DataFrame(
        {"user_id": [user], "score": [score], "event_timestamp": [NOW - timedelta(hours=2)]}
    )  # noqa: E731
    store.push("user_push", row(1, 1.0), to="offline")  # e.g. the Redis write failed after history
    store.push("user_push", row(2, 2.0))  # another client's push, both stores
    store.materialize(NOW - timedelta(hours=1), NOW, ["scores"])  # a windowed run: user 1 is outside its window
    assert store.get_online_features([{"user_id": 1}, {"user_id": 2}], features=["scores:score"]).to_dict()[
        "score"
    ] == [1.0, 2.0]
    assert store.registry.watermark("scores").online_synced is True

    status = lambda: view_status(store.registry, store.offline_store, None, store.config.project, "scores")[
        "online_synced"
    ]  # noqa: E731
    assert status() is True
    store.registry.set_watermark(
        "scores", online_layout="an older layout"
    )  # as after an upgrade changing how values are stored
    assert status() is False  # the UI says so; the next materialize re-sends the whole history
    store.materialize(NOW - timedelta(hours=1), NOW, ["scores"])
    assert status() is True

    early = users_store(random_users(30, 300, seed=16))  # history written before T only, then a run over [T, T2)
    cut = NOW - timedelta(days=10)
    early.materialize_offline(None, cut)
    early.materialize(cut, NOW)
    online, offline = online_vs_offline(early, list(range(1, 31)), NOW)
    for f in FEATURES:
        assert pa.array(online.to_dict()[f], offline.schema.field(f).type).equals(offline[f].combine_chunks()), f


def test_crash_inside_delta_write_leaves_previous_version(users_store, monkeypatch):
    import featurestore.offline.delta as delta

    store = users_store(random_users(5, 20, seed=10))
    store.materialize(None, NOW)
    more = random_users(5, 20, seed=11)
    pq.write_table(
        pa.concat_tables([random_users(5, 20, seed=10), more]), store.config.repo_path / "data" / "users.parquet"
    )

    def crash(*args, **kwargs):  # the data files are written; the commit that would list them fails
        raise OSError("disk full")

    monkeypatch.setattr(delta.DeltaOfflineStore, "commit", crash)
    with pytest.raises(OSError):
        store.materialize(None, NOW)
    monkeypatch.undo()
    assert store.offline_store.version("users") == 0
    table_dir = store.offline_store.table_path("users")
    assert len(list(table_dir.rglob("*.parquet"))) > store.offline_store.file_count("users")  # orphans, read by nobody
    store.materialize(None, NOW)
    assert store.offline_store.version("users") == 1
    online, offline = online_vs_offline(store, [1, 2, 3, 4, 5], NOW)
    assert online.to_dict()["i64"] == offline["i64"].to_pylist()


def test_online_request_errors(users_store):
    store = users_store(random_users(2, 4, seed=12))
    store.materialize(None, NOW)
    with pytest.raises(RequestError, match="takes Int64"):
        store.get_online_features([{"user_id": "1x"}], features=["users:i64"])  # ("1" is taken as 1, as by Feast)
    import numpy as np

    by_numpy = store.get_online_features({"user_id": list(np.array([1, 2]))}, features=["users:i64"]).to_dict()
    assert by_numpy["i64"] == store.get_online_features({"user_id": [1, 2]}, features=["users:i64"]).to_dict()["i64"]
    with pytest.raises(RequestError, match="missing join key"):
        store.get_online_features([{"other": 1}], features=["users:i64"])
    with pytest.raises(RequestError, match="no entities"):
        store.get_online_features({"user_id": []}, features=["users:i64"])
    with pytest.raises(Exception, match="not found"):
        store.get_online_features([{"user_id": 1}], features=["users:nope"])


def test_tie_without_created_column_resolves_the_same_online_and_offline(make_store):
    """Feast picks one row online and another offline here; both stores must agree."""
    defs = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Int64
user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
v = FeatureView(name="v", entities=[user], source=FileSource(path="data/t.parquet", timestamp_field="ts"), schema=[Field("x", Int64)])
"""
    event = NOW - timedelta(minutes=10)
    rows = pa.table(
        {
            "user_id": pa.array([1] * 6 + [2] * 2, pa.int64()),
            "ts": pa.array([event] * 8, TS),
            "x": pa.array([5, 9, 1, 7, 3, 8, 4, 6], pa.int64()),
        }
    )
    store = make_store(defs, {"t": rows})
    store.materialize(None, NOW)
    online = store.get_online_features({"user_id": [1, 2]}, features=["v:x"]).to_dict()["x"]
    offline = (
        store.get_historical_features(
            pd.DataFrame({"user_id": [1, 2], "event_timestamp": [NOW, NOW]}), features=["v:x"]
        )
        .to_df()["x"]
        .tolist()
    )
    assert online == offline and None not in online


def test_optional_key_expiry_after_ttl(tmp_path, redis_url, monkeypatch):
    import time

    from featurestore import FeatureStore

    from .conftest import write_repo

    monkeypatch.delenv("REDIS_URL", raising=False)
    defs = """
from datetime import timedelta
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Int64
user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
item = Entity(name="item", join_keys=["item_id"], value_type=Int64)
short = FeatureView(name="short", entities=[user], ttl=timedelta(seconds=3),
                    source=FileSource(path="data/u.parquet", timestamp_field="ts"), schema=[Field("x", Int64)])
forever = FeatureView(name="forever", entities=[item], source=FileSource(path="data/i.parquet", timestamp_field="ts"),
                      schema=[Field("x", Int64)])
"""
    now = datetime.now(UTC)
    table = lambda key: pa.table(
        {
            key: pa.array([1], pa.int64()),
            "ts": pa.array([now - timedelta(seconds=1)], TS),
            "x": pa.array([7], pa.int64()),
        }
    )  # noqa: E731
    root = write_repo(tmp_path, defs, {"u": table("user_id"), "i": table("item_id")}, url=redis_url)
    config = (
        (root / "featurestore.yaml")
        .read_text()
        .replace("online_store: {url:", "online_store: {expire_after_ttl: true, url:")
    )
    (root / "featurestore.yaml").write_text(config)
    store = FeatureStore(root)
    store.apply()
    store.materialize(None, now + timedelta(seconds=1))
    client = store.online_store.client
    user_key = f"fs:{store.config.project}:{{user_id=1}}"
    expires = (now + timedelta(seconds=2)).timestamp()  # the value's time (now - 1 s) + its ttl
    before = time.time()
    left = client.pttl(user_key)
    after = time.time()
    assert (expires - after) * 1000 - 5 <= left <= (expires - before) * 1000 + 5  # expires with the value
    assert client.pttl(f"fs:{store.config.project}:{{item_id=1}}") == -1  # no ttl: kept
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    assert not client.exists(user_key)
    assert store.get_online_features({"user_id": [1]}, features=["short:x"]).to_rest()["results"][1]["statuses"] == [
        "NOT_FOUND"
    ]
    store.close()


def test_features_come_back_in_request_order(users_store):
    """Issue #10: features of one view used to come back together (a, c, b)."""
    store = users_store(random_users(3, 20, seed=12))
    store.materialize(None, NOW)
    refs = ["users:s", "scores:score", "users:i32"]
    assert store.get_online_features([{"user_id": 1}], features=refs).feature_names == ["user_id", "s", "score", "i32"]
    entity_df = pd.DataFrame({"user_id": [1], "event_timestamp": [NOW]})
    assert store.get_historical_features(entity_df, features=refs).to_df().columns.tolist() == [
        "user_id",
        "event_timestamp",
        "s",
        "score",
        "i32",
    ]


ARRAYS = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import *

thing = Entity(name="thing", join_keys=["thing_id"], value_type=Int64)
things = FeatureView(name="things", entities=[thing], source=FileSource(path="data/things.parquet", timestamp_field="ts"),
    schema=[Field("floats", Array(Float64)), Field("blobs", Array(Bytes)), Field("times", Array(UnixTimestamp)),
            Field("flags", Array(Bool)), Field("words", Array(String))])
"""


def test_arrays_with_nan_infinity_bytes_and_times_read_the_same_online_and_offline(make_store):
    """Issue #10: arrays were JSON text online: NaN broke the whole request, bytes and times came back as text."""
    when = NOW - timedelta(days=3, microseconds=7)
    table = pa.table(
        {
            "thing_id": pa.array([1, 2, 3], pa.int64()),
            "ts": pa.array([NOW - timedelta(hours=1)] * 3, TS),
            "floats": pa.array([[math.nan, math.inf, -math.inf, None, 1.5], [], None], pa.list_(pa.float64())),
            "blobs": pa.array([[b"\x00a", b"", None, bytes(range(256))], [b"\xff"], None], pa.list_(pa.binary())),
            "times": pa.array([[when, None], [], None], pa.list_(TS)),
            "flags": pa.array([[True, None, False], [], None], pa.list_(pa.bool_())),
            "words": pa.array([["ü", None, "", "a\\x1fb"], [], None], pa.list_(pa.string())),
        }
    )
    store = make_store(ARRAYS, {"things": table})
    store.apply()
    store.materialize(None, NOW)
    refs = [f"things:{c}" for c in ("floats", "blobs", "times", "flags", "words")]
    online = store.get_online_features({"thing_id": [1, 2, 3]}, features=refs).to_dict()
    offline = store.get_historical_features(
        pd.DataFrame({"thing_id": [1, 2, 3], "event_timestamp": [NOW] * 3}), features=refs
    ).to_arrow()
    nan_safe = lambda rows: [
        None if r is None else ["NaN" if isinstance(v, float) and math.isnan(v) else v for v in r] for r in rows
    ]  # noqa: E731
    for column in ("floats", "blobs", "times", "flags", "words"):
        assert nan_safe(online[column]) == nan_safe(offline[column].to_pylist()), column
    assert math.isnan(online["floats"][0][0]) and online["floats"][0][1:3] == [math.inf, -math.inf]
    assert online["blobs"][0][0] == b"\x00a" and online["times"][0][0] == when


def test_the_compiled_query_cache_is_bounded(users_store):
    """Issue #11: one cache entry per distinct feature list, never freed (+147 MB after 2,000 lists)."""
    import itertools

    store = users_store(random_users(2, 5, seed=13))
    store.materialize(None, NOW)
    lists = itertools.islice((list(p) for r in (1, 2, 3, 4) for p in itertools.permutations(FEATURES, r)), 10_000)
    for features in lists:
        store.get_online_features([{"user_id": 1}], features=[f"users:{f}" for f in features])
    cache = store.definitions.query_cache
    assert 0 < len(cache) <= cache.capacity < 10_000


def test_rows_from_the_future_are_refused_until_due(users_store):
    """Issue #10: a pushed row stamped an hour ahead was served online at once, while a
    historical query at now could not see it. Beyond `future_tolerance` it is rejected."""
    store = users_store(random_users(3, 20, seed=14))
    ahead = {"user_id": [9], "score": [1.0], "event_timestamp": [datetime.now(UTC) + timedelta(hours=1)]}
    with pytest.raises(RequestError, match="event time is in the future"):
        store.push("user_push", pd.DataFrame(ahead))
    assert store.get_online_features([{"user_id": 9}], features=["scores:score"]).statuses[1] == ["NOT_FOUND"]
    soon = {
        **ahead,
        "event_timestamp": [datetime.now(UTC) + timedelta(seconds=1)],
    }  # clock skew: within tolerance
    assert store.push("user_push", pd.DataFrame(soon)) == 1


def test_a_correction_that_reverts_is_the_latest_write(users_store):
    """Issue #10: A, then B, then A again at one event time served B: the third write had A's
    identity and was dropped. Pushed rows now carry their arrival time."""
    store = users_store(random_users(3, 20, seed=15))
    at = NOW - timedelta(minutes=5)
    for score in (1.0, 2.0, 1.0):
        store.push("user_push", pd.DataFrame({"user_id": [42], "score": [score], "event_timestamp": [at]}))
    assert store.get_online_features([{"user_id": 42}], features=["scores:score"]).to_dict()["score"] == [1.0]
    offline = store.get_historical_features(
        pd.DataFrame({"user_id": [42], "event_timestamp": [NOW]}), features=["scores:score"]
    )
    assert offline.to_df()["score"].tolist() == [1.0]
    store.materialize_incremental(NOW, ["scores"])  # recomputed from the push log: the same rows, nothing new
    assert store.get_online_features([{"user_id": 42}], features=["scores:score"]).to_dict()["score"] == [1.0]
    assert store.offline_store.version("scores") is not None


def test_concurrent_materializations_never_duplicate_history(users_store):
    """Issue #11: two `materialize` runs at once both appended every row (1,000,000 duplicates)."""
    import subprocess
    import sys

    import duckdb

    store = users_store(random_users(500, 30_000, seed=17))
    env = {k: v for k, v in __import__("os").environ.items() if k != "REDIS_URL"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "featurestore.cli",
                "materialize-incremental",
                "--repo",
                str(store.config.repo_path),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(3)
    ]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read().decode()[-2000:]
    con = duckdb.connect()
    store.offline_store.register(con, "users", "h", store.definitions.history_schema(store.get_feature_view("users")))
    total, distinct = con.execute("SELECT count(*), count(DISTINCT _row_id) FROM h").fetchone()
    assert total == distinct > 0


def test_an_emptied_replaced_or_restored_redis_is_refilled_by_the_next_materialization(users_store):
    """A view's registry mark said Redis held its whole history, so a materialization sent only the
    rows history lacked: to an emptied Redis, another Redis (a new cluster, a failover to an
    empty replica) or one restored from an older copy it sent nothing, and lookups kept answering
    NOT_FOUND or old values. The write that fills Redis now leaves a token there and in the
    registry; a store without it gets the whole history again. A partial loss (keys deleted, the
    token kept) is what ``rebuild_online`` is for."""
    store = users_store(random_users(10, 100, seed=18))
    store.materialize(None, NOW)
    client, prefix = store.online_store.client, store.online_store.prefix

    def online_equals_history() -> bool:
        online, offline = online_vs_offline(store, list(range(1, 11)), NOW)
        return online.to_dict()["i64"] == offline["i64"].to_pylist()

    def status() -> dict:  # what the web UI shows of the view
        return view_status(store.registry, store.offline_store, store.online_store, store.config.project, "users")

    assert status()["online_synced"] is True and status()["online_behind"] is None
    for key in client.scan_iter(match=prefix + b"*"):  # emptied (or another Redis): refilled
        client.delete(key)
    assert status()["online_synced"] is False and "emptied" in status()["online_behind"]  # (it said in sync)
    assert store.materialize_incremental(NOW).views[0].online_rows == 10
    assert online_equals_history()
    assert status()["online_synced"] is True
    assert store.materialize_incremental(NOW).views[0].online_rows == 0  # (in sync: nothing re-sent)

    older = {key: client.dump(key) for key in client.scan_iter(match=prefix + b"*")}
    newer = random_users(10, 100, seed=19).set_column(1, "ts", pa.array([NOW - timedelta(minutes=30)] * 100, TS))
    newer = newer.set_column(2, "created", newer["ts"])
    pq.write_table(newer, store.config.repo_path / "data" / "users.parquet")
    store.materialize_incremental(NOW)
    for key in client.scan_iter(match=prefix + b"*"):  # restored from the copy taken before that run
        client.delete(key)
    for key, dumped in older.items():
        client.restore(key, 0, dumped)
    assert not online_equals_history()
    store.materialize_incremental(NOW)
    assert online_equals_history()

    for key in [k for k in client.scan_iter(match=prefix + b"*") if b"user_id=" in k][:5]:  # partly lost
        client.delete(key)
    store.materialize_incremental(NOW)
    assert (
        "NOT_FOUND"
        in store.get_online_features([{"user_id": i} for i in range(1, 11)], features=["users:i64"]).statuses[1]
    )
    store.materialize_incremental(NOW, rebuild_online=True)
    assert online_equals_history()


def test_a_redis_that_evicts_is_named_and_a_full_one_refuses_saying_so_and_loses_nothing(tmp_path, caplog):
    """A Redis that may delete keys once full (``maxmemory-policy`` allkeys-lru) would make values
    vanish and aggregates count part of their windows: opening the store says so. A full one under
    ``noeviction``, or a replica, refused the write scripts and the CLI printed a traceback; it is
    now one line saying what to do, and a re-run after it takes writes converges."""
    import logging
    import os
    import subprocess
    import sys

    import redis

    from featurestore import FeatureStore
    from featurestore.errors import OnlineStoreUnavailable
    from featurestore.online.embedded import EmbeddedRedis, redis_server_binary

    from .conftest import free_port, write_repo

    server = EmbeddedRedis(tmp_path / "own-redis")
    url = server.ensure_running()
    try:
        client = redis.Redis.from_url(url)
        client.config_set("maxmemory", "256mb")
        client.config_set("maxmemory-policy", "allkeys-lru")
        root = write_repo(
            tmp_path / "repo", ALL_TYPES.replace("{ttl_days}", "30"), {"users": random_users(10, 100, 20)}, url=url
        )
        with caplog.at_level(logging.WARNING, logger="featurestore.feature_store"), FeatureStore(root) as store:
            store.apply()
            assert store.online_store.eviction_policy() == "allkeys-lru"
            assert "maxmemory-policy allkeys-lru" in caplog.text and "noeviction" in caplog.text
            client.config_set("maxmemory-policy", "noeviction")
            assert store.online_store.eviction_policy() is None
            client.config_set("maxmemory", "1")  # (past it at once: every write refused)
            with pytest.raises(OnlineStoreUnavailable, match="is full .* refuses writes"):
                store.materialize(None, NOW)
            pushed = {"user_id": [1], "score": [0.5], "event_timestamp": [NOW]}
            with pytest.raises(OnlineStoreUnavailable, match="is full"):
                store.push("user_push", pa.table(pushed), to="online")
            cli = subprocess.run(
                [sys.executable, "-m", "featurestore", "materialize-incremental", "-r", str(root)],
                capture_output=True,
                text=True,
                env={**os.environ, "COLUMNS": "200"},
                timeout=120,
            )
            assert cli.returncode == 1 and "is full" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
            client.config_set("maxmemory", "0")
            port = free_port()  # a primary on TCP (the embedded one listens on a unix socket only)
            primary = subprocess.Popen(
                [redis_server_binary(), "--port", str(port), "--save", "", "--dir", str(tmp_path)],
                stdout=subprocess.DEVNULL,
            )
            try:
                client.replicaof("127.0.0.1", port)  # (a replica: its writes refused too)
                with pytest.raises(OnlineStoreUnavailable, match="read-only replica: point `online_store.url` at"):
                    store.materialize(None, NOW)
                client.replicaof("NO", "ONE")
            finally:
                primary.terminate()
                primary.wait(30)
            store.materialize_incremental(NOW)
            online, offline = online_vs_offline(store, list(range(1, 11)), NOW)
            assert online.to_dict()["i64"] == offline["i64"].to_pylist()
    finally:
        server.stop()


def test_concurrent_server_lookups_are_batched_and_each_gets_its_own_values(users_store, monkeypatch):
    """The servers send the lookups of one event-loop turn to Redis together (``BatchedReads``):
    every lookup must still get exactly its own replies, and one lookup's error stays its own."""
    import asyncio

    import redis

    from featurestore.online import batched_reads
    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    store = users_store(random_users(n_users=40, n_rows=600, seed=21))
    store.materialize(None, NOW)
    reader = OnlineReader(store.online_store)
    refs = [f"users:{f}" for f in FEATURES]
    rnd = random.Random(5)
    batches = [[rnd.randint(1, 45) for _ in range(rnd.randint(1, 6))] for _ in range(120)]  # 41..45 unknown
    expected = [store.get_online_features({"user_id": ids}, features=refs, at=NOW).to_rest() for ids in batches]
    beside = [store.get_online_features({"user_id": ids}, features=refs, at=NOW).to_rest() for ids in ([8], [9, 10])]
    sent = []
    exchange = batched_reads.BatchedReads._exchange

    async def counted(self, batch):
        sent.append(len(batch))
        return await exchange(self, batch)

    monkeypatch.setattr(batched_reads.BatchedReads, "_exchange", counted)

    def query(ids):
        return OnlineQuery.prepare(
            store.definitions, store.config.project, {"user_id": ids}, refs, None, False, now=NOW
        )

    async def lookup(ids):
        q = query(ids)
        return (await reader.read_async(q)).to_rest()

    async def run():
        got = await asyncio.gather(*(lookup(ids) for ids in batches))
        wrong_type = query([7]).lookups[0][0]  # user 7's hash replaced by a string: its HMGET fails
        store.online_store.client.delete(wrong_type)
        store.online_store.client.set(wrong_type, b"not a hash")
        mixed = await asyncio.gather(lookup([7]), lookup([8]), lookup([9, 10]), return_exceptions=True)
        return got, mixed

    got, mixed = asyncio.run(run())
    assert got == expected
    assert sum(sent[:-1]) == len(batches) and max(sent) > 10  # few round trips carried them all
    assert isinstance(mixed[0], redis.ResponseError)  # the failing lookup's own error ...
    assert mixed[1:] == beside  # ... and the lookups sent with it unharmed


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_newest_row_of_each_entity_of_a_few_rows_is_the_querys(data):
    """A few rows' newest per entity is picked in Python (a query's set-up cost more than a small
    push's whole write): the same rows as DuckDB's arg_max over (event, created, run, row id),
    with ties at every level, one- and two-column keys of every non-float key type."""
    from featurestore.materialization import compute

    kinds = {
        "int": (st.integers(-3, 3), pa.int64()),
        "str": (st.sampled_from(["a", "b", "", "é"]), pa.string()),
        "bytes": (st.sampled_from([b"", b"\x00", b"a"]), pa.binary()),
        "bool": (st.booleans(), pa.bool_()),
        "time": (st.sampled_from([NOW, NOW + timedelta(microseconds=1)]), TS),
    }
    key_kinds = data.draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=2), label="keys")
    n = data.draw(st.integers(1, 40), label="rows")
    small = st.integers(0, 2)
    columns: dict[str, pa.Array] = {}
    for i, kind in enumerate(key_kinds):
        values, arrow = kinds[kind]
        columns[f"k{i}"] = pa.array(data.draw(st.lists(values, min_size=n, max_size=n)), arrow)
    for name in ("event_timestamp", "created_timestamp"):
        offsets = data.draw(st.lists(small, min_size=n, max_size=n))
        columns[name] = pa.array([NOW + timedelta(seconds=o) for o in offsets], TS)
    columns["_run_id"] = pa.array(data.draw(st.lists(small, min_size=n, max_size=n)), pa.int64())
    columns["_row_id"] = pa.array(range(n), pa.int64())  # (a row's run and row id name it: no two alike)
    columns["value"] = pa.array(range(n), pa.int64())
    rows = pa.table(columns)
    keys = [f"k{i}" for i in range(len(key_kinds))]

    def picked(table: pa.Table) -> list[tuple]:
        return sorted(tuple(r.values()) for r in table.to_pylist())

    assert rows.num_rows <= compute.FEW_ROWS
    assert picked(compute.latest_per_entity(rows, keys)) == picked(compute._latest_by_query(rows, keys))


def test_write_to_online_store_refuses_a_view_not_served_online(make_store):
    """A view with ``online=False`` has no online values: ``write_to_online_store`` into it says so
    (it returned the rows' count and wrote nothing), and Redis gains no key."""
    store = make_store(
        """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
src = PushSource(name="p", schema=[Field("user_id", Int64), Field("x", Float64), Field("event_timestamp", UnixTimestamp)])
archive = FeatureView(name="archive", entities=[user], source=src, schema=[Field("x", Float64)], online=False)
"""
    )
    with pytest.raises(RequestError, match="not served online"):
        store.write_to_online_store("archive", {"user_id": [1], "x": [2.0], "event_timestamp": [NOW]})
    assert not store.online_store.client.keys(store.online_store.prefix + b"*user_id=1*")
