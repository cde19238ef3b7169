"""A model version's weights broadcast in memory, bucket by bucket, from one source rank to every
other rank of a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA): no disk in the path.

The tensors are laid end to end (each aligned) in one byte stream, cut into fixed-size buckets:
a tensor larger than a bucket spans several, so a large table is hashed, sent and checked piece
by piece, pipelined like the rest, and no bucket is larger than asked. The source broadcasts the
buckets in order, packing the next one while one is on the wire (a bucket inside one tensor goes
as a view of it, uncopied); each receiver gets every bucket straight into its place in one
buffer of the stream's size, which its tensors then view, and checks each bucket while the next
arrives. That buffer is best **staged** before the round (``staging``; a member keeps one
between rounds): memory written for the first time faults its pages in, which can cost more
than the transfer itself (``benchmarks/weight_broadcast.py`` prints both).

Every bucket is followed by its BLAKE3 digest, hashed while the bucket is on the wire and
checked on arrival (every receiver hashes every byte: BLAKE3 does it at several times SHA-256's
speed). The group then agrees whether every receiver got every bucket intact: ``receive``
returns the new weights only if all did, so a corrupt or partial broadcast leaves every replica
on what it had (all or nothing). The layout travels first as JSON (never pickle: a peer's bytes
are data, not code), with any ``meta`` the sender adds (a version's card).

``group`` is any process group, the default one or a backend made for one broadcast without a
default group (``featurestore.broadcast_rounds`` forms one per version, beside a trainer's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import blake3
import torch
import torch.distributed as dist

from featurestore.errors import FeatureStoreError


class Group(Protocol):
    """What a broadcast calls on its group: the default process group, or a backend made for one
    broadcast (``ProcessGroupGloo``), each addressed by its own ranks."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...


BUCKET_BYTES = 64 << 20  # default bucket: big enough to keep a link busy, small enough to pipeline
ALIGN = 16  # bytes: a tensor's offset in its bucket, so its bytes view as any dtype


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the byte stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes into the stream (bucket ``offset // bucket_bytes`` holds its first byte)
    nbytes: int


def plan(state: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> tuple[list[Slot], list[int]]:
    """The tensors laid end to end (each aligned) in one stream, cut into buckets of
    ``bucket_bytes`` (the last one shorter); returns the slots and each bucket's size."""
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, not {bucket_bytes}")
    slots: list[Slot] = []
    end = 0
    for name, tensor in state.items():
        offset = -(-end // ALIGN) * ALIGN  # every tensor starts aligned for any dtype
        nbytes = tensor.numel() * tensor.element_size()
        slots.append(Slot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        end = offset + nbytes
    sizes = [min(bucket_bytes, end - start) for start in range(0, end, bucket_bytes)]
    return slots, sizes


class BroadcastFailed(FeatureStoreError):
    """A bucket arrived damaged or not at all on some receiver: nobody takes the new weights."""


def send(
    state: Mapping[str, torch.Tensor],
    group: Group | None = None,
    src: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
    device: torch.device | str = "cpu",
    *,
    meta: dict | None = None,
    tamper: Callable[[int, torch.Tensor], None] | None = None,
) -> None:
    """Broadcast ``state`` (and ``meta``, JSON) from this rank (``src``) to the group; returns once
    every receiver has said whether it got everything intact, raising ``BroadcastFailed`` when one
    did not. ``tamper`` (fault injection, for tests) is called with each bucket's index and bytes
    after it is hashed, before it is sent."""
    group = _backend(group)
    slots, sizes = plan(state, bucket_bytes)
    _send_json(
        {"slots": [asdict(s) for s in slots], "sizes": sizes, "bucket_bytes": bucket_bytes, "meta": meta or {}},
        group,
        src,
        device,
    )
    flat = {s.name: state[s.name].detach().to(device).contiguous().reshape(-1).view(torch.uint8) for s in slots}
    offsets = {s.name: s.offset for s in slots}
    buffers = [torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=device) for _ in range(2)]
    works: list[dist.Work] = []
    for bucket, size in enumerate(sizes):
        if bucket >= 2:  # this buffer's previous bucket has left
            for work in works[2 * (bucket - 2) : 2 * (bucket - 1)]:
                work.wait()
        start = bucket * bucket_bytes
        pieces = _pieces(slots, start, start + size)
        if len(pieces) == 1 and pieces[0][2] - pieces[0][1] == size and tamper is None:
            name, lo, hi = pieces[0]  # a bucket inside one tensor goes as a view of it
            buffer = flat[name][lo:hi]
        else:
            buffer = buffers[bucket % 2][:size]
            for name, lo, hi in pieces:
                at = offsets[name] + lo - start
                buffer[at : at + hi - lo].copy_(flat[name][lo:hi])
        if tamper is None:  # hashed while it is on the wire
            sent = group.broadcast(buffer, src)
            works += [sent, group.broadcast(_digest(buffer), src)]
        else:  # (damaged after hashing: the digest is of the bytes meant)
            digest = _digest(buffer)
            tamper(bucket, buffer)
            works += [group.broadcast(buffer, src), group.broadcast(digest, src)]
    for work in works[-4:]:
        work.wait()
    if not _everyone_ok(True, group, device):
        raise BroadcastFailed("a receiver got a damaged or partial broadcast; every replica keeps its weights")


def stream_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """The bytes a receiver of ``state`` needs: its stream, padding included."""
    return sum(plan(state)[1])


def staging(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Memory for a coming ``receive``, written once now so its pages are in place."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device).zero_()


def receive(
    group: Group | None = None,
    src: int = 0,
    device: torch.device | str = "cpu",
    into: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The weights ``src`` broadcasts and its ``meta``, once every receiver has them intact
    (``BroadcastFailed`` otherwise, on every rank). The tensors view the buckets they arrived in:
    ``into`` (a ``staging`` buffer, used when large enough, which they then own) or fresh memory."""
    group = _backend(group)
    layout = _receive_json(group, src, device)
    slots = [Slot(s["name"], s["dtype"], tuple(s["shape"]), s["offset"], s["nbytes"]) for s in layout["slots"]]
    sizes: list[int] = layout["sizes"]
    step: int = layout["bucket_bytes"]
    # every bucket arrives straight into its place in one buffer, which the tensors then view (no copy out)
    total = sum(sizes)
    fits = into is not None and into.numel() >= total and into.device == torch.device(device)
    stream = into[:total] if fits and into is not None else torch.empty(total, dtype=torch.uint8, device=device)
    digests = [torch.empty(32, dtype=torch.uint8, device=device) for _ in sizes]

    def part(bucket: int) -> torch.Tensor:
        return stream[bucket * step : bucket * step + sizes[bucket]]

    def post(bucket: int) -> tuple[dist.Work, dist.Work]:
        return group.broadcast(part(bucket), src), group.broadcast(digests[bucket], src)

    intact = True
    works: list[dist.Work] = list(post(0)) if sizes else []
    for bucket in range(len(sizes)):
        for work in works[2 * bucket : 2 * bucket + 2]:
            work.wait()
        if bucket + 1 < len(sizes):
            works += post(bucket + 1)  # the next one arrives meanwhile
        intact = intact and torch.equal(_digest(part(bucket)), digests[bucket])
    if not _everyone_ok(intact, group, device):
        raise BroadcastFailed("a receiver got a damaged or partial broadcast; every replica keeps its weights")
    received = {
        s.name: stream[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).reshape(s.shape) for s in slots
    }
    return received, layout.get("meta", {})


def _backend(group: Group | None) -> Group:
    """The group to call directly (its own ranks, no default group needed): the default one for None."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _pieces(slots: list[Slot], start: int, stop: int) -> list[tuple[str, int, int]]:
    """(tensor, first byte, past last byte) of each tensor's bytes in the stream range [start, stop)."""
    return [
        (s.name, max(start, s.offset) - s.offset, min(stop, s.offset + s.nbytes) - s.offset)
        for s in slots
        if s.nbytes and s.offset < stop and s.offset + s.nbytes > start
    ]


def _digest(buffer: torch.Tensor) -> torch.Tensor:
    digest = blake3.blake3(buffer.cpu().numpy().data).digest()  # hashed in place (no copy on CPU)
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(buffer.device)


def _everyone_ok(mine: bool, group: Group, device: torch.device | str) -> bool:
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    group.allreduce([flag], options).wait()
    return bool(flag.item())


def _send_json(value: dict, group: Group, src: int, device: torch.device | str) -> None:
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    group.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=device), src).wait()
    group.broadcast(data, src).wait()


def _receive_json(group: Group, src: int, device: torch.device | str) -> dict:
    length = torch.empty(1, dtype=torch.int64, device=device)
    group.broadcast(length, src).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.broadcast(data, src).wait()
    return json.loads(bytes(data.cpu().numpy()))
