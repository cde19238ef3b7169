"""Training checkpoints: sharded for resuming, full for the model registry.

``run_dir/dcp/step-<N>/`` holds one ``torch.distributed.checkpoint`` per epoch: every rank
writes its own shards of the weights and optimizer state, in the background while training
goes on (``Checkpointer``). It is written under a ``.tmp`` name and renamed by rank 0 once every
rank has finished, then named in ``dcp/latest``: a crash mid-save leaves the previous
checkpoint intact. DCP reshards on load, so a run saved by 2
ranks resumes on 4, or on 1. Rank 0 also writes ``checkpoint.pt``: the full weights, model
config and preprocessing (plain tensors, read with ``weights_only=True``), which the model
registry registers and the validation pass scores.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
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


class Checkpointer:
    """One run's checkpoints. Sharded ones of a distributed run are written in the background
    when ``asynchronous`` (``dcp.async_save``: the state is copied to memory, training goes on
    while the shards are written, over a process group of their own so their collectives never
    meet training's); at most one save is in flight, and a save is named in ``dcp/latest`` only
    once every rank's shards are written (at the next save, or at ``finish``). One process
    writes in line: torch's writer thread would warn, at any moment, that it is one process."""

    def __init__(self, run_dir: Path, layout: distributed.Layout, asynchronous: bool = True, timeout_s: float = 300.0):
        self.folder = Path(run_dir) / "dcp"
        self.run_dir, self.layout = Path(run_dir), layout
        self.asynchronous = asynchronous and layout.distributed
        self._pending: tuple[Future, str, int, int] | None = None
        self._group = None
        if asynchronous and layout.distributed:
            import torch.distributed as dist

            # the training group's bound on a collective, not gloo's 30-minute default: a rank that
            # stops answering fails the run here too
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        pre: Preprocessor,
        *,
        epoch: int,
        step: int,
        outer: dict[str, torch.Tensor] | None = None,
    ) -> TabularMLP | None:
        """Checkpoint this epoch (a collective: every rank calls it), with the outer optimizer's
        state if any; rank 0 gets the full model back."""
        self.finish()  # the previous save lands first
        name = f"step-{step:09d}"
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        if outer:
            state["outer"] = outer
        with _one_process_is_fine():
            if self.asynchronous:
                future = dcp.async_save(
                    state, checkpoint_id=str(self.folder / f"{name}.tmp"), process_group=self._group
                )
                self._pending = (cast(Future, future), name, epoch, step)
            else:
                dcp.save(state, checkpoint_id=str(self.folder / f"{name}.tmp"))
                self._pending = (_done(), name, epoch, step)
        if not self.asynchronous:
            self.finish()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.layout.is_main:
            return None
        config = cast(dict, model.config)  # fully_shard keeps the module's attributes
        tmp = self.run_dir / "checkpoint.pt.tmp"
        torch.save(
            {"model": full, "model_config": config, "preprocessor": pre.to_dict(), "epoch": epoch, "step": step}, tmp
        )
        tmp.replace(self.run_dir / "checkpoint.pt")
        return from_saved(config, full)

    def finish(self) -> None:
        """Wait for the save in flight, then name it (a collective: every rank calls it)."""
        if self._pending is None:
            return
        future, name, epoch, step = self._pending
        self._pending = None
        future.result()
        distributed.barrier(self.layout)  # every rank's shards are written
        if not self.layout.is_main:
            return
        (self.folder / f"{name}.tmp").rename(self.folder / name)
        atomic_write(self.folder / "latest", f"{name}\n{epoch}\n{step}\n".encode())
        for old in sorted(p for p in self.folder.iterdir() if p.name.startswith("step-") and p.name != name)[
            : -(KEEP - 1) or None
        ]:
            shutil.rmtree(old, ignore_errors=True)


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def load(
    run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, outer: dict[str, torch.Tensor] | None = None
) -> dict[str, Any] | None:
    """Restore the newest complete sharded checkpoint into ``model``, ``optimizer`` and the outer
    optimizer's state, in place (any world size); returns ``{"epoch", "step"}``, or None when the
    run has none."""
    latest = Path(run_dir) / "dcp" / "latest"
    if not latest.exists():
        return None
    name, epoch, step = latest.read_text().split()
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, **({"outer": outer} if outer else {})}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(latest.parent / name))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"epoch": int(epoch), "step": int(step)}


def full_model(run_dir: Path) -> TabularMLP:
    """The full model of the newest checkpoint, on CPU, ready to score."""
    saved = torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)
    return from_saved(saved["model_config"], saved["model"])
