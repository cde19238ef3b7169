"""Where training runs: device choice, process groups, and the ``sync × shard`` device mesh.

Ranks form ``sync`` groups of ``shard`` ranks each (world = sync × shard). Inside a shard group
the model's parameters, gradients and optimizer state are sharded (FSDP2 ``fully_shard``).
Across shard groups the replicas are kept in step either every step (``sync_every=0``: HSDP,
gradients reduced over the whole world) or every ``sync_every`` steps by averaging parameters
(local SGD: shard groups train independently in between, cheap on slow links), plainly or by
DiLoCo's outer step (``OuterStep``).

Started by ``torchrun`` (or ``featurestore train --nproc-per-node``, which wraps it); without
it, training is one plain process with no process group at all. gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from featurestore.errors import FeatureStoreError

DEVICES = ("auto", "cpu", "cuda")


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """``auto``: CUDA when present, else CPU. ``cuda`` without a GPU is an error, not a silent CPU run."""
    if choice not in DEVICES:
        raise FeatureStoreError(f"device must be one of {list(DEVICES)}, not {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise FeatureStoreError("--device cuda, but torch sees no CUDA device; use --device cpu or auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Layout:
    """This process's place in the run."""

    rank: int = 0
    world: int = 1
    shard: int = 1  # ranks per shard group
    sync_every: int = 0  # 0: HSDP (every step); H: average parameters every H steps
    device: torch.device = torch.device("cpu")
    mesh: Any = None  # DeviceMesh ("sync", "shard") when distributed

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "shard_group_size": self.shard,
            "sync_groups": self.world // self.shard,
            "sync": "every step (HSDP)" if self.sync_every == 0 else f"parameter average every {self.sync_every} steps",
            "device": self.device.type,
            "backend": dist.get_backend() if self.distributed else None,
        }


def setup(device: str, shard: int, sync_every: int, timeout_s: float = 300.0) -> Layout:
    """Join the process group torchrun described in the environment (if any) and build the mesh.
    A collective that a rank does not join within ``timeout_s`` fails on the others (gloo's and
    NCCL's defaults wait 30 and 10 minutes): see ``collective_failure``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Layout(device=pick_device(device), sync_every=sync_every)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    placed = pick_device(device, local_rank)
    if world % shard:
        raise FeatureStoreError(f"world size {world} is not a multiple of the shard group size {shard}")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if placed.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(placed.type, (world // shard, shard), mesh_dim_names=("sync", "shard"))
    return Layout(dist.get_rank(), world, shard, sync_every, placed, mesh)


def shard_model(model: nn.Module, layout: Layout, hold_parameters: bool = False) -> nn.Module:
    """Shard ``model`` over its shard group (and replicate it over sync groups for HSDP).
    Each unit's gathered parameters are released after its forward and gathered again for its
    backward (less memory, more communication), or with ``hold_parameters`` kept until then."""
    model.to(layout.device)
    if not layout.distributed:
        return model
    from torch.distributed.fsdp import fully_shard

    mesh = layout.mesh if layout.sync_every == 0 else layout.mesh["shard"]
    for module in model.modules():  # each embedding table and layer is its own unit: gathered only when used
        if isinstance(module, (nn.Embedding, nn.Linear)):
            fully_shard(module, mesh=mesh, reshard_after_forward=not hold_parameters)
    fully_shard(model, mesh=mesh, reshard_after_forward=not hold_parameters)
    return model


@torch.no_grad()
def average_across_sync_groups(model: nn.Module, layout: Layout) -> None:
    """Local SGD's outer step: each shard's parameters averaged with the same shard of every other
    sync group (the shards line up: every group shards the same way)."""
    if not layout.distributed or layout.sync_every == 0 or layout.world == layout.shard:
        return
    group = layout.mesh["sync"].get_group()
    groups = layout.world // layout.shard
    for param in model.parameters():
        local = _local(param)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG
        local.div_(groups)


OuterOptimizer = Literal["average", "nesterov"]
OUTER_OPTIMIZERS = typing.get_args(OuterOptimizer)


class OuterStep:
    """What local SGD does at each parameter sync. ``average``: the sync groups' parameters are
    averaged. ``nesterov`` (DiLoCo's outer optimizer): the averaged parameters' move since the
    last sync is an outer gradient ``delta = anchor - average``, applied to the anchor (the
    parameters at the last sync) by SGD with Nesterov momentum::

        m = momentum * m + delta;  anchor -= lr * (delta + momentum * m);  parameters = anchor

    (DiLoCo used lr 0.7, momentum 0.9; lr 1 without momentum is the plain average.) The anchor
    and momentum are shaped like the parameters (sharded alike); the momentum is checkpointed."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        kind: str = "average",
        lr: float = 0.7,
        momentum: float = 0.9,
        warmup_steps: int = 0,
    ):
        if kind not in OUTER_OPTIMIZERS:
            raise FeatureStoreError(f"outer optimizer must be one of {list(OUTER_OPTIMIZERS)}, not {kind!r}")
        if kind != "average" and layout.sync_every == 0:
            raise FeatureStoreError(
                f"the {kind} outer optimizer acts at parameter syncs: give --sync-every H (local SGD) with it"
            )
        self.model, self.layout, self.kind, self.lr, self.beta = model, layout, kind, lr, momentum
        self.warmup_steps = warmup_steps
        self.synced_at = -1  # the step of the last sync
        named = dict(model.named_parameters())
        self.anchor = {n: p.detach().clone() for n, p in named.items()} if kind == "nesterov" else {}
        self.momentum = {n: torch.zeros_like(p.detach()) for n, p in named.items()} if kind == "nesterov" else {}

    def restart(self, step: int) -> None:
        """The parameters now are where the next outer step starts from (after warm-up or a resume)."""
        self.synced_at = step
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.anchor:
                    _local(self.anchor[name]).copy_(_local(param))

    def after_step(self, step: int) -> None:
        """After each optimizer step: sync every ``sync_every`` steps past the warm-up, whose last
        step anchors the first outer step (during it gradients are averaged: replicas agree)."""
        if self.layout.sync_every == 0:
            return
        if step == self.warmup_steps:
            self.restart(step)
        elif step > self.warmup_steps and step % self.layout.sync_every == 0:
            self.sync(step)

    @torch.no_grad()
    def sync(self, step: int) -> None:
        """Bring the sync groups' replicas together (once per step: a second call is a no-op)."""
        if self.layout.sync_every == 0 or step == self.synced_at:
            return
        if step <= self.warmup_steps:  # still warming up: the replicas agree already
            self.restart(step)
            return
        self.synced_at = step
        average_across_sync_groups(self.model, self.layout)
        if self.kind == "average":
            return
        for name, param in self.model.named_parameters():
            anchor, momentum, averaged = _local(self.anchor[name]), _local(self.momentum[name]), _local(param)
            delta = anchor - averaged
            momentum.mul_(self.beta).add_(delta)
            anchor.sub_(delta.add_(momentum, alpha=self.beta), alpha=self.lr)
            averaged.copy_(anchor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps (the anchor is the parameters at a checkpoint: it follows a sync)."""
        return self.momentum


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor, to update in place."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def average_optimizer_across_sync_groups(optimizer: torch.optim.Optimizer, layout: Layout) -> None:
    """Local SGD's groups each keep their own optimizer state between syncs; before a checkpoint
    they average it too, so the checkpoint is one state (the groups' copies are one key in it),
    which resumes on any number of groups, and on the same layout exactly as a straight run goes on."""
    if not layout.distributed or layout.sync_every == 0 or layout.world == layout.shard:
        return
    group = layout.mesh["sync"].get_group()
    groups = layout.world // layout.shard
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                local = _local(value)
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
                local.div_(groups)


@torch.no_grad()
def average_gradients_across_sync_groups(model: nn.Module, layout: Layout) -> None:
    """Local SGD's warm-up: each shard's gradients averaged with the same shard of every other
    sync group, so the step is the one HSDP takes."""
    if not layout.distributed or layout.world == layout.shard:
        return
    group = layout.mesh["sync"].get_group()
    groups = layout.world // layout.shard
    for param in model.parameters():
        if param.grad is not None:
            local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
            local.div_(groups)


def peak_memory_mb(layout: Layout) -> list[float]:
    """Every rank's peak memory in MB (CUDA: tensors allocated; CPU: the process's resident set)."""
    if layout.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(layout.device) / 2**20
    else:
        import resource

        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if not layout.distributed:
        return [round(mine, 1)]
    every = torch.zeros(layout.world, dtype=torch.float64, device=layout.device)
    every[layout.rank] = mine
    dist.all_reduce(every, op=dist.ReduceOp.SUM)
    return [round(float(v), 1) for v in every.tolist()]


def max_across_ranks(value: int, layout: Layout) -> int:
    if not layout.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=layout.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_across_ranks(value: float, layout: Layout) -> float:
    if not layout.distributed:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=layout.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()


def collective_failure(exc: BaseException, layout: Layout, timeout_s: float) -> FeatureStoreError | None:
    """``exc`` as the error a user reads when it is a collective that failed (a rank stopped
    answering, died or lost its connection); None for anything else."""
    text = str(exc)
    if not layout.distributed or not (
        isinstance(exc, dist.DistError) or any(s in text for s in ("Timed out", "timed out", "Connection closed"))
    ):
        return None
    first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    return FeatureStoreError(
        f"rank {layout.rank} of {layout.world}: a collective with the other ranks did not complete within "
        f"{timeout_s:g} s or lost a peer ({first}); a rank stopped answering or died, so the run stops. "
        "Its last checkpoint is intact: resume it with --resume"
    )


def teardown(layout: Layout) -> None:
    if layout.distributed and dist.is_initialized():
        dist.destroy_process_group()
