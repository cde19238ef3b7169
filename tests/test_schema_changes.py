"""Every kind of definition change has one defined outcome (issue #9): a type, key, source or
transformation change starts a new history version (filled by ``backfill``; older versions stay
readable), an added column evolves the history, a removed one stops being served, read-time
changes (ttl) need nothing. Online, bytes of another layout are never served as PRESENT."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from featurestore import FeatureStore
from featurestore.errors import FeatureStoreError

NOW = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
STATS = pa.table(
    {
        "driver_id": pa.array([1, 2], pa.int64()),
        "event_timestamp": pa.array([NOW - timedelta(hours=1)] * 2, pa.timestamp("us", tz="UTC")),
        "rating": pa.array([110, 42], pa.int64()),
        "trips": pa.array([3, 4], pa.int64()),
    }
)
FLOAT_STATS = STATS.set_column(2, "rating", pa.array([110.8647, 42.0]))
DEFS = """
from datetime import timedelta
from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64, String

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)
stats = FeatureView(
    name="stats", entities=[driver],
    source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("rating", Int64)], ttl=timedelta(days=1),
)
svc = FeatureService(name="svc", features=[stats])
"""
ENTITIES = pd.DataFrame({"driver_id": [1, 2, 3], "event_timestamp": [NOW] * 3})


def _change(store: FeatureStore, old: str, new: str) -> FeatureStore:
    """Edit features.py, apply, and return a store over the new definitions."""
    path = store.config.repo_path / "features.py"
    path.write_text(path.read_text().replace(old, new))
    changed = FeatureStore(store.config.repo_path)
    changed.apply()
    return changed


def _online(store: FeatureStore, features: list[str]) -> dict:
    response = store.get_online_features([{"driver_id": 1}, {"driver_id": 2}], features=features)
    return {"values": response.to_dict(), "statuses": response.statuses}


def _offline(store: FeatureStore, features: list[str]) -> dict:
    return (
        store.get_historical_features(ENTITIES, features=features)
        .to_arrow()
        .drop_columns(["event_timestamp"])
        .to_pydict()
    )


def test_a_type_change_is_a_new_version_that_never_truncates(make_store, tmp_path):
    """Int64 -> Float64 used to keep the integer column (training saw 110.0, online 110.8647)."""
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    before = store.export_training_dataset(ENTITIES, "svc", tmp_path / "v1")
    assert before["history_tables"] == {"stats": "stats"}

    pq.write_table(FLOAT_STATS, store.config.repo_path / "data" / "stats.parquet")  # the upstream now sends floats
    changed = _change(store, 'Field("rating", Int64)', 'Field("rating", Float64)')
    assert changed.layout("stats").history_table == "stats@v2"
    # until the backfill: nothing of the old version, nowhere
    assert _online(changed, ["stats:rating"])["statuses"][1] == ["NOT_FOUND", "NOT_FOUND"]
    assert _offline(changed, ["stats:rating"])["rating"] == [None, None, None]

    changed.backfill(["stats"])
    assert _online(changed, ["stats:rating"])["values"]["rating"] == [110.8647, 42.0]
    assert _offline(changed, ["stats:rating"])["rating"][:2] == [110.8647, 42.0]

    # the dataset made under v1 still reproduces byte for byte, from v1's table and definition
    again = changed.reproduce_training_dataset(tmp_path / "v1" / "manifest.json", tmp_path / "v1-again")
    assert again["files"] == before["files"]
    fresh = changed.export_training_dataset(ENTITIES, "svc", tmp_path / "v2")
    assert fresh["history_tables"] == {"stats": "stats@v2"} and fresh["files"] != before["files"]


def test_an_added_feature_evolves_history_and_reads_null_until_backfilled(make_store):
    """Adding a feature used to wedge the view (struct.error online, BinderException offline,
    SchemaMismatchError on backfill)."""
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    changed = _change(
        store, 'schema=[Field("rating", Int64)]', 'schema=[Field("rating", Int64), Field("trips", Int64)]'
    )
    assert changed.layout("stats").version == 1  # evolved, not a new version
    assert _offline(changed, ["stats:rating", "stats:trips"]) == {
        "driver_id": [1, 2, 3],
        "rating": [110, 42, None],
        "trips": [None, None, None],
    }
    online = _online(changed, ["stats:rating", "stats:trips"])
    assert online["statuses"][1:] == [["NOT_FOUND"] * 2, ["NOT_FOUND"] * 2]

    report = changed.backfill(["stats"])
    assert report.views[0].new_offline_rows == 2
    assert _offline(changed, ["stats:rating", "stats:trips"]) == {
        "driver_id": [1, 2, 3],
        "rating": [110, 42, None],
        "trips": [3, 4, None],
    }
    assert _online(changed, ["stats:rating", "stats:trips"])["values"] == {
        "driver_id": [1, 2],
        "rating": [110, 42],
        "trips": [3, 4],
    }
    from deltalake import DeltaTable  # the table's own schema gained the column (other Delta readers see it)

    assert "trips" in [f.name for f in DeltaTable(str(changed.offline_store.table_path("stats"))).schema().fields]


def test_a_removed_feature_fails_at_request_time_and_its_data_stays(make_store):
    two = DEFS.replace('schema=[Field("rating", Int64)]', 'schema=[Field("rating", Int64), Field("trips", Int64)]')
    store = make_store(two, {"stats": STATS})
    store.materialize(None, None)
    changed = _change(store, ', Field("trips", Int64)]', "]")
    for read in (_online, _offline):
        with pytest.raises(FeatureStoreError, match="trips"):
            read(changed, ["stats:trips"])
    assert changed.layout("stats").version == 1
    assert _offline(changed, ["stats:rating"])["rating"] == [110, 42, None]


@pytest.mark.parametrize(
    "old,new",
    [
        ("value_type=Int64)", "value_type=String)"),  # the key type (and the source's keys with it)
        (
            'timestamp_field="event_timestamp")',
            'timestamp_field="event_timestamp"), transformation="SELECT driver_id, event_timestamp, rating * 2 AS rating FROM source"',
        ),
    ],
)
def test_key_and_transformation_changes_are_new_versions(make_store, old, new):
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    if "String" in new:
        pq.write_table(
            STATS.set_column(0, "driver_id", pa.array(["1", "2"])), store.config.repo_path / "data" / "stats.parquet"
        )
    changed = _change(store, old, new)
    assert changed.layout("stats").version == 2
    keys = [{"driver_id": "1"}] if "String" in new else [{"driver_id": 1}]
    assert changed.get_online_features(keys, features=["stats:rating"]).statuses[1] == ["NOT_FOUND"]
    changed.backfill(["stats"])
    assert changed.get_online_features(keys, features=["stats:rating"]).to_dict()["rating"] == [
        220 if "*" in new else 110
    ]


def test_a_ttl_change_is_read_time_and_keeps_serving(make_store):
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    plan = FeatureStore(store.config.repo_path)
    (store.config.repo_path / "features.py").write_text(
        DEFS.replace("ttl=timedelta(days=1)", "ttl=timedelta(minutes=30)")
    )
    change = FeatureStore(store.config.repo_path).plan().changes[0]
    assert not change.needs_backfill and "backfill" not in change.describe()
    changed = FeatureStore(store.config.repo_path)
    changed.apply()
    assert changed.layout("stats").version == 1
    assert (
        _online(changed, ["stats:rating"])["statuses"][1] == ["OUTSIDE_MAX_AGE"] * 2
    )  # the hour-old rows, now too old
    assert plan.layout("stats").history_table == "stats"


def test_pushes_buffered_before_a_new_version_stay_in_the_old_one(make_store):
    pushed = (
        DEFS.replace('source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp")', "source=src")
        .replace(
            "driver = Entity",
            'src = PushSource(name="src", schema=[Field("driver_id", Int64), Field("event_timestamp", UnixTimestamp),\n'
            '    Field("rating", Int64)])\ndriver = Entity',
        )
        .replace("import Float64, Int64, String", "import Float64, Int64, String, UnixTimestamp")
        .replace("import Entity,", "import Entity, PushSource,")
    )
    store = make_store(pushed)
    store.push("src", {"driver_id": [1], "event_timestamp": [NOW], "rating": [7]})  # buffered, not yet in Delta
    changed = _change(store, 'Field("rating", Int64)', 'Field("rating", Float64)')  # the source's and the view's
    changed.flush()
    assert changed.offline_store.version("stats") is not None  # v1's rows went to v1's table
    assert changed.offline_store.version("stats@v2") is None
    changed.backfill(["stats"])  # v2 is rebuilt from the push log
    assert _offline(changed, ["stats:rating"])["rating"][:1] == [7.0]


def test_aggregated_views_start_a_new_version_when_their_events_gain_a_column(make_store):
    agg = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)
stats = FeatureView(
    name="stats", entities=[driver], source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("rating", Float64)], aggregations=[Aggregation("sum", timedelta(days=1), "rating")],
)
"""
    store = make_store(agg, {"stats": STATS})
    changed = _change(
        store, 'schema=[Field("rating", Float64)]', 'schema=[Field("rating", Float64), Field("trips", Int64)]'
    )
    assert changed.layout("stats").version == 2
    changed.backfill(["stats"])
    assert _online(changed, ["stats:rating_sum_24h"])["values"]["rating_sum_24h"] == [110.0, 42.0]


def test_cli_plan_and_backfill(make_store):
    store = make_store(DEFS, {"stats": STATS})
    root = str(store.config.repo_path)
    (store.config.repo_path / "features.py").write_text(
        DEFS.replace('Field("rating", Int64)', 'Field("rating", Float64)')
    )
    pq.write_table(FLOAT_STATS, store.config.repo_path / "data" / "stats.parquet")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "featurestore.cli", *args, "--repo", root], capture_output=True, text=True
        )

    assert "[new version v2:" in cli("plan").stdout
    assert cli("apply").returncode == 0
    out = cli("backfill", "stats")
    assert out.returncode == 0, out.stderr
    assert "stats: 2 rows computed, 2 new in history, 2 written online" in out.stdout and "stats@v2" in out.stdout
    described = json.loads(cli("describe", "stats").stdout)
    assert described["history_version"] == 2
    bad = cli("backfill", "nope")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "nope" in bad.stdout + bad.stderr


def test_a_new_version_is_the_registrys_not_set_on_the_definition_objects(make_store):
    """Applying a new version makes new Definitions under it: the objects the user's module made
    and Definitions already handed out (a running lookup's, a training job's) keep what they
    read, and the new ones compile lookups against the new layout, not a cached old one."""
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    path = store.config.repo_path / "features.py"
    path.write_text(
        path.read_text().replace(
            'timestamp_field="event_timestamp")',
            'timestamp_field="event_timestamp"), transformation="SELECT driver_id, event_timestamp, rating * 2 AS rating FROM source"',
        )
    )
    changed = FeatureStore(store.config.repo_path)
    before = changed.definitions
    user_view = before.view("stats")
    fields_before = dict(vars(user_view))
    changed.apply()
    after = changed.definitions
    assert after is not before and after.view("stats") is user_view
    assert vars(user_view) == fields_before  # nothing was set on the user's object
    assert before.layout("stats").version == 1 and after.layout("stats").version == 2
    assert after.layout("stats").online_field != before.layout("stats").online_field
    assert after.layout("stats").history_table == "stats@v2"
    changed.backfill(["stats"])
    assert changed.get_online_features([{"driver_id": 1}], features=["stats:rating"]).to_dict()["rating"] == [220]


def test_watermarks_are_typed_records(make_store):
    """A watermark field nobody defined is refused, not silently stored."""
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    mark = store.registry.watermark("stats")
    assert mark.online_synced and mark.synced_under(store.layout("stats").storage_id)
    assert mark.last_run_id is not None and mark.max_event_timestamp is not None
    with pytest.raises(TypeError):
        store.registry.set_watermark("stats", online_syncd=False)
    assert store.registry.watermark("stats") == mark
