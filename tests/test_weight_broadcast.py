"""Weights broadcast in memory, in buckets (issue #28), across real processes over gloo, the
buckets sent over the group or read from shared memory: every replica ends with the source's
tensors bit for bit, whatever their dtypes and sizes, received into staged memory when it fits;
a bucket damaged on the wire is caught by its hash and nobody takes the new weights; no shared
memory outlives a broadcast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import examples

_RANK = """
import json, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from featurestore.weight_broadcast import BroadcastFailed, plan, receive, send, staging, stream_bytes

rank, world, rendezvous, damage, out, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
device, shared = ("cuda", True) if transport == "cuda-shared" else ("cpu", transport == "shared")
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
g = torch.Generator().manual_seed(7)
state = {  # every rank can make the source's tensors: the receivers check theirs against them
    "embedding.weight": torch.randn(700, 512, generator=g),  # 1.4 MB: a bucket of its own
    "layer.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    "layer.bias": torch.randn(32, generator=g),
    "steps": torch.tensor([12345678901], dtype=torch.int64),
    "mask": torch.rand(1001, generator=g) > 0.5,  # an odd size: what follows still starts aligned
    "empty": torch.zeros(0),
    **{f"block{i}.weight": torch.randn(100, 100, generator=g) for i in range(20)},  # 40 KB each
}
state = {k: v.to(device) for k, v in state.items()}
try:
    if rank == 0:
        def tamper(bucket, buffer):
            if damage != "none" and bucket == int(damage):
                buffer[0] ^= 1
        send(state, bucket_bytes=256 * 1024, device=device, shared=shared, tamper=tamper)
        result = {"ok": True, "buckets": len(plan(state, 256 * 1024)[1])}
    else:
        # rank 1 receives into memory staged for it, rank 2's is too small (fresh memory then), rank 3 has none
        need = stream_bytes(state)
        staged = staging(need, device) if rank == 1 else staging(need - 16, device) if rank == 2 else None
        got, _ = receive(device=device, into=staged)
        same = set(got) == set(state) and all(
            got[k].dtype == state[k].dtype and got[k].shape == state[k].shape and torch.equal(got[k], state[k])
            for k in state
        )
        inside = None if staged is None else all(
            staged.data_ptr() <= t.data_ptr() < staged.data_ptr() + staged.numel() for t in got.values() if t.numel()
        )
        result = {"ok": True, "identical": same, "in_staging": inside}
except BroadcastFailed as exc:
    result = {"ok": False, "error": str(exc)}
json.dump(result, open(out, "w"))
dist.destroy_process_group()
"""


GPU = [pytest.mark.gpu, pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")]
# cuda-shared: every process on one GPU (a trainer and its inference servers), buckets by CUDA IPC
TRANSPORTS = ["network", "shared", pytest.param("cuda-shared", marks=GPU)]


def _broadcast(tmp_path: Path, world: int, damage: str, transport: str = "network") -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK))
    rendezvous = tmp_path / "rendezvous"  # (a file, not a port: nothing to race for)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(world),
                str(rendezvous),
                damage,
                str(tmp_path / f"{r}.json"),
                transport,
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    for rank in ranks:
        _, err = rank.communicate(timeout=180)
        assert rank.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def _shared_files() -> set[str]:
    from featurestore.shared_tensors import _SHM_DIR

    return {name for name in os.listdir(_SHM_DIR) if name.startswith("featurestore-broadcast-")}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_replica_gets_the_source_weights_bit_for_bit(tmp_path, transport):
    before = _shared_files()
    source, *replicas = _broadcast(tmp_path, 4, "none", transport)
    assert source == {"ok": True, "buckets": source["buckets"]} and source["buckets"] > 4  # many buckets, pipelined
    assert [r["identical"] for r in replicas] == [True] * 3
    assert [r["in_staging"] for r in replicas] == [True, False, None]  # staged memory used when it fits
    assert _shared_files() == before  # the source's buffers went with the broadcast


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bucket", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_a_damaged_bucket_means_nobody_takes_the_new_weights(tmp_path, bucket, transport):
    before = _shared_files()
    results = _broadcast(tmp_path, 3, str(bucket), transport)
    assert [r["ok"] for r in results] == [False, False, False]
    assert all("keeps its weights" in r["error"] for r in results)
    assert _shared_files() == before


def test_a_gpu_digest_is_the_same_bytes_wherever_they_lie_and_any_changed_word_shows():
    """``sum64`` (a source on a GPU hashes there) against a naive sum of words times the same
    multipliers, on lengths that are not whole words too; a changed byte always changes it."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from featurestore.sum64 import copy_sum64, multipliers, sum64

    @settings(max_examples=examples(100), deadline=None)
    @given(data=st.binary(min_size=0, max_size=300), flip=st.integers(0, 299), mask=st.integers(1, 255))
    def check(data, flip, mask):
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        whole = len(data) - len(data) % 8
        words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, whole, 8)]
        words += list(data[whole:])  # the last bytes, one a word
        keys = [multipliers(0, len(words), lane, torch.device("cpu")).tolist() for lane in (0, 1)]
        naive = [sum(w * k for w, k in zip(words, keys[lane])) % (1 << 64) for lane in (0, 1)]
        assert sum64(buffer).view(torch.int64).tolist() == [n - (1 << 64) if n >= 1 << 63 else n for n in naive]
        copy = torch.full_like(buffer, 7)
        assert torch.equal(copy_sum64(buffer, copy), sum64(buffer)) and torch.equal(copy, buffer)
        if data:
            changed = buffer.clone()
            changed[flip % len(data)] ^= mask
            assert not torch.equal(sum64(changed), sum64(buffer))

    check()


def test_the_plan_cuts_one_aligned_stream_into_buckets_no_larger_than_asked():
    """Tensors of any size and dtype: laid end to end, aligned, never overlapping; every bucket the
    size asked but the last; a tensor larger than a bucket spans as many as its bytes need."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from featurestore.weight_broadcast import ALIGN, _pieces, plan

    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]

    @settings(max_examples=examples(60), deadline=None)
    @given(
        shapes=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, len(dtypes) - 1)), min_size=1, max_size=12),
        bucket=st.sampled_from([16, 48, 1024, 4096]),
    )
    def check(shapes, bucket):
        state = {f"t{i}": torch.zeros(n, dtype=dtypes[d]) for i, (n, d) in enumerate(shapes)}
        slots, sizes = plan(state, bucket)
        assert all(size == bucket for size in sizes[:-1]) and (not sizes or 0 < sizes[-1] <= bucket)
        end = 0
        for slot, (name, tensor) in zip(slots, state.items(), strict=True):
            assert slot.name == name and slot.offset % ALIGN == 0 and slot.offset >= end
            assert slot.nbytes == tensor.numel() * tensor.element_size()
            end = slot.offset + slot.nbytes
        assert sum(sizes) == end
        covered = {s.name: 0 for s in slots}  # every byte of every tensor in exactly one bucket
        for b, size in enumerate(sizes):
            for name, lo, hi in _pieces(slots, b * bucket, b * bucket + size):
                covered[name] += hi - lo
        assert covered == {s.name: s.nbytes for s in slots}

    check()
    with pytest.raises(ValueError, match="multiple of"):
        plan({"x": torch.zeros(3)}, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_the_gpu_kernel_digests_and_copies_as_the_reference_does():
    """On CUDA ``sum64`` runs one Triton kernel; it equals the torch reference on lengths that
    are and are not whole words and blocks, and its copy is exact."""
    import torch

    from featurestore import sum64 as module

    assert module._kernel() is not None  # a CUDA build of torch brings Triton
    g = torch.Generator(device="cuda").manual_seed(5)
    for n in [8, 13, 8 * module.BLOCK, 8 * module.BLOCK + 3, 1 << 20, (64 << 20) + 5]:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        whole = n - n % 8
        words = data[:whole].view(torch.int64)
        keys = [module.multipliers(0, words.numel(), lane, data.device) for lane in (0, 1)]
        reference = torch.stack([(words * k).sum() for k in keys])
        tail = data[whole:].to(torch.int64)
        reference += torch.stack(
            [(tail * module.multipliers(whole // 8, tail.numel(), lane, data.device)).sum() for lane in (0, 1)]
        )
        assert torch.equal(module.sum64(data), reference.cpu().view(torch.uint8)), n
        assert torch.equal(module.sum64(data), module.sum64(data.cpu())), n  # the same bytes on the host
        copy = torch.zeros_like(data)
        assert torch.equal(module.copy_sum64(data, copy), module.sum64(data)) and torch.equal(copy, data), n


def test_shared_memory_is_offered_to_this_user_on_this_machine_and_opened_only_by_its_pattern():
    """``machine_id`` decides when a round may use shared memory: the same in another process of
    this user, another for another user (who could not open a ``0600`` file). ``attach`` opens
    only a broadcast's own names: a handle is data from a peer, not a path to follow."""
    from featurestore.errors import FeatureStoreError
    from featurestore.shared_tensors import Exported, attach, machine_id

    def other_process(user: int | None) -> str:
        switch = f"os.setuid({user}); " if user is not None else ""  # (after the imports root can read)
        code = f"import os; from featurestore.shared_tensors import machine_id; {switch}print(machine_id())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    assert other_process(None) == machine_id()
    if os.getuid() == 0:
        assert other_process(65534) != machine_id()  # nobody
    exported = Exported(64)
    try:
        exported.tensor[:] = 7
        assert attach(exported.handle).tolist() == [7] * 64  # what another process maps
    finally:
        exported.close()
    for handle in (
        {"kind": "shm", "name": "../../etc/passwd", "nbytes": 4},
        {"kind": "shm", "name": exported.handle["name"], "nbytes": 64},  # gone with the broadcast
        {"kind": "pickle", "name": "x"},
    ):
        with pytest.raises((FeatureStoreError, FileNotFoundError)):
            attach(handle)
