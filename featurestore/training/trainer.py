"""The training recipe: exported dataset → preprocessing → MLP → tracked run with checkpoints.

Read top to bottom: config, data split, preprocessing fit, the loop, evaluation, tracking.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from rich.console import Console
from rich.progress import Progress
from torch.utils.data import DataLoader

from featurestore.registry.store import atomic_write
from featurestore.training.dataset import ExportedDataset, load_manifest
from featurestore.training.metrics import rmse, roc_auc
from featurestore.training.model import TabularMLP, score
from featurestore.training.preprocessing import Preprocessor


@dataclass
class TrainConfig:
    dataset: str
    label: str = "label"
    task: Literal["classification", "regression"] = "classification"
    request_inputs: list[str] = field(default_factory=list)   # columns sent with each request (e.g. amount)
    epochs: int = 4
    batch_size: int = 512
    learning_rate: float = 2e-3
    hidden: list[int] = field(default_factory=lambda: [64, 32])
    embedding_dim: int = 8
    validation_fraction: float = 0.2
    seed: int = 0
    num_workers: int = 0


def code_version() -> str:
    from featurestore import __version__

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        if sha.returncode == 0:
            return f"{__version__}+{sha.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def input_columns(config: TrainConfig) -> tuple[list[str], list[str]]:
    """(numeric, categorical) model inputs: the service's features plus request-time inputs."""
    manifest = load_manifest(Path(config.dataset))
    schema = pq.read_schema(Path(config.dataset) / manifest["files"][0]["path"])
    names = [ref.split(":")[1] for ref in manifest["features"]] + list(config.request_inputs)
    numeric = [n for n in names if not pa.types.is_string(schema.field(n).type)]
    categorical = [n for n in names if pa.types.is_string(schema.field(n).type)]
    return numeric, categorical


def split_time(dataset_dir: Path, validation_fraction: float) -> int:
    """Event time (µs) splitting training from validation: validation is the latest rows."""
    ts = pc.cast(pq.read_table(dataset_dir / load_manifest(dataset_dir)["files"][0]["path"], columns=["event_timestamp"])["event_timestamp"], pa.int64())
    return int(np.quantile(ts.to_numpy(), 1 - validation_fraction))


def train(config: TrainConfig, runs_dir: Path, resume: str | None = None, progress: bool = True) -> Path:
    """Run (or resume) training; return the run folder."""
    torch.manual_seed(config.seed)
    run_dir = Path(runs_dir) / (resume or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    run_dir.mkdir(parents=True, exist_ok=True)
    dataset_dir = Path(config.dataset)
    manifest = load_manifest(dataset_dir)
    split = split_time(dataset_dir, config.validation_fraction)
    numeric, categorical = input_columns(config)

    checkpoint_path = run_dir / "checkpoint.pt"
    if resume and checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=True)
        pre = Preprocessor.from_dict(state["preprocessor"])
    else:
        state = None
        train_rows = pq.read_table(dataset_dir / manifest["files"][0]["path"], columns=numeric + categorical + ["event_timestamp"])
        train_rows = train_rows.filter(pc.less(pc.cast(train_rows["event_timestamp"], pa.int64()), split))
        pre = Preprocessor.fit(train_rows, numeric, categorical)
        params = {
            "config": asdict(config), "dataset_manifest_hash": manifest["manifest_hash"],
            "definition_hashes": manifest["definition_hashes"], "feature_service": manifest["feature_service"],
            "features": manifest["features"], "code_version": code_version(), "validation_split_us": split,
        }
        atomic_write(run_dir / "params.json", json.dumps(params, indent=2).encode())

    model = TabularMLP(pre.numeric_width, pre.vocab_sizes, config.hidden, config.embedding_dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    loss_fn = torch.nn.BCEWithLogitsLoss() if config.task == "classification" else torch.nn.MSELoss()
    start_epoch, step = 0, 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"] + 1, state["step"]

    train_data = ExportedDataset(dataset_dir, pre, config.label, config.batch_size, (None, split), seed=config.seed)
    val_data = ExportedDataset(dataset_dir, pre, config.label, 8192, (split, None), shuffle_buffer_batches=1)
    loader = DataLoader(train_data, batch_size=None, num_workers=config.num_workers)
    with open(run_dir / "metrics.jsonl", "a") as log, Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task("training", total=config.epochs, completed=start_epoch)
        for epoch in range(start_epoch, config.epochs):
            train_data.epoch = epoch
            model.train()
            for x_num, x_cat, y in loader:
                loss = loss_fn(model(x_num, x_cat), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                log.write(json.dumps({"step": step, "epoch": epoch, "train_loss": loss.item()}) + "\n")
            metrics = evaluate(model, val_data, config.task)
            log.write(json.dumps({"step": step, "epoch": epoch, **{f"val_{k}": v for k, v in metrics.items()}}) + "\n")
            log.flush()
            save_checkpoint(checkpoint_path, model, optimizer, pre, epoch, step)
            bar.update(task, advance=1, description=f"epoch {epoch + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    final = {"step": step, "epochs": config.epochs, **{f"val_{k}": v for k, v in evaluate(model, val_data, config.task).items()}}
    atomic_write(run_dir / "final.json", json.dumps(final, indent=2).encode())
    plot_losses(run_dir)
    return run_dir


def evaluate(model: TabularMLP, data: ExportedDataset, task: str) -> dict[str, float]:
    model.eval()
    labels, scores = [], []
    for x_num, x_cat, y in data:
        s = score(model, x_num, x_cat, task)
        labels.append(y.numpy())
        scores.append(s.numpy())
    if not labels:
        return {}
    y, s = np.concatenate(labels), np.concatenate(scores)
    if task == "classification":
        eps = 1e-7
        loss = float(-np.mean(y * np.log(s + eps) + (1 - y) * np.log(1 - s + eps)))
        return {"loss": loss, "auc": roc_auc(y, s)}
    return {"loss": float(np.mean((y - s) ** 2)), "rmse": rmse(y, s)}


def save_checkpoint(path: Path, model, optimizer, pre: Preprocessor, epoch: int, step: int) -> None:
    """Atomic: a crash leaves the previous checkpoint, never half of one."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "model_config": model.config, "optimizer": optimizer.state_dict(),
                "preprocessor": pre.to_dict(), "epoch": epoch, "step": step}, tmp)
    tmp.replace(path)


def plot_losses(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss", alpha=0.7)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)
