"""Training-dataset export: manifest contents and byte-identical reproduction after new data."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow.parquet as pq
import pytest

from featurestore.errors import FeatureStoreError

NOW = datetime(2024, 6, 1, tzinfo=UTC)

DEFS = """
from featurestore import Entity, FeatureService, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
events = PushSource(name="events", schema=[Field("card_id", Int64), Field("amount", Float64), Field("event_timestamp", UnixTimestamp)])
spend = FeatureView(name="spend", entities=[card], source=events, schema=[Field("amount", Float64)])
svc = FeatureService(name="svc", features=[spend])
"""


def push(store, start: int, n: int):
    store.push(
        "events",
        pd.DataFrame(
            {
                "card_id": [i % 7 for i in range(start, start + n)],
                "amount": [float(i) for i in range(start, start + n)],
                "event_timestamp": [NOW + timedelta(minutes=i) for i in range(start, start + n)],
            }
        ),
        to="offline",
    )


def entity_rows(n: int, time_column: str = "event_timestamp") -> pd.DataFrame:
    """``n`` labelled entity rows, a minute apart, timed by ``time_column``."""
    return pd.DataFrame(
        {
            "card_id": [i % 9 for i in range(n)],
            time_column: [NOW + timedelta(minutes=i, seconds=30) for i in range(n)],
            "label": [i % 2 for i in range(n)],
        }
    )


def test_export_manifest_and_byte_identical_reproduction(make_store, tmp_path):
    store = make_store(DEFS)
    push(store, 0, 300)
    labels = entity_rows(500)
    manifest = store.export_training_dataset(labels, "svc", tmp_path / "v1")
    assert manifest["row_count"] == 500 and manifest["table_versions"] == {"spend": 0}
    assert set(manifest) >= {
        "feature_service",
        "definition_hashes",
        "entities",
        "schema",
        "files",
        "created_at",
        "package_version",
    }
    data = pq.read_table(tmp_path / "v1" / manifest["files"][0]["path"])
    assert data["label"].to_pylist() == labels["label"].tolist()
    assert data["amount"][1].as_py() == 1.0  # card 1 at minute 1:30 sees its own minute-1 row

    push(store, 300, 300)  # more data arrives after the export
    cli = [sys.executable, "-m", "featurestore.cli", "export", "--repo", str(store.config.repo_path)]
    result = subprocess.run(
        [*cli, "--from-manifest", str(tmp_path / "v1" / "manifest.json"), "--out", str(tmp_path / "v2")],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "REDIS_URL": store.config.online.url},
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "v2" / "data-00000.parquet").read_bytes() == (
        tmp_path / "v1" / "data-00000.parquet"
    ).read_bytes()
    # a fresh export does see the new rows
    fresh = store.export_training_dataset(labels, "svc", tmp_path / "v3")
    assert fresh["files"][0]["sha256"] != manifest["files"][0]["sha256"]


def test_reproduction_refuses_changed_definitions(make_store, tmp_path):
    store = make_store(DEFS)
    push(store, 0, 10)
    store.export_training_dataset(
        pd.DataFrame({"card_id": [1], "event_timestamp": [NOW + timedelta(hours=1)]}), "svc", tmp_path / "v1"
    )
    manifest = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    manifest["definition_hashes"]["spend"] = "0" * 16
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureStoreError, match=r"definitions of \['spend'\] changed"):
        store.reproduce_training_dataset(tmp_path / "v1" / "manifest.json", tmp_path / "v2")


def test_entity_rows_timed_by_another_column_export_and_train(make_store, tmp_path):
    """A join takes entity rows timed by any one timestamp column (``ts``); their export crashed
    in summarizing the dataset (a ``KeyError`` for ``event_timestamp``), and the trainer read
    only ``event_timestamp``. The manifest now names the time column, and both use it."""
    from featurestore.training.dataset import ExportedDataset
    from featurestore.training.preprocessing import Preprocessor
    from featurestore.training.trainer import split_time

    store = make_store(DEFS)
    push(store, 0, 300)
    manifest = store.export_training_dataset(entity_rows(200, "ts"), "svc", tmp_path / "v1")
    assert manifest["time_column"] == "ts" and manifest["row_count"] == 200
    assert pq.read_table(tmp_path / "v1" / manifest["statistics"]).num_rows > 0
    split = split_time(tmp_path / "v1", 0.25)
    assert NOW.timestamp() * 1e6 < split < (NOW + timedelta(minutes=200)).timestamp() * 1e6
    rows = pq.read_table(tmp_path / "v1" / manifest["files"][0]["path"])
    pre = Preprocessor.fit(rows, ["amount"], [], hashed={})
    early = ExportedDataset(tmp_path / "v1", pre, "label", batch_size=64, time_range=(None, split))
    assert early.rows() == sum(1 for t in rows["ts"].to_pylist() if t.timestamp() * 1e6 < split)
