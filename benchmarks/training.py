"""Training throughput: the recipe on 1 process and on N (HSDP, and local SGD), same global batch.

A synthetic exported dataset (dense features, a string feature, a label that depends on them)
is trained with `featurestore train` for a few epochs; the script prints samples/s, the
validation AUC and wall time per layout. On a machine with a GPU, `--device cuda` adds a CUDA
run (NCCL when N > 1).

    python benchmarks/training.py [--rows 200000 --epochs 2 --procs 4 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def make_dataset(folder: Path, rows: int) -> Path:
    rng = np.random.default_rng(0)
    amount, risk = rng.exponential(50, rows), rng.normal(0, 1, rows)
    country = rng.choice(["FR", "DE", "US", "GB"], rows)
    label = ((amount > 80) & (country == "US")) | (risk > 1.2)
    start = datetime(2024, 1, 1, tzinfo=UTC)
    table = pa.table(
        {
            "event_timestamp": pa.array(
                [start + timedelta(seconds=i) for i in range(rows)], pa.timestamp("us", tz="UTC")
            ),
            "amount": amount,
            "country": country,
            "risk": risk,
            **{f"x{i}": rng.normal(0, 1, rows) for i in range(16)},
            "label": label.astype(np.int64),
        }
    )
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "data-00000.parquet", row_group_size=65536)
    features = ["v:amount", "v:country", "v:risk", *[f"v:x{i}" for i in range(16)]]
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "feature_service": "svc",
                "features": features,
                "definition_hashes": {},
                "manifest_hash": "bench",
                "files": [{"path": "data-00000.parquet"}],
            }
        )
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument(
        "--batch", type=int, default=2048, help="global batch (each of N ranks trains on batch/N of it)"
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    (root / "featurestore.yaml").write_text("project: bench_train\nmodules: []\n")
    dataset = make_dataset(root / "ds", args.rows)
    env = {**{k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}, "OMP_NUM_THREADS": "1"}
    layouts = [
        ("1 process", [], 1),
        (
            f"{args.procs} processes, HSDP 2 x {args.procs // 2}",
            ["--shard-group-size", str(args.procs // 2)],
            args.procs,
        ),
        (
            f"{args.procs} processes, HSDP, parameters held",
            ["--shard-group-size", str(args.procs // 2), "--hold-parameters"],
            args.procs,
        ),
        (
            f"{args.procs} processes, local SGD every 8 steps",
            ["--shard-group-size", str(args.procs // 2), "--sync-every", "8"],
            args.procs,
        ),
    ]
    print(
        f"training {args.rows:,} rows x {args.epochs} epochs, global batch {args.batch}, device {args.device} "
        f"({os.cpu_count()} CPUs)"
    )
    for name, extra, procs in layouts:
        started = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "featurestore.cli",
                "train",
                "--repo",
                str(root),
                "--dataset",
                str(dataset),
                "--epochs",
                str(args.epochs),
                "--device",
                args.device,
                "--batch-size",
                str(args.batch),  # the global batch, split across the ranks
                "--nproc-per-node",
                str(procs),
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode != 0:
            print(f"  {name}: failed\n{out.stderr[-2000:]}")
            continue
        run = out.stdout.split("run ", 1)[1].split(":", 1)[0]
        final = json.loads((root / "data" / "runs" / run / "final.json").read_text())
        print(
            f"  {name:42s} {final['train_samples_per_s']:>10,.0f} samples/s   val AUC {final['val_auc']:.4f}   "
            f"wall {time.perf_counter() - started:5.1f} s   peak MB per rank {final['peak_memory_mb']}"
        )


if __name__ == "__main__":
    main()
