"""Online lookup latency: SDK and HTTP, against raw redis-py and a raw ASGI handler, same run.

Setup: 100k entities × 10 features (mixed types) materialized into Redis (embedded by
default, REDIS_URL to use another). Then, for 1, 10 and 100 entities per request:
  - SDK: ``store.get_online_features`` vs a raw pipelined HMGET of the same keys;
  - HTTP (uvicorn, 1 worker, loopback, closed loop over a keep-alive socket):
    ``POST /get-online-features`` vs the plain-ASGI handler in raw_asgi.py;
and throughput with 16 concurrent keep-alive clients at 1 and 2 server workers (``--workers 1,2,4``
where cores allow), ours and the plain handler in alternating one-second turns, with the CPU
each process used meanwhile: a server's requests per CPU-second show whether a worker lost
speed or only cores. Every loop is bounded by count and time.

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
from datetime import UTC, datetime, timedelta
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
    now = datetime.now(UTC)
    pq.write_table(
        pa.table(
            {
                "user_id": np.arange(1, n + 1),
                "event_timestamp": pa.array([now - timedelta(hours=1)] * n, pa.timestamp("us", tz="UTC")),
                "f1": rng.normal(size=n),
                "f2": rng.normal(size=n),
                "f3": rng.normal(size=n).astype(np.float32),
                "f4": rng.integers(0, 10**9, n),
                "f5": rng.integers(0, 10**9, n),
                "f6": rng.integers(0, 1000, n).astype(np.int32),
                "f7": pa.array(rng.integers(0, 1000, n).astype(str)),
                "f8": rng.random(n) < 0.5,
                "f9": rng.normal(size=n),
                "f10": pa.array(np.char.add("category-", rng.integers(0, 50, n).astype(str))),
            }
        ),
        root / "data" / "stats.parquet",
    )


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
        self.sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body)
        )
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


class _ClosedLoop(asyncio.Protocol):
    """One keep-alive connection sending its next request as soon as the previous answer is whole.
    A bare protocol (no stream reader, no header parsing beyond Content-Length) costs the client
    about half the CPU of asyncio streams: on a small host, the client's CPU is the servers' loss."""

    def __init__(self, request: bytes, stop: float, counter: list[int]):
        self.request, self.stop, self.counter, self.buffer = request, stop, counter, b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            self.buffer = buffer
            return
        head = buffer[:end].lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"{buffer[:300]!r}")
        at = head.index(b"content-length:") + 15
        eol = head.find(b"\r\n", at)
        length = int(head[at : eol if eol > 0 else None])
        if len(buffer) < end + 4 + length:
            self.buffer = buffer
            return
        self.buffer = buffer[end + 4 + length :]
        self.counter[0] += 1
        if time.perf_counter() < self.stop:
            self.transport.write(self.request)
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed.set_result(None)


async def throughput(port: int, path: str, bodies: list[bytes], clients: int, seconds: float) -> float:
    """Requests per second from ``clients`` closed-loop keep-alive connections, each its own entity."""
    loop = asyncio.get_running_loop()
    counter = [0]
    stop = time.perf_counter() + seconds
    t0 = time.perf_counter()
    connections = []
    for k in range(clients):
        body = bodies[k % len(bodies)]
        request = (
            b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body)
        )
        connections.append(
            (await loop.create_connection(lambda: _ClosedLoop(request, stop, counter), "127.0.0.1", port))[1]
        )
    await asyncio.gather(*(c.closed for c in connections))
    return counter[0] / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far (0 if it is gone)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        pass
    return total


def measured(
    port: int, path: str, bodies: list[bytes], clients: int, seconds: float, server_pid: int, redis_pid: int | None
) -> dict:
    """Throughput plus where the machine's CPU went meanwhile (cores busy: client, server, Redis)."""
    import uvloop

    before = time.process_time(), cpu_seconds(server_pid), cpu_seconds(redis_pid) if redis_pid else 0.0
    t0 = time.perf_counter()
    rps = uvloop.run(throughput(port, path, bodies, clients, seconds))
    wall = time.perf_counter() - t0
    after = time.process_time(), cpu_seconds(server_pid), cpu_seconds(redis_pid) if redis_pid else 0.0
    client, server, redis_cores = ((a - b) / wall for a, b in zip(after, before))
    return {
        "rps": rps,
        "client": client,
        "server": server,
        "redis": redis_cores,
        "per_core": rps / server if server else float("nan"),
    }


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
    parser.add_argument(
        "--workers",
        type=lambda text: [int(w) for w in text.split(",")],
        default=[1, 2],
        help="server worker counts to measure throughput at, e.g. 1,2,4 (default 1,2)",
    )
    parser.add_argument("--clients", type=int, default=16, help="concurrent keep-alive clients in the throughput test")
    args = parser.parse_args()

    from featurestore import FeatureStore

    root = args.data_dir.resolve()
    setup(root, args.entities)
    store = FeatureStore(root)
    store.apply()
    t0 = time.perf_counter()
    store.materialize(None, None)
    print(
        f"materialized {args.entities:,} entities × 10 features in {time.perf_counter() - t0:.1f}s; Redis: {store.online_store.url}"
    )
    client = store.online_store.client
    field = store.layout("stats").online_field
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
        print(
            f"  {size:>3} entities: ours p50 {ours['p50']:.3f} p99 {ours['p99']:.3f} p99.9 {ours['p99.9']:.3f} | "
            f"raw p50 {ref['p50']:.3f} p99 {ref['p99']:.3f} p99.9 {ref['p99.9']:.3f} | "
            f"ratio p50 {ours['p50'] / ref['p50']:.2f}x p99 {ours['p99'] / ref['p99']:.2f}x"
        )

    env = {
        **os.environ,
        "FEATURESTORE_DATA_DIR": str(store.config.data_dir),
        "BENCH_REDIS_URL": store.online_store.url,
        "BENCH_PROJECT": PROJECT,
        "BENCH_VIEW": store.layout("stats").online_field,
        "REDIS_URL": store.online_store.url,
        "PYTHONPATH": str(HERE),
    }
    ours_port, raw_port = free_port(), free_port()

    def servers_with(workers: int) -> list[subprocess.Popen]:
        """Ours via `featurestore serve`; the plain handler under the same worker supervisor (a
        listening socket per worker), so both spread connections over their workers alike."""
        raw = (
            [
                sys.executable,
                "-m",
                "uvicorn",
                "raw_asgi:app",
                "--port",
                str(raw_port),
                "--log-level",
                "warning",
                "--no-access-log",
            ]
            if workers == 1
            else [
                sys.executable,
                "-c",
                "from featurestore.serve_workers import serve; "
                f"serve('raw_asgi:app', workers={workers}, host='127.0.0.1', port={raw_port}, log_level='warning', access_log=False)",
            ]
        )
        return [
            start(
                [
                    sys.executable,
                    "-m",
                    "featurestore.cli",
                    "serve",
                    "--repo",
                    str(root),
                    "--port",
                    str(ours_port),
                    "--log-level",
                    "warning",
                    "--no-access-log",
                    "--workers",
                    str(workers),
                ],
                env,
                ours_port,
            ),
            start(raw, env, raw_port),
        ]

    servers = servers_with(1)
    try:
        ours_http, raw_http = HttpClient(ours_port), HttpClient(raw_port)
        print("\nHTTP (uvicorn, 1 worker, loopback) vs a plain-ASGI handler with the same Redis reads, latency ms")
        for size in SIZES:
            bodies = [orjson.dumps({"features": FEATURES, "entities": {"user_id": b}}) for b in ids[size]]
            k = iter(range(10**9))
            for _ in range(200):  # warm up both
                ours_http.post("/get-online-features", bodies[0])
                raw_http.post("/", bodies[0])
            ours, ref = map(
                percentiles,
                paired(
                    lambda: ours_http.post("/get-online-features", bodies[next(k) % len(bodies)]),
                    lambda: raw_http.post("/", bodies[next(k) % len(bodies)]),
                    iterations[size],
                    args.seconds,
                ),
            )
            print(
                f"  {size:>3} entities: ours p50 {ours['p50']:.3f} p99 {ours['p99']:.3f} p99.9 {ours['p99.9']:.3f} | "
                f"raw p50 {ref['p50']:.3f} p99 {ref['p99']:.3f} p99.9 {ref['p99.9']:.3f} | "
                f"ratio p50 {ours['p50'] / ref['p50']:.2f}x p99 {ours['p99'] / ref['p99']:.2f}x"
            )
        ours_http.sock.close()
        raw_http.sock.close()
        bodies = [orjson.dumps({"features": FEATURES, "entities": {"user_id": b}}) for b in ids[1]]
        embedded = getattr(store.online_store.transport, "embedded", None)  # (the embedded default: one node)
        redis_pid = embedded.redis_pid() if embedded else None
        print(
            f"\nthroughput, {args.clients} concurrent keep-alive clients (one client process), 1 entity × 10 features; "
            f"client, servers and Redis share this machine's {os.cpu_count()} cores (figures in cores: CPU-seconds per second)"
        )
        first: dict[str, float] = {}
        for workers in args.workers:
            if workers > 1:  # fresh servers with that many worker processes
                for s in servers:
                    s.terminate()
                    s.wait(timeout=30)
                servers = servers_with(workers)
                time.sleep(2)
            targets = {
                "ours": (ours_port, "/get-online-features", servers[0].pid),
                "plain": (raw_port, "/", servers[1].pid),
            }
            for port, path, _ in targets.values():
                asyncio.run(
                    throughput(port, path, bodies, args.clients, 2.0)
                )  # warm-up, discarded: a worker still importing would count
            # one-second turns, alternating which goes first, so a slow spell of the host hits both
            rounds: dict[str, list[dict]] = {"ours": [], "plain": []}
            for turn in range(max(1, round(args.seconds))):
                for name in ("ours", "plain") if turn % 2 == 0 else ("plain", "ours"):
                    rounds[name].append(
                        measured(*targets[name][:2], bodies, args.clients, 1.0, targets[name][2], redis_pid)
                    )
            runs = {name: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for name, rs in rounds.items()}
            for name, run in runs.items():
                first.setdefault(name, run["rps"])
                print(
                    f"  {workers} worker(s), {name:>5}: {run['rps']:>8,.0f} req/s ({run['rps'] / first[name]:.2f}x its 1st row) | "
                    f"cores busy: server {run['server']:.2f}, client {run['client']:.2f}, Redis {run['redis']:.2f} | "
                    f"{run['per_core']:,.0f} req per server CPU-second"
                )
            print(f"  {workers} worker(s): ours / plain {runs['ours']['rps'] / runs['plain']['rps']:.2f}x")
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=30)
        store.close()


if __name__ == "__main__":
    main()
