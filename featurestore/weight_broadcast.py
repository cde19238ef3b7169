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

Every bucket is followed by its digest, hashed while the bucket is on the wire and checked on
arrival: BLAKE3 for a source on CPU (every receiver hashes every byte: BLAKE3 does it at several
times SHA-256's speed), and for a source on a GPU a 128-bit checksum computed there (``sum64``:
two sums of the bucket's 64-bit words times fixed odd multipliers, modulo 2^64, so any one
changed word always shows; hashing on the host would copy every byte across PCIe and take longer
than the transfer). The group then agrees whether every receiver got every bucket intact:
``receive`` returns the new weights only if all did, so a corrupt or partial broadcast leaves
every replica on what it had (all or nothing). The layout travels first as JSON (never pickle: a
peer's bytes are data, not code), with any ``meta`` the sender adds (a version's card).

**Colocated receivers** (``shared=True``: the same machine, or the same GPU) read the buckets
instead of being sent them: the source fills a few buffers they map (``featurestore.shared_tensors``:
shared memory on CPU, CUDA IPC on a GPU, where NCCL cannot put two processes of one group on one
device), and only each bucket's digest and a "copied" flag cross the group. A receiver copies a
bucket into its own stream while the source fills the next buffer; a buffer is refilled once
every receiver has said it copied what it held. Everything else (layout, digests, agreement,
staging) is the network path's. Those copies are torch's: a receiver on a busy host wants one
intra-op thread (``torch.set_num_threads(1)``, as the inference server runs), since torch's
thread pool spinning against other processes made a 64 KB copy take 20 ms instead of 20 µs.

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
from featurestore.shared_tensors import Exported, attach
from featurestore.sum64 import copy_sum64, sum64


class Group(Protocol):
    """What a broadcast calls on its group: the default process group, or a backend made for one
    broadcast (``ProcessGroupGloo``), each addressed by its own ranks."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...


BUCKET_BYTES = 64 << 20  # default bucket: big enough to keep a link busy, small enough to pipeline
ALIGN = 16  # bytes: a tensor's offset in its bucket, so its bytes view as any dtype
# a colocated broadcast's buffers: the source fills ahead while receivers copy (on a GPU a bucket
# is copied in less time than the group takes to say so)
SHARED_BUFFERS = 4
HASH_PIECE = 1 << 20  # bytes a receiver copies, then hashes while they are in cache


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
    shared: bool = False,
    meta: dict | None = None,
    tamper: Callable[[int, torch.Tensor], None] | None = None,
) -> None:
    """Broadcast ``state`` (and ``meta``, JSON) from this rank (``src``) to the group; returns once
    every receiver has said whether it got everything intact, raising ``BroadcastFailed`` when one
    did not. ``shared``: the receivers are on this machine (``device``: on this GPU) and read the
    buckets from memory they map. ``tamper`` (fault injection, for tests) is called with each
    bucket's index and bytes after it is hashed, before it is sent."""
    group = _backend(group)
    control = _control_device(group, device)
    slots, sizes = plan(state, bucket_bytes)
    digest = _DIGEST[torch.device(device).type == "cuda"]
    buffers = [Exported(max(sizes), device) for _ in range(min(SHARED_BUFFERS, len(sizes)))] if shared else []
    try:
        layout = {"slots": [asdict(s) for s in slots], "sizes": sizes, "bucket_bytes": bucket_bytes}
        layout |= {"digest": digest, "shared": [b.handle for b in buffers], "meta": meta or {}}
        _send_json(layout, group, src, control)
        flat = {s.name: state[s.name].detach().to(device).contiguous().reshape(-1).view(torch.uint8) for s in slots}
        packer = _Packer(slots, flat, bucket_bytes)
        if shared:
            _send_shared(packer, sizes, buffers, digest, group, src, control, tamper)
        else:
            _send_over_group(packer, sizes, digest, group, src, device, control, tamper)
        everyone = _everyone_ok(True, group, control)  # (receivers have let go of the shared buffers by then)
    finally:
        for buffer in buffers:
            buffer.close()
    if not everyone:
        raise BroadcastFailed("a receiver got a damaged or partial broadcast; every replica keeps its weights")


class _Packer:
    """Puts one bucket's bytes (the pieces of the tensors it spans) into a buffer."""

    def __init__(self, slots: list[Slot], flat: dict[str, torch.Tensor], bucket_bytes: int):
        self.slots, self.flat, self.bucket_bytes = slots, flat, bucket_bytes
        self.offsets = {s.name: s.offset for s in slots}

    def view(self, bucket: int, size: int) -> torch.Tensor | None:
        """The bucket as a view of the one tensor it lies inside, if it does."""
        pieces = _pieces(self.slots, bucket * self.bucket_bytes, bucket * self.bucket_bytes + size)
        if len(pieces) == 1 and pieces[0][2] - pieces[0][1] == size:
            name, lo, hi = pieces[0]
            return self.flat[name][lo:hi]
        return None

    def pack(self, bucket: int, buffer: torch.Tensor) -> torch.Tensor:
        start = bucket * self.bucket_bytes
        for name, lo, hi in _pieces(self.slots, start, start + buffer.numel()):
            at = self.offsets[name] + lo - start
            buffer[at : at + hi - lo].copy_(self.flat[name][lo:hi])
        return buffer


def _send_over_group(
    packer: _Packer,
    sizes: list[int],
    digest: str,
    group: Group,
    src: int,
    device: torch.device | str,
    control: torch.device,
    tamper: Callable[[int, torch.Tensor], None] | None,
) -> None:
    """The buckets themselves broadcast, two in flight: one packed while the other is on the wire."""
    buffers = [torch.zeros(max(sizes, default=0), dtype=torch.uint8, device=device) for _ in range(2)]
    works: list[dist.Work] = []
    for bucket, size in enumerate(sizes):
        if bucket >= 2:  # this buffer's previous bucket has left
            for work in works[2 * (bucket - 2) : 2 * (bucket - 1)]:
                work.wait()
        view = packer.view(bucket, size) if tamper is None else None  # (a bucket inside one tensor goes uncopied)
        buffer = view if view is not None else packer.pack(bucket, buffers[bucket % 2][:size])
        if tamper is None:  # hashed while it is on the wire
            sent = group.broadcast(buffer, src)
            works += [sent, group.broadcast(_digest(buffer, digest).to(control), src)]
        else:  # (damaged after hashing: the digest is of the bytes meant)
            hashed = _digest(buffer, digest).to(control)
            tamper(bucket, buffer)
            works += [group.broadcast(buffer, src), group.broadcast(hashed, src)]
    for work in works[-4:]:
        work.wait()


def _send_shared(
    packer: _Packer,
    sizes: list[int],
    buffers: list[Exported],
    digest: str,
    group: Group,
    src: int,
    control: torch.device,
    tamper: Callable[[int, torch.Tensor], None] | None,
) -> None:
    """Each bucket packed into a buffer the receivers map, then its digest and a "copied" flag
    cross the group; a buffer is refilled once every receiver copied what it held."""
    copied: list[dist.Work] = []
    digests: list[dist.Work] = []
    for bucket, size in enumerate(sizes):
        if bucket >= len(buffers):
            copied[bucket - len(buffers)].wait()
            if bucket == len(buffers):  # every receiver has them open: the names can go
                for buffer in buffers:
                    buffer.unlink()
        data = packer.pack(bucket, buffers[bucket % len(buffers)].tensor[:size])
        hashed = _digest(data, digest)
        if tamper is not None:
            tamper(bucket, data)
        if data.is_cuda:  # the receivers' copies start once this one's writes are done
            torch.cuda.synchronize(data.device)
        digests.append(group.broadcast(hashed.to(control), src))
        copied.append(_allreduce_min(torch.ones(1, dtype=torch.int32, device=control), group))
    for work in digests + copied:
        work.wait()


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
    ``into`` (a ``staging`` buffer on ``device``, used when large enough, which they then own) or
    fresh memory. Whether the buckets come over the group or from shared memory, the source says."""
    group = _backend(group)
    control = _control_device(group, device)
    layout = _receive_json(group, src, control)
    slots = [Slot(s["name"], s["dtype"], tuple(s["shape"]), s["offset"], s["nbytes"]) for s in layout["slots"]]
    sizes: list[int] = layout["sizes"]
    step: int = layout["bucket_bytes"]
    digest: str = layout["digest"]
    if digest not in _DIGEST.values():
        raise BroadcastFailed(f"the source hashes with {digest!r}, which this receiver does not know")
    # every bucket arrives straight into its place in one buffer, which the tensors then view (no copy out)
    total = sum(sizes)
    fits = into is not None and into.numel() >= total and _same_device(into.device, torch.device(device))
    stream = into[:total] if fits and into is not None else torch.empty(total, dtype=torch.uint8, device=device)
    digests = [torch.empty(_DIGEST_BYTES[digest], dtype=torch.uint8, device=control) for _ in sizes]

    def part(bucket: int) -> torch.Tensor:
        return stream[bucket * step : bucket * step + sizes[bucket]]

    intact = True
    if layout["shared"]:
        buffers = [attach(handle) for handle in layout["shared"]]
        copied: list[dist.Work] = []
        for bucket, size in enumerate(sizes):
            group.broadcast(digests[bucket], src).wait()  # (it follows the bucket's bytes)
            copied_digest = _copy_digest(buffers[bucket % len(buffers)][:size], part(bucket), digest)
            intact = intact and torch.equal(copied_digest, digests[bucket].cpu())
            copied.append(_allreduce_min(torch.ones(1, dtype=torch.int32, device=control), group))
        for work in copied:
            work.wait()
        del buffers
    else:

        def post(bucket: int) -> tuple[dist.Work, dist.Work]:
            return group.broadcast(part(bucket), src), group.broadcast(digests[bucket], src)

        works: list[dist.Work] = list(post(0)) if sizes else []
        for bucket in range(len(sizes)):
            for work in works[2 * bucket : 2 * bucket + 2]:
                work.wait()
            if bucket + 1 < len(sizes):
                works += post(bucket + 1)  # the next one arrives meanwhile
            intact = intact and torch.equal(_digest(part(bucket), digest), digests[bucket].cpu())
    if not _everyone_ok(intact, group, control):
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


def _same_device(have: torch.device, want: torch.device) -> bool:
    """(``cuda`` asked for means the current GPU, as tensors name it: ``cuda:0``.)"""
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    return have == want


def _control_device(group: Group, device: torch.device | str) -> torch.device:
    """Where digests, flags and the layout live: on the data's device for NCCL, else on the host."""
    name = group.name() if hasattr(group, "name") else "gloo"
    return torch.device(device) if "nccl" in str(name).lower() else torch.device("cpu")


_DIGEST = {False: "blake3", True: "sum64"}  # by whether the source's buffers are on a GPU
_DIGEST_BYTES = {"blake3": 32, "sum64": 16}


def _digest(buffer: torch.Tensor, kind: str) -> torch.Tensor:
    """A bucket's digest (uint8, on the host), computed where its bytes are for ``sum64``."""
    if kind == "sum64":
        return sum64(buffer)
    digest = blake3.blake3(buffer.cpu().numpy().data).digest()  # hashed in place (no copy on CPU)
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def _copy_digest(source: torch.Tensor, destination: torch.Tensor, kind: str) -> torch.Tensor:
    """Copy a bucket and digest the copy, reading its bytes from memory once: ``sum64`` on a GPU in
    one kernel; BLAKE3 a cache-sized piece at a time, each hashed while the copy left it in cache
    (copying the whole bucket first read it back from memory to hash it)."""
    if kind == "sum64":
        return copy_sum64(source, destination)
    if destination.is_cuda or source.is_cuda:
        destination.copy_(source)
        return _digest(destination, kind)
    hasher = blake3.blake3()
    for start in range(0, destination.numel(), HASH_PIECE):
        piece = destination[start : start + HASH_PIECE]
        piece.copy_(source[start : start + HASH_PIECE])
        hasher.update(piece.numpy().data)
    return torch.frombuffer(bytearray(hasher.digest()), dtype=torch.uint8)


def _allreduce_min(flag: torch.Tensor, group: Group) -> dist.Work:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    return group.allreduce([flag], options)


def _everyone_ok(mine: bool, group: Group, device: torch.device | str) -> bool:
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    _allreduce_min(flag, group).wait()
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
