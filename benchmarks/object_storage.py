"""History on S3 against local disk, same data, same run: materialize to history and a
point-in-time join, with the registry and history in a bucket of a local ``moto_server``
(loopback; moto is a Python server, so this bounds from above what a real S3 costs) and in
local folders. Prints seconds and the S3/local ratio for each.

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

DEFS = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

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


def repo(root: Path, source: pa.Table, storage: str) -> Path:
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "featurestore.yaml").write_text(f"project: bench_s3\nmodules: [features.py]\n{storage}")
    (root / "features.py").write_text(DEFS)
    pq.write_table(source, root / "data" / "source.parquet")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=200_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/featurestore-bench-s3"))
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
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
