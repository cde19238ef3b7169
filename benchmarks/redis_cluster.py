"""Redis Cluster against a single Redis: SDK lookups of 1 and 100 entities × 10 features, the
servers' path (concurrent lookups on an event loop), and the write (materialization to Redis),
on the same machine in the same run.

The cluster is 3 masters + 3 replicas on this machine (``featurestore.online.local_cluster``);
the single Redis is a plain redis-server on TCP too, so both pay the same network stack. The
write is also timed to a single Redis with a replica: every write applied twice on the same
cores, as the cluster's replicas do; and there with ``wait_for_replicas: 1`` (every write call
waits for the replica: WAIT), materializing and writing one row at a time, alternating with the
same writes without it. Lookups alternate between the stores in blocks so drift hits both alike.

    python benchmarks/redis_cluster.py [--entities 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentiles  # noqa: E402

FEATURES = [f"f{i}" for i in range(10)]
DEFS = """
from datetime import timedelta
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
stats = FeatureView(name="stats", entities=[user], source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
                    schema=[Field(f"f{i}", Float64) for i in range(10)])
"""


def repo(root: Path, online: str, table: pa.Table) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "featurestore.yaml").write_text(f"project: bench_cluster\nmodules: [features.py]\nonline_store: {online}\n")
    (root / "features.py").write_text(DEFS)
    pq.write_table(table, root / "data" / "stats.parquet")
    return root


def redis_cpu(ports: list[int]) -> float:
    """CPU seconds the Redis servers on ``ports`` have used (``INFO cpu``: user + system)."""
    import redis

    total = 0.0
    for port in ports:
        info = redis.Redis(host="127.0.0.1", port=port).info("cpu")
        total += info["used_cpu_user"] + info["used_cpu_sys"]
    return total


async def served(store, refs: list[str], entities: int, seconds: float, concurrency: int = 64) -> tuple[float, float]:
    """Lookups of one entity on the event loop, ``concurrency`` at a time, as the feature server
    makes them: lookups a second and the p50 in ms."""
    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    reader, rng, took = OnlineReader(store.online_store), np.random.default_rng(1), []

    async def client() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            entity = {"user_id": [int(rng.integers(0, entities))]}
            query = OnlineQuery.prepare(store.definitions, store.config.project, entity, refs, None, False)
            t0 = time.perf_counter()
            await reader.read_async(query)
            took.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return len(took) / seconds, float(np.percentile(took, 50)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=200)
    args = parser.parse_args()

    import redis

    from featurestore import FeatureStore
    from featurestore.online.embedded import COMPACT_ENCODINGS, redis_server_binary
    from featurestore.online.local_cluster import free_ports, start_local_cluster, stop_local_cluster, wait_until

    rng = np.random.default_rng(0)
    n = args.entities
    table = pa.table(
        {
            "user_id": np.arange(n, dtype=np.int64),
            "event_timestamp": pa.array([datetime.now(UTC) - timedelta(hours=1)] * n, pa.timestamp("us", tz="UTC")),
            **{f: rng.normal(size=n) for f in FEATURES},
        }
    )
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    procs = start_local_cluster(work / "cluster")
    port, primary, replica = free_ports(3)
    plain = [redis_server_binary(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *COMPACT_ENCODINGS]
    servers = []
    for p, extra in ((port, []), (primary, []), (replica, ["--replicaof", "127.0.0.1", str(primary)])):
        (work / str(p)).mkdir()  # (a replica's first sync writes a dump there)
        servers.append(
            subprocess.Popen([*plain, "--port", str(p), "--dir", str(work / str(p)), *extra], stdout=subprocess.DEVNULL)
        )
    try:
        wait_until(lambda: redis.Redis(host="127.0.0.1", port=port).ping())
        wait_until(
            lambda: redis.Redis(host="127.0.0.1", port=replica).info("replication")["master_link_status"] == "up"
        )
        nodes = ", ".join(f"'127.0.0.1:{p}'" for p in list(procs)[:2])
        stores = {
            "single Redis": FeatureStore(repo(work / "single", f"{{url: 'redis://127.0.0.1:{port}'}}", table)),
            "Redis Cluster (3+3)": FeatureStore(
                repo(work / "cluster-repo", f"{{type: redis_cluster, nodes: [{nodes}]}}", table)
            ),
        }
        # the process's first materialization imports and sets up what every later one reuses: paid
        # here (a small one into another database), not by whichever store is timed first
        with FeatureStore(
            repo(work / "warm-up", f"{{url: 'redis://127.0.0.1:{port}/1'}}", table.slice(0, 1000))
        ) as warm:
            warm.apply()
            warm.materialize(None, datetime.now(UTC))
        replicated = FeatureStore(repo(work / "replicated", f"{{url: 'redis://127.0.0.1:{primary}'}}", table))
        waited = FeatureStore(
            repo(work / "waited", f"{{url: 'redis://127.0.0.1:{primary}/2', wait_for_replicas: 1}}", table)
        )
        writes, cpu = {}, {}
        servers_of = {
            "single Redis": [port],
            "Redis Cluster (3+3)": list(procs),
            "single Redis + replica": [primary, replica],
            "  … wait_for_replicas: 1": [primary, replica],
        }
        pairs = [*stores.items(), ("single Redis + replica", replicated), ("  … wait_for_replicas: 1", waited)]
        for name, store in pairs:
            store.apply()
            before = redis_cpu(servers_of[name])
            t0 = time.perf_counter()
            store.materialize(None, datetime.now(UTC))
            writes[name] = time.perf_counter() - t0
            cpu[name] = redis_cpu(servers_of[name]) - before
        one_row: dict[str, list[float]] = {"without": [], "with": []}  # (one-row writes, alternating)
        for i in range(400):
            for kind, store in (("without", replicated), ("with", waited)):
                row = table.slice(i, 1)
                t0 = time.perf_counter()
                store.write_to_online_store("stats", row)
                one_row[kind].append(time.perf_counter() - t0)
        refs = [f"stats:{f}" for f in FEATURES]
        timings = {(name, size): [] for name in stores for size in (1, 100)}
        for block in range(args.blocks):
            for size in (1, 100):
                for name, store in stores.items():
                    for _ in range(args.block_size):
                        ids = [int(i) for i in rng.integers(0, n, size)]
                        t0 = time.perf_counter()
                        store.get_online_features({"user_id": ids}, features=refs)
                        timings[(name, size)].append(time.perf_counter() - t0)
        rates: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
        for _ in range(2):
            for name, store in stores.items():
                rates[name].append(asyncio.run(served(store, refs, n, 2.0)))
        print(f"materialize {n:,} entities × 10 features to Redis:")
        for name, seconds in writes.items():
            print(
                f"  {name:<22} {seconds:6.2f} s  ({n / seconds:,.0f} rows/s); Redis CPU {cpu[name]:.2f} s, all its servers"
            )
        cluster = writes["Redis Cluster (3+3)"]
        print(
            f"  cluster / single: {cluster / writes['single Redis']:.2f}x; "
            f"cluster / single + replica: {cluster / writes['single Redis + replica']:.2f}x"
        )
        print(
            f"  wait_for_replicas: 1 / without: {writes['  … wait_for_replicas: 1'] / writes['single Redis + replica']:.2f}x"
        )
        a, b = percentiles(one_row["without"]), percentiles(one_row["with"])
        print(
            f"one-row writes to the single Redis + replica, p50 (p99): {a['p50']:.3f} ({a['p99']:.3f}) ms; with "
            f"wait_for_replicas: 1 {b['p50']:.3f} ({b['p99']:.3f}) ms: {b['p50'] / a['p50']:.2f}x p50"
        )
        print("SDK lookups, 10 features, p50 (p99):")
        for size in (1, 100):
            a, b = (percentiles(timings[(name, size)]) for name in stores)
            print(
                f"  {size:>3} entities: single {a['p50']:.3f} ({a['p99']:.3f}) ms   cluster {b['p50']:.3f} ({b['p99']:.3f}) ms   "
                f"ratio {b['p50'] / a['p50']:.2f}x p50, {b['p99'] / a['p99']:.2f}x p99"
            )
        print("the servers' path: lookups of 1 entity × 10 features on an event loop, 64 at a time, 2 runs of 2 s:")
        for name, runs in rates.items():
            print(f"  {name:<22} " + ", ".join(f"{rate:,.0f} lookups/s (p50 {p50:.2f} ms)" for rate, p50 in runs))
        ratios = [c[0] / s[0] for s, c in zip(*rates.values())]
        print(f"  cluster / single: {', '.join(f'{r:.2f}x' for r in ratios)} the lookups/s")
        for store in [*stores.values(), replicated, waited]:
            store.close()
    finally:
        for server in servers:
            server.kill()
        stop_local_cluster(procs)


if __name__ == "__main__":
    main()
