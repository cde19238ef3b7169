"""Every source kind and both transformation kinds feed the same materialization path."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv

NOW = datetime.now(UTC).replace(microsecond=0)

DEFS = """
from featurestore import Entity, FeatureView, Field, FileSource, SqlSource
from featurestore.types import Float64, Int64, String

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)

def doubled(table):
    frame = table.to_pandas()
    frame["spend_x2"] = frame["spend"] * {factor}
    return frame[["user_id", "ts", "spend_x2"]]

py_view = FeatureView(name="py_view", entities=[user], transformation=doubled,
                      source=FileSource(path="data/spend.parquet", timestamp_field="ts"), schema=[Field("spend_x2", Float64)])
csv_view = FeatureView(name="csv_view", entities=[user], source=FileSource(path="data/spend.csv", format="csv", timestamp_field="ts"),
                       schema=[Field("spend", Float64), Field("city", String)])
sql_view = FeatureView(name="sql_view", entities=[user],
                       source=SqlSource(query="SELECT user_id, ts, spend FROM read_parquet('data/spend.parquet')", timestamp_field="ts"),
                       transformation="SELECT user_id, ts, sum(spend) OVER (PARTITION BY user_id ORDER BY ts) AS total FROM source",
                       schema=[Field("total", Float64)])
"""


def data() -> pa.Table:
    return pa.table(
        {
            "user_id": pa.array([1, 1, 2], pa.int64()),
            "ts": pa.array(
                [NOW - timedelta(hours=3), NOW - timedelta(hours=1), NOW - timedelta(hours=2)],
                pa.timestamp("us", tz="UTC"),
            ),
            "spend": [10.0, 5.0, 7.5],
            "city": ["a", "b", "c"],
        }
    )


def test_python_sql_and_csv_sources_materialize_and_serve(make_store, monkeypatch):
    store = make_store(DEFS.replace("{factor}", "2"), {"spend": data()}, apply=False)
    pacsv.write_csv(data(), store.config.repo_path / "data" / "spend.csv")
    store.apply()
    monkeypatch.chdir("/")  # the SQL source's relative path resolves against the repo, not the cwd
    report = store.materialize(None, NOW + timedelta(seconds=1))
    assert [v.computed_rows for v in report.views] == [3, 3, 3]
    online = store.get_online_features(
        {"user_id": [1, 2]}, features=["py_view:spend_x2", "csv_view:city", "sql_view:total"]
    ).to_dict()
    assert online == {"user_id": [1, 2], "spend_x2": [10.0, 15.0], "city": ["b", "c"], "total": [15.0, 7.5]}
    offline = store.get_historical_features(
        pd.DataFrame({"user_id": [1], "event_timestamp": [NOW - timedelta(hours=2)]}),
        features=["py_view:spend_x2", "sql_view:total"],
    ).to_df()
    assert offline[["spend_x2", "total"]].values.tolist() == [[20.0, 10.0]]


def test_changing_a_python_transformation_changes_its_hash_and_needs_backfill(make_store):
    from featurestore import FeatureStore

    store = make_store(DEFS.replace("{factor}", "2"), {"spend": data()}, apply=False)
    pacsv.write_csv(data(), store.config.repo_path / "data" / "spend.csv")
    store.apply()
    (store.config.repo_path / "features.py").write_text(DEFS.replace("{factor}", "3"))
    change = {c.name: c for c in FeatureStore(store.config.repo_path).plan().changes}["py_view"]
    assert change.attributes == ["transformation"] and change.needs_backfill
