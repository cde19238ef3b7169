"""Distributed training (issue #13): every row once per epoch across ranks, HSDP and local-SGD
runs in real processes (torchrun, gloo), sharded checkpoints that resume on another world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from featurestore.tracking.metric_store import read_metrics

from .conftest import write_repo


def make_dataset(folder: Path, rows: int = 4000, row_group: int = 1000, seed: int = 0) -> Path:
    """An exported dataset (manifest + Parquet) whose label depends on its features."""
    rng = np.random.default_rng(seed)
    amount = rng.exponential(50, rows)
    country = rng.choice(["FR", "DE", "US", "GB"], rows)
    risk = rng.normal(0, 1, rows)
    label = ((amount > 80) & (country == "US")) | (risk > 1.2)
    start = datetime(2024, 1, 1, tzinfo=UTC)
    table = pa.table(
        {
            "card_id": pa.array(np.arange(rows) % 97, pa.int64()),
            "event_timestamp": pa.array(
                [start + timedelta(minutes=i) for i in range(rows)], pa.timestamp("us", tz="UTC")
            ),
            "amount": amount,
            "country": country,
            "risk": risk,
            "label": label.astype(np.int64),
        }
    )
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "data-00000.parquet", row_group_size=row_group)
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "feature_service": "svc",
                "features": ["v:amount", "v:country", "v:risk"],
                "definition_hashes": {"v": "0"},
                "manifest_hash": "test",
                "files": [{"path": "data-00000.parquet", "rows": rows}],
            }
        )
    )
    return folder


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_each_step_trains_on_the_same_rows_whatever_the_world_size(tmp_path, world):
    """Step s's rows, over all ranks, are step s's rows of one process (in order), split evenly:
    every rank holds rows at every step; each epoch every row once, in a new order."""
    import torch

    from featurestore.training.dataset import ExportedDataset
    from featurestore.training.preprocessing import Preprocessor

    dataset = make_dataset(tmp_path / "ds", rows=2000, row_group=300)
    pre = Preprocessor.fit(pq.read_table(dataset / "data-00000.parquet"), ["amount", "risk"], ["country"])

    def parts(rank: int, ranks: int, epoch: int) -> list:
        data = ExportedDataset(dataset, pre, "label", 256, seed=5, rank=rank, world=ranks, unit_rows=128)
        data.epoch = epoch
        return list(data)

    for epoch in range(2):
        single = parts(0, 1, epoch)
        assert len(single) == 8 and sum(len(y) for _, _, y in single) == 2000  # ceil(2000 / 256) steps
        ranks = [parts(r, world, epoch) for r in range(world)]
        for step, whole in enumerate(single):
            sizes = [len(ranks[r][step][2]) for r in range(world)]
            assert min(sizes) > 0 and max(sizes) - min(sizes) <= 1
            assert torch.equal(torch.cat([ranks[r][step][0] for r in range(world)]), whole[0])
    assert not torch.equal(parts(0, 1, 0)[0][0], parts(0, 1, 1)[0][0])  # reshuffled each epoch


def _train(repo: Path, dataset: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    args = ("--batch-size", "128", *args) if "--batch-size" not in args else args
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "train",
            "--repo",
            str(repo),
            "--dataset",
            str(dataset),
            "--device",
            "cpu",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_id = out.stdout.split("run ", 1)[1].split(":", 1)[0]
    return {"run": repo / "data" / "runs" / run_id, "stdout": out.stdout}


@pytest.mark.parametrize(
    "world, group, resumed_world, resumed_group",
    [
        (2, 2, 1, 1),  # FSDP on 2 ranks, resumed on 1
        pytest.param(4, 2, 2, 2, marks=pytest.mark.slow),  # HSDP: 2 sync groups of 2 shards, resumed on one group
    ],
)
def test_sharded_run_checkpoints_and_resumes_on_another_world_size(
    tmp_path, world, group, resumed_world, resumed_group
):
    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds")
    first = _train(
        repo,
        dataset,
        "--epochs",
        "1",
        "--nproc-per-node",
        str(world),
        "--shard-group-size",
        str(group),
        "--entity-key",
        "card_id",
        "--entity-buckets",
        "20000",
        "--hold-parameters",  # gathered parameters kept from forward to backward
    )  # a table worth sharding
    run = first["run"]
    params = json.loads((run / "params.json").read_text())
    assert (
        params["layout"]["world_size"] == world
        and params["layout"]["shard_group_size"] == group
        and params["layout"]["backend"] == "gloo"
    )
    shards = [p.name for p in (run / "dcp").iterdir() if p.name.startswith("step-")]
    assert len(shards) == 1 and not any(p.suffix == ".tmp" for p in (run / "dcp").iterdir())
    assert len(list((run / "dcp" / shards[0]).glob("*.distcp"))) == world  # one shard file per rank
    losses = read_metrics(run, "train_loss")
    assert set(losses["writer"].to_pylist()) == {"rank0"}  # each step's global batch loss, logged once
    steps_first = read_metrics(run, writer="rank0")["step"].to_pylist()

    # resumed on another world size: the loss curve continues where it stopped
    _train(
        repo,
        dataset,
        "--epochs",
        "2",
        "--nproc-per-node",
        str(resumed_world),
        "--shard-group-size",
        str(resumed_group),
        "--resume",
        run.name,
        "--entity-key",
        "card_id",
        "--entity-buckets",
        "20000",
    )
    epochs = read_metrics(run, "epoch", writer="rank0")
    resumed = [step for step, epoch in zip(epochs["step"].to_pylist(), epochs["value"].to_pylist()) if epoch == 1]
    assert resumed and resumed[0] == max(steps_first) + 1
    resumes = json.loads((run / "params.json").read_text())["resumes"]
    assert resumes[-1]["layout"]["world_size"] == resumed_world  # the lineage names the world it resumed on
    final = json.loads((run / "final.json").read_text())
    assert final["epochs"] == 2 and final["val_auc"] > 0.75 and final["train_samples_per_s"] > 0
    assert len(final["peak_memory_mb"]) == resumed_world and min(final["peak_memory_mb"]) > 0

    # the run's full weights register and load like a single-process run's
    from featurestore.training.model_registry import ModelRegistry

    registry = ModelRegistry(tmp_path / "models", tmp_path / "ledger.json")
    loaded = registry.load("m", registry.register("m", run))
    assert loaded.card["training_layout"]["world_size"] == world  # lineage: the layout that trained it
    assert loaded.model.embeddings[-1].num_embeddings == 20001 and loaded.preprocessor.hashed == {"card_id": 20000}
    scores = loaded.predict({"amount": [10.0, None], "country": ["US", None], "risk": [0.1, 2.0], "card_id": [5, None]})
    assert scores.shape == (2,)


@pytest.mark.slow
def test_one_process_and_four_reach_the_same_metric(tmp_path):
    """The same recipe (global batch 512) on 1 process, on 4 as HSDP (2 sync groups x 2 shards),
    and on 4 as local SGD (parameters averaged every 4 steps)."""
    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=16000, row_group=2000)

    def auc(*args: str) -> float:
        return json.loads((_train(repo, dataset, "--epochs", "6", *args)["run"] / "final.json").read_text())["val_auc"]

    single = auc("--batch-size", "512")
    hsdp = auc("--batch-size", "512", "--nproc-per-node", "4", "--shard-group-size", "2")
    local_sgd = auc("--batch-size", "512", "--nproc-per-node", "4", "--shard-group-size", "2", "--sync-every", "4")
    assert abs(single - hsdp) < 0.02 and abs(single - local_sgd) < 0.03, (single, hsdp, local_sgd)


@pytest.mark.parametrize(
    "layout",
    [
        ("--nproc-per-node", "2", "--shard-group-size", "2"),  # FSDP over 2 ranks
        pytest.param(("--nproc-per-node", "4", "--shard-group-size", "2"), marks=pytest.mark.slow),  # HSDP 2 x 2
        pytest.param(("--nproc-per-node", "2", "--shard-group-size", "1"), marks=pytest.mark.slow),  # replicas
    ],
)
def test_more_processes_follow_the_same_loss_curve_and_reach_the_same_weights(tmp_path, layout):
    """The same data, seed and global batch on 1 process and on several: every step's loss and
    the final weights agree to float reduction order (they differed by up to 56 % of a tensor's
    largest value when whole row groups were dealt to ranks)."""
    import torch

    from featurestore.training.checkpoints import full_model

    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=2000, row_group=300)
    common = ("--epochs", "2", "--batch-size", "256", "--seed", "3")
    one, many = (_train(repo, dataset, *common, *extra)["run"] for extra in ((), layout))
    curves = [read_metrics(run, "train_loss").sort_by("step") for run in (one, many)]
    # 1,600 training rows (80 %) in global batches of 256: 7 steps an epoch
    assert curves[0]["step"].to_pylist() == curves[1]["step"].to_pylist() == list(range(1, 15))
    assert np.allclose(curves[0]["value"].to_numpy(), curves[1]["value"].to_numpy(), rtol=0, atol=1e-5)
    weights = [full_model(run).state_dict() for run in (one, many)]
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor, weights[1][name], rtol=0, atol=1e-5), name


@pytest.mark.slow
def test_a_rank_that_stops_answering_fails_the_run_within_the_timeout(tmp_path):
    """Rank 1 SIGSTOPped after the first checkpoint: the run fails within the collective timeout
    (it hung with no error before: gloo waits 30 minutes), rank 0 says what happened, and the
    checkpoint stays there to resume from."""
    import signal

    import psutil

    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=4000)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "featurestore.cli", "train", "--repo", str(repo), "--dataset", str(dataset)]
    command += ["--device", "cpu", "--epochs", "500", "--nproc-per-node", "2", "--collective-timeout", "10"]
    trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    stopped = None
    try:
        deadline = time.monotonic() + 240
        while not list((repo / "data" / "runs").glob("*/dcp/step-*[0-9]")):
            assert time.monotonic() < deadline and trainer.poll() is None, "no checkpoint was written"
            time.sleep(0.2)
        ranks = [
            p
            for p in psutil.Process(trainer.pid).children(recursive=True)
            if "featurestore.training.launch" in " ".join(p.cmdline())
        ]
        stopped = next(p for p in ranks if p.environ().get("RANK") == "1")
        stopped.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        _, err = trainer.communicate(timeout=180)
        took = time.monotonic() - started
        assert trainer.returncode != 0
        assert "rank 0 of 2: a collective with the other ranks did not complete within 10 s" in err, err[-3000:]
        assert took < 120, took  # the timeout, then torchrun stopping the other rank
        assert list((repo / "data" / "runs").glob("*/dcp/step-*[0-9]"))  # the checkpoint is intact
    finally:
        if stopped is not None and stopped.is_running():
            stopped.kill()
        if trainer.poll() is None:
            trainer.kill()


@pytest.mark.slow
def test_warm_up_with_gradient_sync_then_local_steps(tmp_path):
    """Local SGD (2 sync groups of 2, parameters averaged every 4 steps) after 5 warm-up steps
    of gradient averaging: the first 5 steps are HSDP's, to float reduction order; afterwards
    the groups step on their own and the curves part."""
    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=2000, row_group=300)
    common = ("--epochs", "2", "--batch-size", "256", "--seed", "3", "--nproc-per-node", "4", "--shard-group-size", "2")
    hsdp = _train(repo, dataset, *common)["run"]
    local = _train(repo, dataset, *common, "--sync-every", "4", "--sync-warmup-steps", "5")["run"]
    curves = [read_metrics(run, "train_loss").sort_by("step")["value"].to_numpy() for run in (hsdp, local)]
    assert np.allclose(curves[0][:5], curves[1][:5], rtol=0, atol=1e-5)
    assert np.abs(curves[0][5:] - curves[1][5:]).max() > 1e-4


@pytest.mark.slow
def test_background_checkpoints_resume_bit_identical_on_two_ranks(tmp_path):
    """Two ranks, checkpoints written in the background: stopped after one epoch and resumed for
    a second, the run ends with exactly the weights of one trained straight through."""
    import torch

    from featurestore.training.checkpoints import full_model

    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=2000, row_group=300)
    common = ("--batch-size", "256", "--nproc-per-node", "2", "--shard-group-size", "2")
    straight = _train(repo, dataset, "--epochs", "2", *common)["run"]
    stopped = _train(repo, dataset, "--epochs", "1", *common)["run"]
    assert (stopped / "dcp" / "latest").exists() and not list((stopped / "dcp").glob("*.tmp"))
    _train(repo, dataset, "--epochs", "2", *common, "--resume", stopped.name)
    weights = [full_model(run).state_dict() for run in (straight, stopped)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_outer_step_is_diloco_nesterov_and_plain_averaging_at_lr_1():
    """``OuterStep`` against DiLoCo's update written out by hand, over three syncs (the momentum
    carries across them); at lr 1 without momentum it is the plain average; a second sync at the
    same step, or one during warm-up, moves nothing; and without --sync-every it is refused."""
    import torch

    from featurestore.errors import FeatureStoreError
    from featurestore.training.distributed import Layout, OuterStep

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    outer = OuterStep(model, Layout(sync_every=2), "nesterov", lr=0.7, momentum=0.9, warmup_steps=2)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in anchor.items()}
    outer.after_step(2)  # the warm-up's last step anchors the first outer step
    for step in (4, 6, 8):
        with torch.no_grad():
            for p in model.parameters():  # local steps (one sync group: its average is itself)
                p.add_(torch.randn_like(p))
        averaged = {n: p.detach().clone() for n, p in model.named_parameters()}
        outer.after_step(step)
        outer.sync(step)  # (again at the same step: nothing)
        for name, param in model.named_parameters():
            delta = anchor[name] - averaged[name]
            momentum[name] = 0.9 * momentum[name] + delta
            anchor[name] = anchor[name] - 0.7 * (delta + 0.9 * momentum[name])
            assert torch.allclose(param, anchor[name], rtol=0, atol=1e-6), (step, name)
            assert torch.allclose(outer.state_dict()[name], momentum[name], rtol=0, atol=1e-6)
    plain = OuterStep(model, Layout(sync_every=2), "nesterov", lr=1.0, momentum=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    moved = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain.sync(2)
    assert all(torch.allclose(p, moved[n], rtol=0, atol=1e-6) for n, p in model.named_parameters())
    assert not all(torch.equal(moved[n], before[n]) for n in moved)
    warming = OuterStep(model, Layout(sync_every=2), "nesterov", warmup_steps=10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    warming.sync(4)  # (an epoch's end during warm-up)
    assert all(torch.equal(p, held[n]) for n, p in model.named_parameters())
    with pytest.raises(FeatureStoreError, match="--sync-every"):
        OuterStep(model, Layout(sync_every=0), "nesterov")


@pytest.mark.slow
def test_local_sgd_resumes_bit_identical_with_either_outer_step(tmp_path):
    """Two sync groups of one rank, parameters synced every 3 steps, by plain averaging or by
    DiLoCo's Nesterov outer step: stopped after one epoch and resumed, each run ends with exactly
    the weights of one trained straight through (the outer momentum is checkpointed, and the
    groups' own optimizer states are averaged into the checkpoint: before, one group's Adam state
    was kept for both and the resumed weights differed by up to 8.6); the two outer steps part."""
    import torch

    from featurestore.training.checkpoints import full_model

    repo = write_repo(tmp_path / "repo", "")
    dataset = make_dataset(tmp_path / "ds", rows=2000, row_group=300)
    ends = []
    for outer in ("average", "nesterov"):
        common = ("--batch-size", "128", "--nproc-per-node", "2", "--sync-every", "3", "--outer-optimizer", outer)
        straight = _train(repo, dataset, "--epochs", "2", *common)["run"]
        stopped = _train(repo, dataset, "--epochs", "1", *common)["run"]
        _train(repo, dataset, "--epochs", "2", *common, "--resume", stopped.name)
        weights = [full_model(run).state_dict() for run in (straight, stopped)]
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), outer
        ends.append(weights[0])
    assert max((ends[0][k] - ends[1][k]).abs().max().item() for k in ends[0]) > 1e-4
