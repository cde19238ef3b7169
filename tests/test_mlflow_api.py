"""The real ``mlflow`` client against our UI server (issue #30): an unchanged MLflow script logs
params, 1,000 metric steps, tags and artifacts into runs our own API reads, compares with a
native run, and MLflow reads back, ours included; writes need the ``track`` scope."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from featurestore import FeatureStore
from featurestore.auth import hash_key
from featurestore.tracking import Run, compare, curve, list_runs, read_run

from .conftest import demo_repo
from .test_ui import _serve

pytest.importorskip("mlflow")

WRITER_KEY, READER_KEY = "fsk_mlflow-writer", "fsk_mlflow-reader"

SCRIPT = """
import json, math, sys
import mlflow
from mlflow import MlflowClient

mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment("fraud-mlflow")
with mlflow.start_run(run_name="plain-pytorch") as run:
    mlflow.log_params({"lr": 0.01, "batch_size": 256})
    for step in range(1000):
        mlflow.log_metric("loss", 1 / (step + 1), step=step)
    mlflow.log_metric("grad_norm", float("nan"), step=0)
    mlflow.set_tag("team", "fraud")
    mlflow.log_artifact(sys.argv[2])
    mlflow.log_text("weights are in the registry", "notes/readme.txt")
run_id = run.info.run_id
client = MlflowClient()
got = mlflow.get_run(run_id)
found = mlflow.search_runs(experiment_names=["fraud-mlflow"], filter_string="metrics.loss < 0.01", output_format="list")
none = mlflow.search_runs(experiment_names=["fraud-mlflow"], filter_string="params.lr = '0.5'", output_format="list")
native = mlflow.search_runs(experiment_ids=["0"], output_format="list")
history = client.get_metric_history(run_id, "loss")
print(json.dumps({
    "run_id": run_id,
    "status": got.info.status,
    "params": got.data.params,
    "metrics": {k: (None if math.isnan(v) else v) for k, v in got.data.metrics.items()},
    "tags": {k: v for k, v in got.data.tags.items() if not k.startswith("mlflow.")},
    "found": [r.info.run_id for r in found],
    "none": [r.info.run_id for r in none],
    "native": [(r.info.run_id, r.info.status, r.data.params, r.data.metrics) for r in native],
    "history": [(m.step, m.value) for m in history],
    "artifacts": sorted(f.path for f in client.list_artifacts(run_id)),
    "notes": [f.path for f in client.list_artifacts(run_id, "notes")],
    "text": mlflow.artifacts.load_text(f"runs:/{run_id}/notes/readme.txt"),
}))
"""


@pytest.fixture
def served(tmp_path):
    keys = [
        {"name": "trainer", "sha256": hash_key(WRITER_KEY), "scopes": ["read", "track"]},
        {"name": "viewer", "sha256": hash_key(READER_KEY), "scopes": ["read"]},
    ]
    with demo_repo(tmp_path) as repo, FeatureStore(repo) as store:
        store.apply()
        native = Run(store.config.data_dir / "runs" / "20260101-000000-native")
        native.log_params({"config": {"epochs": 2, "learning_rate": 0.005}})
        native.log(0, loss=0.7)
        native.log(1, loss=0.4)
        native.finish({"loss": 0.4})
        env = {k: os.environ[k] for k in ("FEATURESTORE_DATA_DIR", "REDIS_URL")}
        process, url = _serve(
            {"repo": repo, "env": env}, {"FEATURESTORE_API_KEYS": json.dumps(keys), "MLFLOW_TRACKING_TOKEN": ""}
        )
        try:
            yield url, store, env
        finally:
            process.terminate()
            process.wait(10)


def _mlflow(url: str, env: dict, key: str, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), url, *args],
        env={**os.environ, **env, "MLFLOW_TRACKING_TOKEN": key},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_mlflow_script_logs_runs_we_show_and_mlflow_reads_ours(served, tmp_path):
    url, store, env = served
    model = tmp_path / "model.bin"
    model.write_bytes(os.urandom(50_000))
    done = _mlflow(url, env, WRITER_KEY, SCRIPT, str(model))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    run_id = seen["run_id"]

    # MLflow reads back what it logged
    assert seen["status"] == "FINISHED" and seen["params"] == {"lr": "0.01", "batch_size": "256"}
    assert seen["metrics"] == {"loss": 1 / 1000, "grad_norm": None} and seen["tags"] == {"team": "fraud"}
    assert seen["history"] == [[step, 1 / (step + 1)] for step in range(1000)]
    assert seen["found"] == [run_id] and seen["none"] == []
    assert seen["artifacts"] == ["model.bin", "notes"] and seen["notes"] == ["notes/readme.txt"]
    assert seen["text"] == "weights are in the registry"
    # ... and reads ours: experiment 0, finished, nested params flattened, the last step's loss
    [(native_id, status, params, metrics)] = seen["native"]
    assert native_id == "20260101-000000-native" and status == "FINISHED"
    assert params == {"config.epochs": "2", "config.learning_rate": "0.005"} and metrics == {"loss": 0.4}

    # our side: the run is listed, its curve has every step, its artifact is the file's bytes
    runs_dir = store.config.data_dir / "runs"
    listed = {r["id"]: r for r in list_runs(runs_dir)}
    assert listed[run_id]["status"] == "finished" and listed[run_id]["final"]["loss"] == 1 / 1000
    run = read_run(runs_dir / run_id)
    assert run["params"] == {"lr": "0.01", "batch_size": "256"} and run["tags"]["team"] == "fraud"
    assert sorted(run["metrics"]) == ["grad_norm", "loss"]
    assert curve(runs_dir / run_id, "loss", points=5000)["points"] == 1000
    sha = run["artifacts"]["model.bin"]["sha256"]
    assert sha == hashlib.sha256(model.read_bytes()).hexdigest() and store.artifacts().read(sha) == model.read_bytes()
    side_by_side = compare([run, read_run(runs_dir / "20260101-000000-native")])
    assert side_by_side["final"]["loss"] == [1 / 1000, 0.4] and "lr" in side_by_side["differs"]


LIGHTNING = """
import json, sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger

class Tiny(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

torch.manual_seed(0)
x = torch.randn(256, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=32)
logger = MLFlowLogger(experiment_name="lightning", tracking_uri=sys.argv[1], run_name="tiny")
trainer = pl.Trainer(max_epochs=3, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
trainer.fit(Tiny(lr=0.05), loader, loader)
print(json.dumps({"run_id": logger.run_id}))
"""


def test_lightnings_mlflow_logger_writes_a_run_we_show(served):
    """An unchanged Lightning script with its ``MLFlowLogger`` pointed at us: its hyperparameters,
    every step's loss and each epoch's validation loss land in a run our API reads."""
    pytest.importorskip("lightning")
    url, store, env = served
    done = _mlflow(url, env, WRITER_KEY, LIGHTNING)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = json.loads(done.stdout.strip().splitlines()[-1])["run_id"]
    runs_dir = store.config.data_dir / "runs"
    run = read_run(runs_dir / run_id)
    assert run["params"]["lr"] == "0.05"
    assert {"train_loss", "val_loss", "epoch"} <= set(run["metrics"])
    assert curve(runs_dir / run_id, "train_loss", points=5000)["points"] == 3 * 256 // 32  # every step
    assert curve(runs_dir / run_id, "val_loss", points=5000)["points"] == 3  # every epoch
    by_epoch = curve(runs_dir / run_id, "train_loss", points=5000, x="epoch")["xs"]
    assert by_epoch[0] == 0 and 2 < by_epoch[-1] <= 3  # Lightning's epoch metric places each step in its epoch
    assert {r["id"]: r for r in list_runs(runs_dir)}[run_id]["status"] == "finished"


ERRORS = """
import json, sys
import mlflow
from mlflow.exceptions import MlflowException

mlflow.set_tracking_uri(sys.argv[1])
out = {}
for name, call in [
    ("create", lambda: mlflow.create_experiment("viewer-made")),
    ("missing", lambda: mlflow.get_run("20990101-000000-absent")),
    ("bad filter", lambda: mlflow.search_runs(experiment_ids=["0"], filter_string="loss < 1")),
]:
    try:
        call()
        out[name] = "ok"
    except MlflowException as exc:
        out[name] = exc.error_code
out["listed"] = len(mlflow.search_runs(experiment_ids=["0"], output_format="list"))
print(json.dumps(out))
"""


def test_reading_needs_read_writing_needs_track_and_errors_say_what_went_wrong(served):
    url, _, env = served
    done = _mlflow(url, env, READER_KEY, ERRORS)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "create": "PERMISSION_DENIED",
        "missing": "RESOURCE_DOES_NOT_EXIST",
        "bad filter": "INVALID_PARAMETER_VALUE",
        "listed": 1,
    }, out
    refused = _mlflow(url, env, "", "import mlflow, sys; mlflow.set_tracking_uri(sys.argv[1]); mlflow.get_run('x')")
    assert refused.returncode == 1 and "UNAUTHENTICATED: missing or unknown API key" in refused.stderr


def test_searches_filter_order_and_page_and_params_never_change(tmp_path):
    """The model under the routes, in process: MLflow's filter clauses, ordering with missing values
    last, pages that cover every run once; a param logged again with another value is refused;
    a name makes one experiment; deleted runs leave the active view."""
    from featurestore.errors import ConflictError, RequestError
    from featurestore.storage import LocalObjects
    from featurestore.tracking import ArtifactStore
    from featurestore.tracking.mlflow_compat import MlflowTracking

    tracking = MlflowTracking(tmp_path / "runs", ArtifactStore(tmp_path / "artifacts"), LocalObjects(tmp_path / "exp"))
    experiment = tracking.create_experiment("sweep")
    with pytest.raises(ConflictError):
        tracking.create_experiment("sweep")
    assert tracking.experiment_by_name("sweep")["experiment_id"] == experiment
    ids = []
    for i, lr in enumerate(["0.1", "0.01", "0.001", "0.01"]):
        run = tracking.create_run(experiment, run_name=f"r{i}", start_time=1_000 + i)
        ids.append(run["info"]["run_id"])
        metrics = [{"key": "loss", "value": 1 / (i + 1), "step": 0}] if i != 2 else []  # r2 logs no loss
        tracking.log_batch(ids[-1], metrics=metrics, params=[{"key": "lr", "value": lr}])
    with pytest.raises(RequestError, match="cannot change"):
        tracking.log_batch(ids[0], params=[{"key": "lr", "value": "0.5"}])
    tracking.log_batch(ids[0], params=[{"key": "lr", "value": "0.1"}])  # the same value again: fine

    def names(filter_string="", order_by=None, view="ACTIVE_ONLY"):
        runs, _ = tracking.search_runs([experiment], filter_string, order_by, view_type=view)
        return [r["info"]["run_name"] for r in runs]

    assert names() == ["r3", "r2", "r1", "r0"]  # newest first
    assert names("params.lr = '0.01'") == ["r3", "r1"]
    assert names("metrics.loss < 0.6 AND params.lr LIKE '0.0%'") == ["r3", "r1"]
    assert names("attributes.run_name != 'r0'", ["metrics.loss ASC"]) == ["r3", "r1", "r2"]  # no loss: last
    assert names("", ["metrics.loss DESC"]) == ["r0", "r1", "r3", "r2"]  # in either direction
    with pytest.raises(RequestError, match="filter clause"):
        names("loss < 1")
    pages, token = [], None
    while True:
        page, token = tracking.search_runs([experiment], max_results=3, page_token=token)
        pages.append([r["info"]["run_name"] for r in page])
        if token is None:
            break
    assert pages == [["r3", "r2", "r1"], ["r0"]]
    tracking.set_lifecycle(ids[1], "deleted")
    assert names() == ["r3", "r2", "r0"] and names(view="DELETED_ONLY") == ["r1"]
    info = tracking.update_run(ids[0], status="FAILED", end_time=5_000)
    assert info["status"] == "FAILED" and info["end_time"] == 5_000


MLFLOW_POSTS = [
    "experiments/create",
    "runs/create",
    "runs/update",
    "runs/delete",
    "runs/restore",
    "runs/log-metric",
    "runs/log-parameter",
    "runs/set-tag",
    "runs/delete-tag",
    "runs/log-batch",
    "runs/search",
]
MLFLOW_FIELDS = [
    *("name", "tags", "experiment_id", "run_name", "start_time", "user_id", "status", "end_time", "key", "value"),
    *("timestamp", "step", "metrics", "params", "max_results", "filter", "order_by", "experiment_ids", "page_token"),
]


@pytest.fixture(scope="module")
def mlflow_client(tmp_path_factory, redis_url):
    from fastapi.testclient import TestClient

    from serving.ui import create_app

    from .conftest import write_repo

    root = write_repo(tmp_path_factory.mktemp("mlflow") / "repo", "", url=redis_url)
    with TestClient(create_app(root), raise_server_exceptions=False) as client:
        run = client.post("/api/2.0/mlflow/runs/create", json={"experiment_id": "0"}).json()["run"]["info"]["run_id"]
        yield client, run


def test_no_mlflow_body_gets_a_500(mlflow_client):
    """Fields of the wrong shape (tags as text, metrics as a number, an end time as an object, a
    page token as a list) raised inside the handlers: 500s. Each is now a 400 saying which field."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from .conftest import examples
    from .test_feature_server import json_values

    client, run = mlflow_client

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        route=st.sampled_from(MLFLOW_POSTS),
        fields=st.dictionaries(st.sampled_from(MLFLOW_FIELDS), json_values, max_size=5),
        of_the_run=st.booleans(),
    )
    def check(route, fields, of_the_run):
        body = {**fields, "run_id": run} if of_the_run else fields
        response = client.post(f"/api/2.0/mlflow/{route}", json=body)
        assert response.status_code < 500, (route, body, response.text)
        if response.status_code >= 400:
            assert response.json()["message"]

    check()


def test_a_run_id_is_its_characters_the_whole_id(mlflow_client):
    """A run id with a line break after a real one (which ``^…$`` let through, as every anchored
    name check here did: run ids, artifact digests, the UI's names) is no run id: an error saying
    so (INVALID_PARAMETER_VALUE), not a lookup of a folder by that name."""
    client, run = mlflow_client
    assert client.get("/api/2.0/mlflow/runs/get", params={"run_id": run}).status_code == 200
    response = client.get("/api/2.0/mlflow/runs/get", params={"run_id": run + "\n"})
    assert response.status_code == 422 and response.json()["error_code"] == "INVALID_PARAMETER_VALUE"
    assert "is not a run id" in response.json()["message"]
