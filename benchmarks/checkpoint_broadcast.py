"""Checkpoint engine in broadcast mode: a promoted version to every inference server, in memory.

The demo's fraud pipeline (small data) with a model whose card-key table is sized to N MB; a
source `checkpoint-engine --broadcast` and R `serve-model --source` replicas (real processes,
each with its own registry folder holding v1), a closed loop of `/predict` requests on the first
replica. Promoting v2 at the source is timed to "every replica answers with v2"; the source's
own record times the broadcast itself (seats taken → every replica holds the version, verified).
The limit, in the same run: one raw ``torch.distributed.broadcast`` of the same bytes as a single
flat tensor over a gloo group of the same size. Also printed: ``/predict`` p50/p99 on a replica
before and during the update, and failed requests (goal 0). Today's file path is
``benchmarks/checkpoint_engine.py``.

    python benchmarks/checkpoint_broadcast.py [--sizes-mb 100] [--replicas 4] [--bucket-mb 64]
        [--transport auto|shared|network]  (auto: shared memory, the replicas being on this machine)
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import httpx
import torch

from featurestore import FeatureStore
from featurestore.demo.generate import generate, load_demo
from featurestore.online.embedded import EmbeddedRedis
from featurestore.training.model_registry import ModelRegistry
from featurestore.training.trainer import TrainConfig, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentiles  # noqa: E402

DEFINITIONS = Path(__file__).resolve().parents[1] / "definitions"
INSTANCE = {"card_id": 7, "merchant_id": 3, "amount": 120.0}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sized_run(run: Path, folder: Path, size_mb: int, seed: int) -> Path:
    """``run`` with its card-key table grown so the model is ``size_mb`` (random weights per seed)."""
    shutil.copytree(run, folder)
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    name = max((k for k in state["model"] if k.startswith("embeddings.")), key=lambda k: state["model"][k].numel())
    dim = state["model"][name].shape[1]
    rows = size_mb * 1_000_000 // (dim * 4)
    state["model"][name] = torch.randn(rows, dim, generator=g)
    state["model_config"]["vocab_sizes"][int(name.split(".")[1])] = rows
    state["preprocessor"]["hashed"] = {k: rows - 1 for k in state["preprocessor"]["hashed"]}
    torch.save(state, folder / "checkpoint.pt")
    return folder


def raw_broadcast_seconds(nbytes: int, world: int) -> float:
    """The limit: one flat tensor of ``nbytes`` broadcast over gloo to ``world - 1`` processes (best of 3)."""
    port = _port()
    command = [sys.executable, __file__, "--raw-bytes", str(nbytes), "--raw-world", str(world), "--raw-port", str(port)]
    ranks = [
        subprocess.Popen([*command, "--raw-rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(world)
    ]
    out = [r.communicate()[0] for r in ranks]
    return float(out[0].strip().splitlines()[-1])


def _raw_rank(rank: int, world: int, port: int, nbytes: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(flat, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - started)
    if rank == 0:
        print(best, flush=True)
    dist.destroy_process_group()


def _until(condition, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.01)
    raise SystemExit("timed out waiting for the replicas")


def measure(root: Path, run: Path, redis_url: str, size_mb: int, replicas: int, bucket_mb: int, transport: str) -> None:
    work = root / f"{size_mb}mb"
    source_dir = work / "source"
    shutil.copytree(root / "data" / "registry", source_dir / "registry")
    source = ModelRegistry(source_dir / "models", source_dir / "registry" / "models.json")
    v1 = source.register("fraud", sized_run(run, work / "run1", size_mb, 1))
    v2 = source.register("fraud", sized_run(run, work / "run2", size_mb, 2))
    source.promote("fraud", v1, "production")
    nbytes = (source.root / "fraud" / str(v2) / "model.pt").stat().st_size
    base = {**os.environ, "REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "featurestore.cli"]
    processes, urls = [], []
    try:
        port = _port()
        engine_url = f"http://127.0.0.1:{port}"
        processes.append(
            subprocess.Popen(
                [*cli, "checkpoint-engine", "--model", "fraud", "--repo", str(DEFINITIONS), "--port", str(port)]
                + ["--broadcast", "--bucket-mb", str(bucket_mb), "--transport", transport],
                env={**base, "FEATURESTORE_DATA_DIR": str(source_dir)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _until(lambda: httpx.get(engine_url + "/stats").status_code == 200)
        for i in range(replicas):
            own = work / f"replica{i}"
            shutil.copytree(root / "data" / "registry", own / "registry")
            registry = ModelRegistry(own / "models", own / "registry" / "models.json")
            registry.install("fraud", v1, source.verify("fraud", v1), source.hashes("fraud")[v1])
            registry.promote("fraud", v1, "production")
            port = _port()
            urls.append(f"http://127.0.0.1:{port}")
            processes.append(
                subprocess.Popen(
                    [*cli, "serve-model", "--model", "fraud", "--repo", str(DEFINITIONS), "--port", str(port)]
                    + ["--source", engine_url, "--no-access-log", "--log-level", "warning"],
                    env={**base, "FEATURESTORE_DATA_DIR": str(own)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for url in urls:
            _until(lambda url=url: httpx.get(url + "/health").json()["version"] == v1)
        time.sleep(2.0)  # every replica seated
        answers: list[tuple[float, float, int]] = []  # (sent at, seconds, version or -status)
        stop = threading.Event()

        def loop() -> None:
            with httpx.Client(base_url=urls[0], timeout=60) as client:
                while not stop.is_set():
                    sent = time.perf_counter()
                    r = client.post("/predict", json={"instances": [INSTANCE]})
                    took = time.perf_counter() - sent
                    answers.append(
                        (sent, took, r.json()["model"]["version"] if r.status_code == 200 else -r.status_code)
                    )

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(3.0)
        promoted = time.perf_counter()
        source.promote("fraud", v2, "production")
        _until(lambda: all(httpx.get(url + "/health").json()["version"] == v2 for url in urls))
        serving_s = time.perf_counter() - promoted
        time.sleep(3.0)  # the replicas install v2 in their registries after flipping: still "during"
        settled = time.perf_counter()
        stop.set()
        thread.join()
        outcome = httpx.get(engine_url + "/stats").json()["broadcasts"][-1]
    finally:
        for p in processes:
            p.kill()
    raw_s = raw_broadcast_seconds(nbytes, replicas + 1)
    steady = percentiles([took for sent, took, _ in answers if sent < promoted])
    during = percentiles([took for sent, took, _ in answers if promoted <= sent < settled])
    failed = Counter(-v for *_, v in answers if v < 0)
    gb = nbytes / 1e9
    print(
        f"{nbytes / 1e6:.0f} MB to {replicas} replicas (bucket {bucket_mb} MB, {outcome['transport']}): "
        f"broadcast {outcome['seconds']:.2f} s "
        f"({gb / outcome['seconds']:.2f} GB/s; {outcome['group_seconds']:.2f} s of it forming the round's group; "
        f"{outcome['attempts']} failed attempts) · raw broadcast {raw_s:.2f} s "
        f"({gb / raw_s:.2f} GB/s) · ratio {outcome['seconds'] / raw_s:.2f}x · promote → every replica serving "
        f"{serving_s:.2f} s (the source loads the version first)"
    )
    print(
        f"  /predict on a replica: steady p50 {steady['p50']:.1f} ms p99 {steady['p99']:.1f} ms · during the update "
        f"(and the install after it) p50 {during['p50']:.1f} ms p99 {during['p99']:.1f} ms · "
        f"{len(answers):,} requests, {sum(failed.values())} failed {dict(failed) or ''}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--transport", choices=["auto", "shared", "network"], default="auto")
    for hidden in ("--raw-rank", "--raw-world", "--raw-port", "--raw-bytes"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_rank is not None:
        _raw_rank(args.raw_rank, args.raw_world, args.raw_port, args.raw_bytes)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-broadcast-"))
    redis_server = EmbeddedRedis(root / "redis")
    os.environ.update(FEATURESTORE_DATA_DIR=str(root / "data"), REDIS_URL=redis_server.ensure_running())
    try:
        data = generate(n_cards=300, days=10, seed=3)
        with FeatureStore(DEFINITIONS) as store:
            load_demo(store, data, root / "dataset")
        config = TrainConfig(
            dataset=str(root / "dataset"), request_inputs=["amount"], entity_keys=["card_id"], epochs=1
        )
        run = train(config, root / "runs", progress=False)
        print(f"{os.cpu_count()} CPUs, gloo on loopback")
        for size_mb in args.sizes_mb:
            measure(root, run, os.environ["REDIS_URL"], size_mb, args.replicas, args.bucket_mb, args.transport)
    finally:
        redis_server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
