"""Weight broadcast: a model's tensors from one source to N replicas in memory (one aligned stream
in buckets, pipelined, a digest per bucket, the group agreeing at the end), against the limit
measured in the same run over the same processes:

- ``--transport network``: the buckets broadcast over the group (gloo on CPU; NCCL with
  ``--device cuda``, one GPU a rank); the limit is one raw ``torch.distributed.broadcast`` of the
  same bytes as a single flat tensor.
- ``--transport shared``: replicas on the source's machine (``--device cuda``: on its GPU, as a
  trainer and inference servers sharing one device) read each bucket from memory they map
  (shared memory, CUDA IPC); the limit is the same bytes moved with no buckets, digests or
  pipelining: the source copies its tensors into one shared buffer, then every replica copies
  that buffer whole.

Real processes. Prints the time from "weights in the source's memory" to "every replica holds
them, verified", GB/s, the ratio to the limit, and whether every replica got the source's bytes.

    python benchmarks/weight_broadcast.py [--sizes-mb 100 1000] [--replicas 4] [--bucket-mb 64]
        [--transport network|shared] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from featurestore.shared_tensors import Exported, attach
    from featurestore.weight_broadcast import receive, send, staging, stream_bytes

    shared, cuda = args.transport == "shared", args.device == "cuda"
    device = torch.device("cuda", 0 if shared else rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda and not shared else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()

    for size_mb in args.sizes_mb:
        # a model's shape: a few large tables and many small layers (float32), the same on every rank
        torch.manual_seed(size_mb)
        elements = size_mb * (1 << 20) // 4
        state = {f"table{i}": torch.randn(elements // 8, device=device) for i in range(6)}
        state |= {f"layer{i}": torch.randn((elements - 6 * (elements // 8)) // 64, device=device) for i in range(64)}
        nbytes = sum(t.numel() * 4 for t in state.values())
        best = {"bucketed": float("inf"), "fresh": float("inf"), "raw": float("inf")}
        identical = True
        raw_buffer = None
        if shared:  # the limit's one shared buffer, made once (its handle sent as bytes over the group)
            if rank == 0:
                raw_buffer = Exported(nbytes, device)
                blob = torch.frombuffer(
                    bytearray(json.dumps(raw_buffer.handle).encode().ljust(1024)), dtype=torch.uint8
                )
            else:
                blob = torch.zeros(1024, dtype=torch.uint8)
            dist.broadcast(blob.to(device) if backend == "nccl" else blob, 0)
            source_view = (
                raw_buffer.tensor if raw_buffer is not None else attach(json.loads(bytes(blob.cpu()).decode()))
            )
        # as a member does between rounds, receivers stage the stream's memory beforehand (the
        # limit's buffers are reused, so touched, too); on CPU one more round goes into fresh
        # memory, whose first touch costs more than the transfer (a GPU's costs nothing to speak of)
        staged = staging(stream_bytes(state), device) if rank else None
        flat = None if shared else torch.empty(nbytes, dtype=torch.uint8, device=device)
        fresh = int(not cuda)
        for repeat in range(args.repeats + fresh):
            sync()
            started = time.perf_counter()
            if rank == 0:
                send(state, bucket_bytes=args.bucket_mb << 20, device=device, shared=shared)
            else:
                got, _ = receive(device=device, into=staged if repeat < args.repeats else None)
                if repeat == 0:
                    identical = identical and all(torch.equal(got[k], state[k]) for k in state)
                del got
            sync()
            kind = "bucketed" if repeat < args.repeats else "fresh"
            best[kind] = min(best[kind], time.perf_counter() - started)
            if repeat == args.repeats:
                continue
            sync()
            started = time.perf_counter()
            if flat is not None:
                dist.broadcast(flat, 0)
            elif rank == 0:
                torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()], out=source_view)
                sync()
            else:
                sync()
                assert staged is not None
                staged[:nbytes].copy_(source_view)
            sync()
            best["raw"] = min(best["raw"], time.perf_counter() - started)
        verdicts = [torch.tensor([int(identical)], dtype=torch.int32, device=device if backend == "nccl" else "cpu")]
        dist.all_reduce(verdicts[0], op=dist.ReduceOp.MIN)
        if rank == 0:
            gb = nbytes / 1e9
            print(
                f"{size_mb:>6} MB to {world - 1} replicas: bucketed {best['bucketed']:7.3f} s "
                f"({gb / best['bucketed']:6.2f} GB/s)   raw {best['raw']:7.3f} s "
                f"({gb / best['raw']:6.2f} GB/s)   ratio {best['bucketed'] / best['raw']:.2f}x   "
                + (
                    f"(into fresh memory: {best['fresh']:.3f} s, {best['fresh'] / best['raw']:.2f}x)   "
                    if fresh
                    else ""
                )
                + f"every replica bit for bit: {bool(verdicts[0].item())}",
                flush=True,
            )
        if shared:
            del source_view
            sync()
            if raw_buffer is not None:
                raw_buffer.close()
        del state, flat, staged
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport", choices=["network", "shared"], default="network")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    world = args.replicas + 1
    if args.rank is not None:
        rank_main(args.rank, world, args.port, args)
        return
    where = "one GPU shared by every process" if args.device == "cuda" and args.transport == "shared" else args.device
    print(
        f"{os.cpu_count()} CPUs, {args.transport} transport on {where}, bucket {args.bucket_mb} MB, "
        f"best of {args.repeats}"
    )
    port = _port()
    command = [sys.executable, __file__, "--replicas", str(args.replicas), "--bucket-mb", str(args.bucket_mb)]
    command += ["--repeats", str(args.repeats), "--sizes-mb", *map(str, args.sizes_mb), "--port", str(port)]
    command += ["--transport", args.transport, "--device", args.device]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([*command, "--rank", str(r)], env=env) for r in range(world)]
    codes = [r.wait() for r in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
