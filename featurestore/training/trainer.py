"""The training recipe: exported dataset → preprocessing → MLP → tracked run with checkpoints.

Read top to bottom: config, data split, preprocessing fit, the loop, evaluation, tracking.
One process, or many under ``torchrun`` (see ``training.distributed``): every rank fits the
same preprocessing and starts from the same weights, reads its own share of the rows, and
takes the same number of steps (a rank out of rows takes zero-weight steps, so collectives
stay in step). Checkpoints are sharded (``torch.distributed.checkpoint``) and resume on any
world size; rank 0 also writes the full weights the model registry takes.
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
from torch.utils.data import DataLoader

from featurestore.errors import FeatureStoreError
from featurestore.progress import progress_bar
from featurestore.tracking.runs import Run, curve
from featurestore.training import checkpoints, distributed
from featurestore.training.dataset import Batch, ExportedDataset, load_manifest, share, time_column
from featurestore.training.metrics import rmse, roc_auc
from featurestore.training.model import TabularMLP, score
from featurestore.training.preprocessing import Preprocessor

Task = Literal["classification", "regression"]


@dataclass
class TrainConfig:
    dataset: str
    label: str = "label"
    task: Task = "classification"
    request_inputs: list[str] = field(default_factory=list)  # columns sent with each request (e.g. amount)
    entity_keys: list[str] = field(default_factory=list)  # keys learned as hashed embedding tables (e.g. card_id)
    entity_buckets: int = 65_536  # rows per entity-key table
    epochs: int = 4
    batch_size: int = 512
    learning_rate: float = 2e-3
    hidden: list[int] = field(default_factory=lambda: [64, 32])
    embedding_dim: int = 8
    validation_fraction: float = 0.2
    seed: int = 0
    num_workers: int = 0
    device: str = "auto"  # auto (CUDA when present), cpu, cuda
    bf16: bool = False  # bfloat16 autocast on CUDA
    shard_group_size: int = 1  # ranks sharing one sharded replica (FSDP); world = sync groups x this
    sync_every: int = 0  # 0: replicas in step every step (HSDP); H: average parameters every H steps
    sync_warmup_steps: int = 0  # with sync_every: the first this-many steps average gradients every step (as HSDP)
    outer_optimizer: str = "average"  # with sync_every, at each sync: average, or nesterov (DiLoCo's outer step)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    async_checkpoints: bool = True  # sharded checkpoints written while training goes on
    hold_parameters: bool = False  # FSDP: keep gathered parameters from forward to backward (vs release)
    collective_timeout_s: float = 300.0  # a rank that does not join a collective within this fails the run


def code_version() -> str:
    from featurestore import __version__

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
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
    manifest = load_manifest(dataset_dir)
    column = time_column(manifest)
    ts = pc.cast(pq.read_table(dataset_dir / manifest["files"][0]["path"], columns=[column])[column], pa.int64())
    return int(np.quantile(ts.to_numpy(), 1 - validation_fraction))


def train(
    config: TrainConfig, runs_dir: Path, resume: str | None = None, progress: bool = True, run_id: str | None = None
) -> Path:
    """Run (or resume) training; return the run folder. Under torchrun every rank calls this with the same ``run_id``."""
    layout = distributed.setup(config.device, config.shard_group_size, config.sync_every, config.collective_timeout_s)
    try:
        if layout.distributed and not (run_id or resume):
            raise FeatureStoreError("a distributed run needs one run id for every rank (featurestore train passes it)")
        return _train(config, layout, Path(runs_dir) / (resume or run_id or new_run_id()), bool(resume), progress)
    except Exception as exc:
        failed = distributed.collective_failure(exc, layout, config.collective_timeout_s)
        if failed is None:
            raise
        raise failed from exc
    finally:
        distributed.teardown(layout)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _train(config: TrainConfig, layout: distributed.Layout, run_dir: Path, resume: bool, progress: bool) -> Path:
    torch.manual_seed(config.seed)  # every rank builds the same initial weights
    run_dir.mkdir(parents=True, exist_ok=True)
    dataset_dir = Path(config.dataset)
    manifest = load_manifest(dataset_dir)
    split = split_time(dataset_dir, config.validation_fraction)
    numeric, categorical = input_columns(config)
    missing = [
        k for k in config.entity_keys if k not in pq.read_schema(dataset_dir / manifest["files"][0]["path"]).names
    ]
    if missing:
        raise FeatureStoreError(f"entity key(s) {missing} are not columns of the dataset {dataset_dir}")
    when = time_column(manifest)
    train_rows = pq.read_table(dataset_dir / manifest["files"][0]["path"], columns=numeric + categorical + [when])
    train_rows = train_rows.filter(pc.less(pc.cast(train_rows[when], pa.int64()), split))
    pre = Preprocessor.fit(
        train_rows, numeric, categorical, hashed={k: config.entity_buckets for k in config.entity_keys}
    )
    # rank 0 records the metrics (each step's loss is its global batch's, the same on any world size)
    run = Run(run_dir, writer=f"rank{layout.rank}")
    if resume:
        _check_resumable(run_dir, config, manifest["manifest_hash"])
    if layout.is_main:
        run.log_params(
            {
                "config": asdict(config),
                "dataset_path": str(dataset_dir.resolve()),
                "dataset_manifest_hash": manifest["manifest_hash"],
                "definition_hashes": manifest["definition_hashes"],
                "feature_service": manifest["feature_service"],
                "features": manifest["features"],
                "code_version": code_version(),
                "validation_split_us": split,
                "layout": layout.describe(),
            }
        )
        run.log_artifact(dataset_dir / "manifest.json", "dataset_manifest.json")

    model = distributed.shard_model(
        TabularMLP(pre.numeric_width, pre.vocab_sizes, config.hidden, config.embedding_dim),
        layout,
        config.hold_parameters,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
    outer = distributed.OuterStep(
        model, layout, config.outer_optimizer, config.outer_lr, config.outer_momentum, config.sync_warmup_steps
    )
    loss_fn = (
        torch.nn.BCEWithLogitsLoss(reduction="none")
        if config.task == "classification"
        else torch.nn.MSELoss(reduction="none")
    )
    start_epoch, step = 0, 0
    if resume:
        saved = checkpoints.load(run_dir, model, optimizer, outer.state_dict())
        if saved is not None:
            start_epoch, step = saved["epoch"] + 1, saved["step"]
            outer.restart(step)  # (a checkpoint follows a sync)
        if layout.is_main:
            run.record_resume({"at_step": step, "epochs": config.epochs, "layout": layout.describe()})

    train_data = ExportedDataset(
        dataset_dir,
        pre,
        config.label,
        config.batch_size,
        (None, split),
        seed=config.seed,
        rank=layout.rank,
        world=layout.world,
    )
    val_data = ExportedDataset(dataset_dir, pre, config.label, 8192, (split, None), shuffle_buffer_batches=1)
    loader = DataLoader(train_data, batch_size=None, num_workers=config.num_workers)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=config.bf16 and layout.device.type == "cuda")
    idle = _idle_batch(pre)
    checkpointer = checkpoints.Checkpointer(run_dir, layout, config.async_checkpoints, config.collective_timeout_s)
    started, rows = time.perf_counter(), 0
    # the gradient of every step is the mean over its global batch, whatever the world size: each
    # rank's loss is its rows' sum scaled by the group its gradients are averaged over (FSDP
    # divides by that group's size) over the rows that group trained on
    with progress_bar("steps", progress and layout.is_main) as bar:
        task = bar.add_task("training", total=config.epochs, completed=start_epoch)
        for epoch in range(start_epoch, config.epochs):
            train_data.epoch = epoch
            steps = train_data.steps()
            batches = iter(loader)
            model.train()
            in_epoch = bar.add_task(f"epoch {epoch + 1}/{config.epochs}", total=steps)
            for in_step in range(steps):
                bar.advance(in_epoch)
                batch = next(batches)
                warming = layout.sync_every > 0 and step < config.sync_warmup_steps
                averaged_over = layout.world if layout.sync_every == 0 or warming else layout.shard
                first_rank = layout.rank - layout.rank % averaged_over
                n = train_data.step_rows(in_step)
                group_rows = (
                    share(n, layout.world, first_rank + averaged_over - 1)[1] - share(n, layout.world, first_rank)[0]
                )
                held = len(batch[2]) > 0
                x_num, x_cat, y = [t.to(layout.device) for t in (batch if held else idle)]
                with autocast:
                    loss_sum = loss_fn(model(x_num, x_cat).float(), y).sum() * (1.0 if held else 0.0)
                loss = loss_sum * (averaged_over / max(group_rows, 1))
                optimizer.zero_grad()
                loss.backward()
                if warming:
                    distributed.average_gradients_across_sync_groups(model, layout)
                optimizer.step()
                step += 1
                rows += len(y) if held else 0
                outer.after_step(step)
                batch_loss = distributed.sum_across_ranks(loss_sum.item(), layout) / n  # the global batch's mean
                if layout.is_main:
                    run.log(step, train_loss=batch_loss, epoch=epoch)
            bar.remove_task(in_epoch)
            outer.sync(step)  # replicas agree before they are evaluated and saved
            distributed.average_optimizer_across_sync_groups(optimizer, layout)
            full = checkpointer.save(model, optimizer, pre, epoch=epoch, step=step, outer=outer.state_dict())
            if full is not None:  # the main rank's full model
                metrics = evaluate(full, val_data, config.task)
                run.log(step, **{f"val_{k}": v for k, v in metrics.items()})
                bar.update(
                    task,
                    advance=1,
                    description=f"epoch {epoch + 1}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
                )
            run.metrics.flush()  # readable while the run goes on

    checkpointer.finish()
    rate = distributed.sum_across_ranks(rows, layout) / max(time.perf_counter() - started, 1e-9)
    peaks = distributed.peak_memory_mb(layout)
    if layout.is_main:
        final = {
            "step": step,
            "epochs": config.epochs,
            "train_samples_per_s": round(rate, 1),
            "peak_memory_mb": peaks,  # per rank
            **{f"val_{k}": v for k, v in evaluate(checkpoints.full_model(run_dir), val_data, config.task).items()},
        }
        run.finish(final)
        plot_losses(run_dir)
        run.log_artifact(run_dir / "loss.png")
        run.log_artifact(run_dir / "checkpoint.pt", "weights.pt")
    else:
        run.close()
    distributed.barrier(layout)
    return run_dir


# what a resumed run must keep: another dataset or recipe would make one run of two
RESUME_KEEPS = (
    "label",
    "task",
    "request_inputs",
    "entity_keys",
    "entity_buckets",
    "batch_size",
    "learning_rate",
    "hidden",
    "embedding_dim",
    "validation_fraction",
    "seed",
    "outer_optimizer",
    "outer_lr",
    "outer_momentum",
)


def _check_resumable(run_dir: Path, config: TrainConfig, manifest_hash: str) -> None:
    """Refuse to resume a run on another dataset or recipe (the layout, epochs and device may change)."""
    params_file = run_dir / "params.json"
    if not params_file.exists():
        return
    started = json.loads(params_file.read_text())
    if started.get("dataset_manifest_hash") not in (None, manifest_hash):
        raise FeatureStoreError(
            f"run {run_dir.name} trained on dataset {started['dataset_manifest_hash'][:12]}, this one is "
            f"{manifest_hash[:12]}: a resumed run continues on its own data; start a new run for this one"
        )
    was = started.get("config", {})
    changed = [k for k in RESUME_KEEPS if k in was and was[k] != asdict(config)[k]]
    if changed:
        raise FeatureStoreError(
            f"run {run_dir.name} cannot resume with another {', '.join(changed)} "
            f"(it trained with {', '.join(f'{k}={was[k]!r}' for k in changed)}); start a new run, or resume with those"
        )


def _idle_batch(pre: Preprocessor) -> Batch:
    """One all-zero row: what a rank out of rows trains on, with weight 0."""
    return (torch.zeros(1, pre.numeric_width), torch.zeros(1, len(pre.vocab_sizes), dtype=torch.long), torch.zeros(1))


def evaluate(model: TabularMLP, data: ExportedDataset, task: str) -> dict[str, float]:
    model.eval()
    batches = [(y.numpy(), score(model, x_num, x_cat, task).numpy()) for x_num, x_cat, y in data]
    if not batches:
        return {}
    truth, predicted = np.concatenate([t for t, _ in batches]), np.concatenate([p for _, p in batches])
    if task == "classification":
        eps = 1e-7
        loss = float(-np.mean(truth * np.log(predicted + eps) + (1 - truth) * np.log(1 - predicted + eps)))
        return {"loss": loss, "auc": roc_auc(truth, predicted)}
    return {"loss": float(np.mean((truth - predicted) ** 2)), "rmse": rmse(truth, predicted)}


def plot_losses(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    train, val = curve(run_dir, "train_loss", 2000), curve(run_dir, "val_loss")
    if train["steps"]:
        ax.plot(train["steps"], train["values"], label="train loss", alpha=0.7)
    if val["steps"]:
        ax.plot(val["steps"], val["values"], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)
