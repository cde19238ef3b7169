"""History on S3 against local disk, same data, same run: materialize to history and a
point-in-time join, with the registry and history in a bucket of a local ``moto_server``
(loopback; moto is a Python server, so this bounds from above what a real S3 costs) and in
local folders. Prints seconds and the S3/local ratio for each.

Then the same commands once more through a counting proxy (``tests/s3_faults.py``, forwarding
everything): the object requests each makes, by kind, the bytes moved, and what they would cost
at S3 Standard's published request prices, with one day of pushes at 100 events/s extrapolated
from the requests of one drain commit.

    python benchmarks/object_storage.py [--rows 1000000 --entities 100000 --lookups 200000]
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from featurestore import FeatureStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.s3_faults import FaultyProxy, Request  # noqa: E402 (the repo's test helper, a plain proxy here)

# S3 Standard, us-east-1, USD per 1,000 requests (aws.amazon.com/s3/pricing, as of 2026)
PRICE_PER_1000 = {"PUT": 0.005, "POST": 0.005, "LIST": 0.005, "COPY": 0.005, "GET": 0.0004, "HEAD": 0.0004}
PUSH_DEFS = """
from datetime import timedelta
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
events = PushSource(
    name="events",
    schema=[Field("user_id", Int64), Field("amount", Float64), Field("event_timestamp", UnixTimestamp)],
    timestamp_field="event_timestamp",
)
last = FeatureView(name="last", entities=[user], source=events, schema=[Field("amount", Float64)], ttl=timedelta(days=1))
"""

DEFS = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64, UnixTimestamp

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
stats = FeatureView(
    name="stats", entities=[user], source=FileSource(path="data/source.parquet", timestamp_field="event_timestamp"),
    schema=[Field("f1", Float64), Field("f2", Float64), Field("f3", Int64)], online=False,
)
"""
START = datetime(2024, 1, 1, tzinfo=UTC)


def moto(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(root / "moto.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def repo(root: Path, source: pa.Table, storage: str, definitions: str = DEFS) -> Path:
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "featurestore.yaml").write_text(f"project: bench_s3\nmodules: [features.py]\n{storage}")
    (root / "features.py").write_text(definitions)
    pq.write_table(source, root / "data" / "source.parquet")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/featurestore-bench-s3"))
    parser.add_argument("--drains", type=int, default=60, help="push drain commits before the one counted")
    args = parser.parse_args()
    import shutil

    import boto3

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    rng = np.random.default_rng(7)
    source = pa.table(
        {
            "user_id": rng.integers(1, args.entities + 1, args.rows),
            "event_timestamp": pa.array(
                START.timestamp() * 1e6 + rng.integers(0, 30 * 86400 * 10**6, args.rows), pa.int64()
            ).cast(pa.timestamp("us", tz="UTC")),
            "f1": rng.random(args.rows),
            "f2": rng.random(args.rows),
            "f3": rng.integers(0, 1000, args.rows),
        }
    )
    entities = pd.DataFrame(
        {
            "user_id": rng.integers(1, args.entities + 1, args.lookups),
            "event_timestamp": START + pd.to_timedelta(rng.integers(0, 30 * 86400, args.lookups), unit="s"),
        }
    )
    server, endpoint = moto(args.dir)
    try:
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="b", aws_secret_access_key="b", region_name="us-east-1"
        ).create_bucket(Bucket="bench")
        s3 = (
            "registry: s3://bench/registry\noffline_store: {path: s3://bench/offline}\n"
            f"storage_options: {{AWS_ENDPOINT_URL: '{endpoint}', AWS_ACCESS_KEY_ID: b, AWS_SECRET_ACCESS_KEY: b}}\n"
        )
        timings: dict[str, dict[str, float]] = {}
        joined = {}
        for name, storage in (("local", ""), ("s3", s3)):
            store = FeatureStore(repo(args.dir / name, source, storage))
            store.apply()
            t = time.perf_counter()
            store.materialize(None, START + timedelta(days=31), online=False)
            materialize = time.perf_counter() - t
            t = time.perf_counter()
            joined[name] = store.get_historical_features(entities, ["stats:f1", "stats:f3"]).to_arrow()
            join = time.perf_counter() - t
            timings[name] = {"materialize to history": materialize, "point-in-time join": join}
            store.close()
        assert joined["local"].equals(joined["s3"]), "the two joins differ"
        print(f"{args.rows:,} source rows, {args.entities:,} entities, {args.lookups:,} entity rows joined")
        print(f"{'':28} {'local s':>9} {'S3 s':>9} {'S3/local':>9}")
        for what in timings["local"]:
            local, remote = timings["local"][what], timings["s3"][what]
            print(f"{what:28} {local:9.2f} {remote:9.2f} {remote / local:9.2f}")
        count_requests(args, source, entities, endpoint)
    finally:
        server.terminate()


def count_requests(args: argparse.Namespace, source: pa.Table, entities: pd.DataFrame, endpoint: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="b", aws_secret_access_key="b", region_name="us-east-1"
    ).create_bucket(Bucket="counted")
    proxy = FaultyProxy(endpoint)
    s3 = (
        "data_dir: s3://counted/data\n"
        f"storage_options: {{AWS_ENDPOINT_URL: '{proxy.url}', AWS_ACCESS_KEY_ID: b, AWS_SECRET_ACCESS_KEY: b}}\n"
    )
    rows: list[tuple[str, list[Request]]] = []
    try:
        store = FeatureStore(repo(args.dir / "counted", source, s3, DEFS + SERVICE))
        window = (None, START + timedelta(days=31))
        steps = [
            ("apply", store.apply),
            (f"materialize {args.rows:,} rows", lambda: store.materialize(*window, online=False)),
            ("materialize again (no new rows)", lambda: store.materialize(*window, online=False)),
            (
                f"join {args.lookups:,} entity rows",
                lambda: store.get_historical_features(entities, ["stats:f1"]).to_arrow(),
            ),
            ("export (the same join)", lambda: store.export_training_dataset(entities, "svc", "s3://counted/ds")),
        ]
        for name, step in steps:
            proxy.take()
            step()
            rows.append((name, proxy.take()))
        pushed = FeatureStore(push_repo(args.dir / "pushed", proxy.url))
        pushed.apply()
        events = pa.table(
            {
                "user_id": pa.array(range(500), pa.int64()),
                "amount": pa.array([1.0] * 500),
                "event_timestamp": pa.array([datetime.now(UTC)] * 500, pa.timestamp("us", tz="UTC")),
            }
        )
        for _ in range(args.drains):  # a history some commits old, as a day of pushes makes it
            pushed.push("events", events, to="offline")
            pushed.flush()
        proxy.take()
        pushed.push("events", events, to="offline")
        pushed.flush()  # one drain commit: what the buffer does every buffer_max_age (5 s) under steady pushes
        drain = proxy.take()
        rows.append((f"push drain commit #{args.drains + 1} (500 events)", drain))
        pushed.close()
        store.close()
    finally:
        proxy.close()
    kinds = ["GET", "HEAD", "LIST", "PUT", "POST", "DELETE"]
    print("\nobject requests per command (through a counting proxy), and their price at S3 Standard rates")
    print(f"{'':36}" + "".join(f"{k:>7}" for k in kinds) + f"{'MB up':>9}{'MB down':>9}{'USD':>10}")
    for name, seen in rows:
        counts = {k: sum(1 for r in seen if r.kind == k) for k in kinds}
        usd = sum(PRICE_PER_1000.get(k, 0) * n / 1000 for k, n in counts.items())
        up, down = sum(r.sent for r in seen) / 1e6, sum(r.received for r in seen) / 1e6
        print(f"{name:36}" + "".join(f"{counts[k]:>7}" for k in kinds) + f"{up:9.2f}{down:9.2f}{usd:10.6f}")
    per_day = 86400 / 5  # one drain commit per buffer_max_age at 100 events/s (500 events each)
    usd = sum(PRICE_PER_1000.get(r.kind, 0) / 1000 for r in drain) * per_day
    print(
        f"one day of pushes at 100 events/s: {len(drain) * per_day:,.0f} requests, about ${usd:.2f} in request charges"
    )


SERVICE = """
from featurestore import FeatureService
svc = FeatureService(name="svc", features=[stats])
"""


def push_repo(root: Path, endpoint: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "featurestore.yaml").write_text(
        "project: bench_push\nmodules: [features.py]\ndata_dir: s3://counted/push\n"
        f"storage_options: {{AWS_ENDPOINT_URL: '{endpoint}', AWS_ACCESS_KEY_ID: b, AWS_SECRET_ACCESS_KEY: b}}\n"
    )
    (root / "features.py").write_text(PUSH_DEFS)
    return root


if __name__ == "__main__":
    main()
