"""Training checkpoints: sharded for resuming, full for the model registry.

``run_dir/dcp/step-<N>/`` holds one ``torch.distributed.checkpoint`` per epoch: every rank
writes its own shards of the weights and optimizer state. It is written under a ``.tmp`` name
and renamed by rank 0 once every rank has finished, then named in ``dcp/latest``: a crash
mid-save leaves the previous checkpoint intact. DCP reshards on load, so a run saved by 2
ranks resumes on 4, or on 1. Rank 0 also writes ``checkpoint.pt``: the full weights, model
config and preprocessing (plain tensors, read with ``weights_only=True``), which the model
registry registers and the validation pass scores.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from featurestore.files import atomic_write
from featurestore.training import distributed
from featurestore.training.model import TabularMLP, from_saved
from featurestore.training.preprocessing import Preprocessor

KEEP = 2  # sharded checkpoints kept per run (the newest)


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """torch warns on every single-process checkpoint that it assumes a single process: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pre: Preprocessor,
    layout: distributed.Layout,
    *,
    epoch: int,
    step: int,
) -> TabularMLP | None:
    """Write this epoch's checkpoints (a collective: every rank calls it); rank 0 gets the full model back."""
    folder = Path(run_dir) / "dcp"
    name = f"step-{step:09d}"
    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_is_fine():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder / f"{name}.tmp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    distributed.barrier(layout)
    if not layout.is_main:
        return None
    (folder / f"{name}.tmp").rename(folder / name)
    atomic_write(folder / "latest", f"{name}\n{epoch}\n{step}\n".encode())
    for old in sorted(p for p in folder.iterdir() if p.name.startswith("step-") and p.name != name)[
        : -(KEEP - 1) or None
    ]:
        shutil.rmtree(old, ignore_errors=True)
    config = cast(dict, model.config)  # fully_shard keeps the module's attributes
    tmp = Path(run_dir) / "checkpoint.pt.tmp"
    torch.save(
        {"model": full, "model_config": config, "preprocessor": pre.to_dict(), "epoch": epoch, "step": step}, tmp
    )
    tmp.replace(Path(run_dir) / "checkpoint.pt")
    return from_saved(config, full)


def load(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore the newest complete sharded checkpoint into ``model`` and ``optimizer`` (any world size);
    returns ``{"epoch", "step"}``, or None when the run has none."""
    latest = Path(run_dir) / "dcp" / "latest"
    if not latest.exists():
        return None
    name, epoch, step = latest.read_text().split()
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(latest.parent / name))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"epoch": int(epoch), "step": int(step)}


def full_model(run_dir: Path) -> TabularMLP:
    """The full model of the newest checkpoint, on CPU, ready to score."""
    saved = torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)
    return from_saved(saved["model_config"], saved["model"])
