"""Online lookup latency: SDK and HTTP, against raw redis-py and a raw ASGI handler, same run.

Setup: 100k entities × 10 features (mixed types) materialized into Redis (embedded by
default, REDIS_URL to use another). Then, for 1, 10 and 100 entities per request:
  - SDK: ``store.get_online_features`` vs a raw pipelined HMGET of the same keys;
  - HTTP (uvicorn, 1 worker, loopback, closed loop over a keep-alive socket):
    ``POST /get-online-features`` vs the plain-ASGI handler in raw_asgi.py;
and throughput with 16 concurrent clients at 1 and 2 server workers (``--workers 1,2,4`` where
cores allow). Every loop is bounded by count and time.

    python benchmarks/online.py [--entities 100000] [--seconds 4] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentiles  # noqa: E402

HERE = Path(__file__).resolve().parent
PROJECT = "bench_online"
DEFS = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import *

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
stats = FeatureView(
    name="stats", entities=[user], source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("f1", Float64), Field("f2", Float64), Field("f3", Float32), Field("f4", Int64), Field("f5", Int64),
            Field("f6", Int32), Field("f7", String), Field("f8", Bool), Field("f9", Float64), Field("f10", String)],
)
"""
FEATURES = [f"stats:f{i}" for i in range(1, 11)]
SIZES = (1, 10, 100)


def setup(root: Path, n: int) -> None:
    rng = np.random.default_rng(1)
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "featurestore.yaml").write_text(f"project: {PROJECT}\nmodules: [features.py]\n")
    (root / "features.py").write_text(DEFS)
    now = datetime.now(timezone.utc)
    pq.write_table(pa.table({
        "user_id": np.arange(1, n + 1), "event_timestamp": pa.array([now - timedelta(hours=1)] * n, pa.timestamp("us", tz="UTC")),
        "f1": rng.normal(size=n), "f2": rng.normal(size=n), "f3": rng.normal(size=n).astype(np.float32),
        "f4": rng.integers(0, 10**9, n), "f5": rng.integers(0, 10**9, n), "f6": rng.integers(0, 1000, n).astype(np.int32),
        "f7": pa.array(rng.integers(0, 1000, n).astype(str)), "f8": rng.random(n) < 0.5, "f9": rng.normal(size=n),
        "f10": pa.array(np.char.add("category-", rng.integers(0, 50, n).astype(str))),
    }), root / "data" / "stats.parquet")


def timed(fn, iterations: int, seconds: float) -> list[float]:
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return out


def paired(ours, raw, iterations: int, seconds: float, block: int = 100) -> tuple[list[float], list[float]]:
    """Time both sides in alternating blocks, so drifting machine noise hits both alike."""
    a: list[float] = []
    b: list[float] = []
    deadline = time.perf_counter() + 2 * seconds
    while len(a) < iterations and time.perf_counter() < deadline:
        a += timed(ours, block, seconds)
        b += timed(raw, block, seconds)
    return a, b


class HttpClient:
    """HTTP/1.1 keep-alive over one socket: the least client overhead Python allows."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: bytes) -> bytes:
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        status = self.file.readline()
        length = 0
        while True:
            line = self.file.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        payload = self.file.read(length)
        if b" 200 " not in status:
            raise RuntimeError(f"{status!r} {payload[:200]!r}")
        return payload


async def throughput(port: int, path: str, bodies: list[bytes], clients: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        while time.perf_counter() < stop:
            body = bodies[i % len(bodies)]
            i += clients
            writer.write(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            done += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(clients)))
    return done / (time.perf_counter() - t0)


def start(args: list[str], env: dict, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=4.0, help="time bound per measured loop")
    parser.add_argument("--data-dir", type=Path, default=HERE / ".data" / "online")
    parser.add_argument("--workers", type=lambda text: [int(w) for w in text.split(",")], default=[1, 2],
                        help="server worker counts to measure throughput at, e.g. 1,2,4 (default 1,2)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent keep-alive clients in the throughput test")
    args = parser.parse_args()

    from featurestore import FeatureStore

    root = args.data_dir.resolve()
    setup(root, args.entities)
    store = FeatureStore(root)
    store.apply()
    t0 = time.perf_counter()
    store.materialize(None, None)
    print(f"materialized {args.entities:,} entities × 10 features in {time.perf_counter() - t0:.1f}s; Redis: {store.online_store.url}")
    client = store.online_store.client
    field = store.get_feature_view("stats").online_field
    rnd = random.Random(7)
    ids = {size: [[rnd.randint(1, args.entities) for _ in range(size)] for _ in range(500)] for size in SIZES}
    iterations = {1: 5000, 10: 3000, 100: 1000}

    rows = []
    print("\nSDK (in-process) vs raw redis-py pipelined HMGET, latency ms")
    for size in SIZES:
        batches = ids[size]
        k = iter(range(10**9))

        def sdk():
            batch = batches[next(k) % len(batches)]
            store.get_online_features({"user_id": batch}, features=FEATURES)

        def raw():
            batch = batches[next(k) % len(batches)]
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.hmget(b"fs:%s:{user_id=%d}" % (PROJECT.encode(), i), [field])
            pipe.execute()

        ours, ref = map(percentiles, paired(sdk, raw, iterations[size], args.seconds))
        rows.append(("sdk", size, ours, ref))
        print(f"  {size:>3} entities: ours p50 {ours['p50']:.3f} p99 {ours['p99']:.3f} p99.9 {ours['p99.9']:.3f} | "
              f"raw p50 {ref['p50']:.3f} p99 {ref['p99']:.3f} p99.9 {ref['p99.9']:.3f} | ratio p50 {ours['p50'] / ref['p50']:.2f}x p99 {ours['p99'] / ref['p99']:.2f}x")

    env = {**os.environ, "FEATURESTORE_DATA_DIR": str(store.config.data_dir), "BENCH_REDIS_URL": store.online_store.url,
           "BENCH_PROJECT": PROJECT, "BENCH_VIEW": store.get_feature_view("stats").online_field, "REDIS_URL": store.online_store.url, "PYTHONPATH": str(HERE)}
    ours_port, raw_port = free_port(), free_port()
    servers = [
        start([sys.executable, "-m", "featurestore.cli", "serve", "--repo", str(root), "--port", str(ours_port), "--log-level", "warning", "--no-access-log"], env, ours_port),
        start([sys.executable, "-m", "uvicorn", "raw_asgi:app", "--port", str(raw_port), "--log-level", "warning", "--no-access-log"], env, raw_port),
    ]
    try:
        ours_http, raw_http = HttpClient(ours_port), HttpClient(raw_port)
        print("\nHTTP (uvicorn, 1 worker, loopback) vs a plain-ASGI handler with the same Redis reads, latency ms")
        for size in SIZES:
            bodies = [orjson.dumps({"features": FEATURES, "entities": {"user_id": b}}) for b in ids[size]]
            k = iter(range(10**9))
            for _ in range(200):  # warm up both
                ours_http.post("/get-online-features", bodies[0])
                raw_http.post("/", bodies[0])
            ours, ref = map(percentiles, paired(lambda: ours_http.post("/get-online-features", bodies[next(k) % len(bodies)]),
                                                lambda: raw_http.post("/", bodies[next(k) % len(bodies)]), iterations[size], args.seconds))
            print(f"  {size:>3} entities: ours p50 {ours['p50']:.3f} p99 {ours['p99']:.3f} p99.9 {ours['p99.9']:.3f} | "
                  f"raw p50 {ref['p50']:.3f} p99 {ref['p99']:.3f} p99.9 {ref['p99.9']:.3f} | ratio p50 {ours['p50'] / ref['p50']:.2f}x p99 {ours['p99'] / ref['p99']:.2f}x")
        bodies = [orjson.dumps({"features": FEATURES, "entities": {"user_id": b}}) for b in ids[1]]
        print(f"\nthroughput, {args.clients} concurrent clients (one client process), 1 entity × 10 features; "
              f"client and servers share this machine's {os.cpu_count()} cores")
        for workers in args.workers:
            if workers > 1:  # fresh servers with that many worker processes
                for s in servers:
                    s.terminate()
                    s.wait(timeout=30)
                servers = [
                    start([sys.executable, "-m", "featurestore.cli", "serve", "--repo", str(root), "--port", str(ours_port), "--log-level", "warning",
                           "--no-access-log", "--workers", str(workers)], env, ours_port),
                    start([sys.executable, "-m", "uvicorn", "raw_asgi:app", "--port", str(raw_port), "--log-level", "warning", "--no-access-log",
                           "--workers", str(workers)], env, raw_port),
                ]
                time.sleep(2)
            # warm-up, discarded: a worker still importing (ours takes seconds) would count against its server
            for port, path in ((ours_port, "/get-online-features"), (raw_port, "/")):
                asyncio.run(throughput(port, path, bodies, args.clients, 2.0))
            ours_rps = asyncio.run(throughput(ours_port, "/get-online-features", bodies, args.clients, args.seconds))
            raw_rps = asyncio.run(throughput(raw_port, "/", bodies, args.clients, args.seconds))
            print(f"  {workers} worker(s): ours {ours_rps:,.0f} req/s, plain ASGI {raw_rps:,.0f} req/s (ours / plain {ours_rps / raw_rps:.2f}x)")
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=30)
        store.close()


if __name__ == "__main__":
    main()
