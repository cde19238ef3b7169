"""Weight broadcast: a model's tensors from one source to 4 replicas in memory (bucketed, pipelined,
SHA-256 per bucket, the group agreeing at the end), against the limit: one raw
``torch.distributed.broadcast`` of the same bytes as a single flat tensor over the same group.

Real processes over gloo on loopback (NCCL where the ranks have GPUs is the same call). Prints the
time from "weights in the source's memory" to "every replica holds them, verified", GB/s, and the
ratio to the raw broadcast.

    python benchmarks/weight_broadcast.py [--sizes-mb 100 1000] [--replicas 4] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
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


def rank_main(rank: int, world: int, port: int, sizes_mb: list[int], bucket_mb: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from featurestore.weight_broadcast import receive, send, staging, stream_bytes

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    for size_mb in sizes_mb:
        # a model's shape: a few large tables and many small layers (float32)
        elements = size_mb * (1 << 20) // 4
        state = {f"table{i}": torch.randn(elements // 8) for i in range(6)}
        state |= {f"layer{i}": torch.randn((elements - 6 * (elements // 8)) // 64) for i in range(64)}
        nbytes = sum(t.numel() * 4 for t in state.values())
        flat = torch.empty(nbytes, dtype=torch.uint8)
        best = {"bucketed": float("inf"), "fresh": float("inf"), "raw": float("inf")}
        for repeat in range(repeats + 1):
            # as a member does between rounds, receivers stage the stream's memory beforehand (the
            # raw broadcast's buffer is reused, so touched, too); one round goes into fresh memory
            staged = staging(stream_bytes(state)) if rank and repeat < repeats else None
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                send(state, bucket_bytes=bucket_mb << 20)
            else:
                receive(into=staged)
            dist.barrier()
            kind = "bucketed" if repeat < repeats else "fresh"
            best[kind] = min(best[kind], time.perf_counter() - started)
            del staged
            if repeat == repeats:
                continue
            dist.barrier()
            started = time.perf_counter()
            dist.broadcast(flat, 0)
            dist.barrier()
            best["raw"] = min(best["raw"], time.perf_counter() - started)
        if rank == 0:
            gb = nbytes / 1e9
            print(
                f"{size_mb:>6} MB to {world - 1} replicas: bucketed {best['bucketed']:6.2f} s "
                f"({gb / best['bucketed']:5.2f} GB/s)   raw broadcast {best['raw']:6.2f} s "
                f"({gb / best['raw']:5.2f} GB/s)   ratio {best['bucketed'] / best['raw']:.2f}x   "
                f"(into fresh memory: {best['fresh']:.2f} s, {best['fresh'] / best['raw']:.2f}x)",
                flush=True,
            )
        del state, flat
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    world = args.replicas + 1
    if args.rank is not None:
        rank_main(args.rank, world, args.port, args.sizes_mb, args.bucket_mb, args.repeats)
        return
    print(f"{os.cpu_count()} CPUs, gloo on loopback, bucket {args.bucket_mb} MB, best of {args.repeats}")
    port = _port()
    command = [sys.executable, __file__, "--replicas", str(args.replicas), "--bucket-mb", str(args.bucket_mb)]
    command += ["--repeats", str(args.repeats), "--sizes-mb", *map(str, args.sizes_mb), "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([*command, "--rank", str(r)], env=env) for r in range(world)]
    codes = [r.wait() for r in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
