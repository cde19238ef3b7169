"""Trainer, model registry, inference server (real Redis), promotion broadcast, staleness, consistency."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from torch.utils.data import DataLoader

from featurestore import FeatureStore
from featurestore.consistency import check_consistency
from featurestore.demo.generate import generate, load_demo
from featurestore.errors import FeatureStoreError
from featurestore.online.embedded import EmbeddedRedis
from featurestore.tracking.artifacts import ArtifactStore
from featurestore.tracking.metric_store import read_metrics
from featurestore.training.dataset import ExportedDataset
from featurestore.training.preprocessing import Preprocessor
from featurestore.training.trainer import TrainConfig, split_time, train
from serving.inference_server import create_app, load_checked, model_registry

from .conftest import free_port

DEFINITIONS = Path(__file__).resolve().parents[1] / "definitions"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small fraud pipeline run once: data, materialization, export, a trained and promoted model."""
    data_dir = tmp_path_factory.mktemp("fraud")
    redis_server = EmbeddedRedis(data_dir / "redis-own")
    env = {"FEATURESTORE_DATA_DIR": str(data_dir), "REDIS_URL": redis_server.ensure_running()}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    data = generate(n_cards=300, days=10, seed=3)
    store = FeatureStore(DEFINITIONS)
    dataset = data_dir / "dataset"
    load_demo(store, data, dataset)
    config = TrainConfig(dataset=str(dataset), request_inputs=["amount"], epochs=2)
    run = train(config, data_dir / "runs", progress=False)
    registry = model_registry(store)
    registry.promote("fraud", registry.register("fraud", run), "production")
    yield {
        "store": store,
        "data": data,
        "dataset": dataset,
        "run": run,
        "config": config,
        "env": env,
        "data_dir": data_dir,
    }
    store.close()
    redis_server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_run_is_tracked_with_hashes_metrics_and_plot(trained):
    run = trained["run"]
    params = json.loads((run / "params.json").read_text())
    assert set(params) >= {"dataset_manifest_hash", "definition_hashes", "code_version", "config"}
    assert set(params["definition_hashes"]) == {"card_profile", "card_activity", "merchant_risk"}
    logged = set(read_metrics(run)["metric"].to_pylist())
    assert {"train_loss", "val_auc", "val_loss"} <= logged
    final = json.loads((run / "final.json").read_text())
    assert final["val_auc"] > 0.75  # the planted fraud signal is learned
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    artifacts = json.loads((run / "artifacts.json").read_text())  # named by their hashes, verifiable by anyone
    store = ArtifactStore(run.parent.parent / "artifacts")
    assert {"loss.png", "weights.pt", "dataset_manifest.json"} <= set(artifacts)
    assert all(
        store.verify(a["sha256"]) and store.path(a["sha256"]).stat().st_size == a["bytes"] for a in artifacts.values()
    )


def test_training_resumes_from_checkpoint(trained, tmp_path):
    config = TrainConfig(**{**trained["config"].__dict__, "epochs": 1})
    run = train(config, tmp_path, progress=False)
    first = json.loads((run / "final.json").read_text())["step"]
    resumed = train(TrainConfig(**{**config.__dict__, "epochs": 2}), tmp_path, resume=run.name, progress=False)
    assert resumed == run
    assert json.loads((run / "final.json").read_text())["step"] == 2 * first
    resumes = json.loads((run / "params.json").read_text())["resumes"]
    assert [(r["at_step"], r["layout"]["world_size"]) for r in resumes] == [(first, 1)]  # lineage kept


def test_a_run_resumed_from_its_checkpoint_ends_bit_identical(trained, tmp_path):
    """A run stopped after one epoch and resumed for a second ends with exactly the weights of a
    run that trained both at once."""
    import torch

    from featurestore.training.checkpoints import full_model

    config = TrainConfig(**{**trained["config"].__dict__, "epochs": 2})
    straight = train(config, tmp_path / "a", progress=False)
    stopped = train(TrainConfig(**{**config.__dict__, "epochs": 1}), tmp_path / "b", progress=False)
    assert (stopped / "dcp" / "latest").exists() and not list((stopped / "dcp").glob("*.tmp"))
    train(config, tmp_path / "b", resume=stopped.name, progress=False)
    weights = [full_model(run).state_dict() for run in (straight, stopped)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_run_does_not_resume_on_another_dataset_or_batch_size(trained, tmp_path):
    """A resumed run keeps its data and recipe (params.json went on naming the first ones)."""
    from featurestore.errors import FeatureStoreError

    config = TrainConfig(**{**trained["config"].__dict__, "epochs": 1})
    run = train(config, tmp_path, progress=False)
    with pytest.raises(FeatureStoreError, match="cannot resume with another batch_size"):
        train(TrainConfig(**{**config.__dict__, "epochs": 2, "batch_size": 64}), tmp_path, resume=run.name)
    other = tmp_path / "other"
    shutil.copytree(config.dataset, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "manifest_hash": "another"}))
    with pytest.raises(FeatureStoreError, match="a resumed run continues on its own data"):
        train(TrainConfig(**{**config.__dict__, "epochs": 2, "dataset": str(other)}), tmp_path, resume=run.name)
    assert "resumes" not in json.loads((run / "params.json").read_text())


def test_dataset_yields_every_training_row_once_across_workers(trained):
    dataset = trained["dataset"]
    table = pq.read_table(dataset / "data-00000.parquet")
    split = split_time(dataset, 0.2)
    pre = Preprocessor.fit(table, ["amount", "txn_count_1h"], ["home_country"])
    data = ExportedDataset(dataset, pre, "label", batch_size=64, time_range=(None, split))
    expected = pc.sum(pc.less(pc.cast(table["event_timestamp"], pa.int64()), split)).as_py()
    for workers in (0, 2):
        rows = sum(len(y) for _, _, y in DataLoader(data, batch_size=None, num_workers=workers))
        assert rows == expected


def test_preprocessing_handles_nulls_and_unknown_categories_identically():
    table = pa.table({"x": [1.0, 3.0, None], "c": ["a", "b", None]})
    pre = Preprocessor.fit(table, ["x"], ["c"])
    batch = pre.transform({"x": table["x"], "c": table["c"]})
    single = pre.transform({"x": [None], "c": ["never seen"]})
    assert batch[0][2].tolist() == single[0][0].tolist() == [0.0, 1.0]
    assert single[1].tolist() == [[0]] and batch[1][2].tolist() == [0]


def test_entity_key_buckets_agree_between_training_and_serving():
    """Hashed entity-key ids from Arrow columns (training) equal those from lists (serving), for
    every key type, on every process (no Python hash randomisation)."""
    import subprocess as sp

    pre = Preprocessor([], [], hashed={"card": 1000, "merchant": 50})
    cards, merchants = [1, -7, 2**40, None, 999], ["m1", "", "é", None, "m1"]
    bulk = pre.transform({"card": pa.array(cards, pa.int64()), "merchant": pa.array(merchants)})[1]
    rows = pre.transform({"card": cards, "merchant": merchants})[1]
    assert bulk.tolist() == rows.tolist() and bulk[3].tolist() == [0, 0] and bulk[0][1] == bulk[4][1]
    elsewhere = sp.run(
        [
            sys.executable,
            "-c",
            "from featurestore.training.preprocessing import Preprocessor; "
            "print(Preprocessor([], [], hashed={'m': 50}).transform({'m': ['m1', 'é']})[1].tolist())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert elsewhere.strip() == str([[bulk[0][1].item()], [bulk[2][1].item()]])


def test_model_versions_are_immutable_and_promotable(trained):
    registry = model_registry(trained["store"])
    before = registry.versions("fraud")
    version = registry.register("fraud", trained["run"])
    assert version == before[-1] + 1 and registry.versions("fraud")[:-1] == before
    card = registry.card("fraud", version)
    assert card["dataset_manifest_hash"] and card["weights_sha256"] and card["feature_service"] == "fraud_model_v1"
    registry.promote("fraud", version, "staging")
    assert registry.aliases("fraud")["staging"] == version
    with pytest.raises(FeatureStoreError, match="stage must be"):
        registry.promote("fraud", version, "prod")
    with pytest.raises(FeatureStoreError, match="no version"):
        registry.promote("fraud", 999, "staging")


def test_promote_refuses_a_version_that_does_not_load(trained):
    """Issue #13: `promote` accepted a version whose file could not be loaded; every later restart failed."""
    registry = model_registry(trained["store"])
    version = registry.register("fraud", trained["run"])
    weights = registry.root / "fraud" / str(version) / "model.pt"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated (or edited) after registering
    with pytest.raises(FeatureStoreError, match=r"does not load.*differ from the hashes"):
        registry.promote("fraud", version, "production")
    assert registry.aliases("fraud").get("production") != version


def test_inference_server_scores_reports_statuses_and_logs(trained):
    app = create_app(DEFINITIONS, "fraud", "production")
    with TestClient(app) as client:
        one = client.post("/predict", json={"card_id": 1, "merchant_id": 2, "amount": 10.0})
        assert one.status_code == 200, one.text
        prediction = one.json()["predictions"][0]
        assert 0.0 <= prediction["score"] <= 1.0
        assert prediction["features"]["credit_limit"]["status"] == "PRESENT"
        batch = client.post(
            "/predict",
            json={
                "instances": [
                    {"card_id": 2, "merchant_id": 3, "amount": 5.0},
                    {"card_id": 999_999, "merchant_id": 3, "amount": 900.0},
                ]
            },
        )
        unknown = batch.json()["predictions"][1]
        assert unknown["features"]["credit_limit"]["status"] == "NOT_FOUND"
        assert "credit_limit" in unknown["missing_features"]
        assert client.post("/predict", json={"instances": [{"card_id": 1, "merchant_id": 2}]}).status_code == 422
        assert (
            client.post("/predict", json={"instances": [{"card_id": "x", "merchant_id": 2, "amount": 1.0}]}).status_code
            == 422
        )
        assert client.post("/predict", content=b"nope").status_code == 422
        assert client.get("/health").json()["status"] == "ok"
        assert "/predict" in client.get("/openapi.json").json()["paths"]
    report = check_consistency(trained["store"], "fraud")  # the logger flushed at shutdown
    assert report.rows == 3
    assert report.ok, report.describe()


def test_consistency_catches_planted_skew(trained):
    store = trained["store"]
    app = create_app(DEFINITIONS, "fraud", "production")
    # plant skew: a writer bypassing the materialization puts a value in Redis the history store never saw
    view = store.get_feature_view("card_profile")
    forged = pa.table(
        {
            "card_id": pa.array([7], pa.int64()),
            "event_timestamp": pa.array(  # newer than any row history has, not after now (then unseen)
                [datetime.now(UTC) - timedelta(seconds=1)], pa.timestamp("us", tz="UTC")
            ),
            "created_timestamp": pa.array(
                [trained["data"].transactions["event_timestamp"][-1].as_py()], pa.timestamp("us", tz="UTC")
            ),
            "_run_id": pa.array([10**9], pa.int64()),
            "_row_id": pa.array([1], pa.int64()),
            "credit_limit": [123456.0],
            "account_age_days": pa.array([1], pa.int32()),
            "home_country": ["ZZ"],
        }
    )
    store.online_store.write_latest(
        store.layout(view.name).online_field, forged, ["card_id"], [(f.name, f.dtype) for f in view.schema]
    )
    with TestClient(app) as client:
        assert client.post("/predict", json={"card_id": 7, "merchant_id": 1, "amount": 50.0}).status_code == 200
    report = check_consistency(store, "fraud")
    assert not report.ok
    assert report.feature_match["credit_limit"] < 1.0
    assert any(
        m["feature"] == "credit_limit" and m["card_id"] == 7 and m["online"] == 123456.0 for m in report.mismatches
    )


def test_stale_model_is_refused_naming_the_changed_view(trained, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(DEFINITIONS, repo, ignore=shutil.ignore_patterns("data", "__pycache__"))
    text = (
        (repo / "features.py")
        .read_text()
        .replace(
            'Aggregation("count", timedelta(hours=1), name="txn_count_1h")',
            'Aggregation("count", timedelta(hours=2), name="txn_count_1h")',
        )
    )
    (repo / "features.py").write_text(text)
    store = FeatureStore(repo)  # same data dir (env), so same model registry
    with pytest.raises(FeatureStoreError, match=r"older definitions of \['card_activity'\]"):
        load_checked(store, "fraud", "production")


def test_promotion_is_broadcast_to_every_replica(trained):
    env = {**os.environ, **trained["env"]}
    ports = [free_port(), free_port()]
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "featurestore.cli",
                "serve-model",
                "--repo",
                str(DEFINITIONS),
                "--model",
                "fraud",
                "--port",
                str(p),
                "--no-access-log",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for p in ports
    ]
    try:
        registry = model_registry(trained["store"])
        current = registry.resolve("fraud", "production")
        for port in ports:
            _wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").json()["version"] == current, servers)
        new = registry.register("fraud", trained["run"])
        seen: list[tuple[int, int]] = []  # (status, version) of every request made during the swap
        stop = threading.Event()

        def requests() -> None:
            with httpx.Client() as client:
                while not stop.is_set():
                    r = client.post(
                        f"http://127.0.0.1:{ports[0]}/predict",
                        json={"instances": [{"card_id": 1, "merchant_id": 1, "amount": 1.0}]},
                    )
                    seen.append((r.status_code, r.json()["model"]["version"] if r.status_code == 200 else -1))

        loop = threading.Thread(target=requests)
        loop.start()
        _wait_for(lambda: len(seen) >= 3, servers)  # requests flowing before the swap
        registry.promote("fraud", new, "production")
        for port in ports:
            _wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").json()["version"] == new, servers)
            body = httpx.post(
                f"http://127.0.0.1:{port}/predict", json={"card_id": 1, "merchant_id": 1, "amount": 1.0}
            ).json()
            assert body["model"]["version"] == new
        _wait_for(lambda: seen[-1][1] == new, servers)  # and after it
        stop.set()
        loop.join()
        # no request failed during the swap, and none went back to the old version after the new one
        assert {status for status, _ in seen} == {200}
        versions = [v for _, v in seen]
        assert versions[0] == current and versions[-1] == new and versions == sorted(versions)
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=30)


def _wait_for(condition, servers, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for s in servers:
            if s.poll() is not None:
                pytest.fail(f"server exited: {s.stderr.read().decode()[-2000:]}")
        try:
            if condition():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    pytest.fail("condition not met in time")


def test_a_request_input_the_model_cannot_hold_is_refused_not_scored(trained):
    """1e300 is a JSON number, but scaled it overflows the model's float32 input: it would be scored
    as infinity (the fuzz test below met it as a cast overflow warning)."""
    with TestClient(create_app(DEFINITIONS, "fraud", "production", log_features=False)) as client:
        body = {
            "instances": [
                {"card_id": 1, "merchant_id": 1, "amount": 50.0},
                {"card_id": 2, "merchant_id": 1, "amount": 1e300},
            ]
        }
        refused = client.post("/predict", json=body)
        assert refused.status_code == 422 and "'amount' = 1e+300 is outside the range" in refused.text, refused.text
        body["instances"][1]["amount"] = -1e300
        assert client.post("/predict", json=body).status_code == 422
        body["instances"][1]["amount"] = 1e6  # large, but representable: scored
        assert client.post("/predict", json=body).status_code == 200


def test_no_predict_body_gets_a_500(trained):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=5),
    )
    instance = st.dictionaries(st.sampled_from(["card_id", "merchant_id", "amount", "x"]), scalars, max_size=4)
    bodies = st.one_of(
        st.fixed_dictionaries({"instances": st.lists(instance, max_size=3)}),
        instance,
        st.lists(scalars, max_size=2),
        scalars,
    )

    with TestClient(create_app(DEFINITIONS, "fraud", "production", log_features=False)) as client:

        @settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(body=bodies)
        def check(body):
            response = client.post("/predict", json=body)
            assert response.status_code in (200, 404, 422), (body, response.text)

        check()


def test_regression_task_reports_rmse(trained, tmp_path):
    config = TrainConfig(
        **{**trained["config"].__dict__, "task": "regression", "label": "amount", "request_inputs": [], "epochs": 1}
    )
    run = train(config, tmp_path, progress=False)
    final = json.loads((run / "final.json").read_text())
    assert final["val_rmse"] > 0 and "val_auc" not in final


def test_the_inference_servers_document_matches_it(trained):
    """schemathesis found undocumented 400s, ``{"instances": [{}]}`` refused though the document took
    it, and ``/metrics``'s content type undocumented. The body's schema is now the served model's."""
    from .test_openapi import schemathesis, serving

    port = free_port()
    server = serving(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve-model",
            "--repo",
            str(DEFINITIONS),
            "--model",
            "fraud",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        port,
        env={**os.environ, **trained["env"]},
    )
    try:
        schemathesis(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(30)
