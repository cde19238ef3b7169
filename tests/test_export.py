"""Training-dataset export: manifest contents and byte-identical reproduction after new data."""

from __future__ import annotations

import json
import shutil
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


def _published(folder) -> str | None:
    """The manifest hash of the dataset in ``folder`` after checking that every file its manifest
    names holds what the manifest says; None where there is no manifest (no dataset)."""
    import hashlib

    path = folder / "manifest.json"
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    for file in [*manifest["files"], {"path": manifest["entities"]["file"], **manifest["entities"]}]:
        digest = hashlib.sha256((folder / file["path"]).read_bytes()).hexdigest()
        assert digest == file["sha256"], f"{file['path']} is not the file the manifest names"
    return manifest["manifest_hash"]


def test_an_export_that_fails_midway_leaves_the_previous_one_whole(make_store, tmp_path, monkeypatch):
    """An export into a folder holding an earlier one wrote its files there, then its manifest:
    one that failed in between left the earlier manifest naming files it no longer described
    (the trainer reads a local dataset's files as its manifest lists them, without their hashes).
    So does a reproduction whose files differ. The files are now written aside and published once
    all are written, the manifest last, and a failure publishes nothing."""
    from featurestore.retrieval import export

    store = make_store(DEFS)
    push(store, 0, 300)
    first = store.export_training_dataset(entity_rows(500), "svc", tmp_path / "ds")
    summarize = export.summarize_dataset

    def fails(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(export, "summarize_dataset", fails)
    with pytest.raises(OSError, match="No space"):
        store.export_training_dataset(entity_rows(200), "svc", tmp_path / "ds")
    assert _published(tmp_path / "ds") == first["manifest_hash"]

    monkeypatch.setattr(export, "summarize_dataset", summarize)
    # a reproduction into the folder whose files differ from its manifest's (a manifest claiming
    # other data, beside its entity input): refused, and nothing published
    (tmp_path / "claimed").mkdir()
    shutil.copy(tmp_path / "ds" / "entities.parquet", tmp_path / "claimed")
    claimed = {**first, "files": [{**first["files"][0], "sha256": "0" * 64}]}
    (tmp_path / "claimed" / "manifest.json").write_text(json.dumps(claimed))
    with pytest.raises(FeatureStoreError, match="differ from the manifest's hashes"):
        store.reproduce_training_dataset(tmp_path / "claimed" / "manifest.json", tmp_path / "ds")
    assert _published(tmp_path / "ds") == first["manifest_hash"]

    second = store.export_training_dataset(entity_rows(200), "svc", tmp_path / "ds")
    assert _published(tmp_path / "ds") == second["manifest_hash"] != first["manifest_hash"]
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")) == []  # no scratch left


def test_an_export_killed_at_random_points_never_leaves_a_manifest_naming_other_files(make_store, tmp_path):
    """``featurestore export`` processes killed (SIGKILL) at random points while they replace an
    earlier dataset: the folder holds a dataset whose files are the ones its manifest names, or
    none (killed while publishing); the next export completes it."""
    import os
    import random
    import time

    store = make_store(DEFS)
    push(store, 0, 300)
    labels = tmp_path / "labels.parquet"
    entity_rows(100_000).to_parquet(labels)
    store.export_training_dataset(entity_rows(500), "svc", tmp_path / "ds")
    cli = [sys.executable, "-m", "featurestore.cli", "export", "--repo", str(store.config.repo_path)]
    args = [*cli, "--service", "svc", "--entities", str(labels), "--out", str(tmp_path / "ds")]
    env = {**os.environ, "REDIS_URL": store.config.online.url}
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    whole = time.monotonic() - started
    rng = random.Random(7)
    for _ in range(6):
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(rng.uniform(0.4, 1.0) * whole)
        process.kill()
        process.wait()
        _published(tmp_path / "ds")  # (asserts: whole, or no manifest)
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert _published(tmp_path / "ds") is not None
    left = [p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")]
    assert left == []  # the killed exports' folders went
