"""MLflow logging through our UI server against a real ``mlflow server`` (its SQLite backend and
proxied artifacts, the usual one-machine set-up) on this machine, in the same run, with the same
client: ``log_metric`` one request per step (as a training loop calls it), ``log_batch`` of
1,000 metrics, a 1 MB artifact, and reading a metric's history back.

    .venv-mlflow/bin/pip install mlflow==3.17.2   # the server, in a venv of its own
    python benchmarks/mlflow_tracking.py [--steps 1000] [--mlflow .venv-mlflow/bin/mlflow]

Prints each phase's time on both servers and their ratio (theirs / ours: above 1, ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

CLIENT = """
import json, os, sys, time
import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric

url, steps, artifact = sys.argv[1], int(sys.argv[2]), sys.argv[3]
mlflow.set_tracking_uri(url)
mlflow.set_experiment("bench")
client = MlflowClient()
times = {}
with mlflow.start_run() as run:
    mlflow.log_params({f"p{i}": i for i in range(20)})
    start = time.perf_counter()
    for step in range(steps):
        mlflow.log_metric("loss", 1 / (step + 1), step=step)
    times["log_metric"] = time.perf_counter() - start
    now = int(time.time() * 1000)
    start = time.perf_counter()
    for batch in range(10):
        metrics = [Metric(f"m{i % 10}", float(i), now, batch * 100 + i // 10) for i in range(1000)]
        client.log_batch(run.info.run_id, metrics=metrics)
    times["log_batch"] = time.perf_counter() - start
    start = time.perf_counter()
    mlflow.log_artifact(artifact)
    times["artifact"] = time.perf_counter() - start
start = time.perf_counter()
history = client.get_metric_history(run.info.run_id, "loss")
times["history"] = time.perf_counter() - start
assert len(history) == steps
print(json.dumps(times))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args[:3]} exited: {process.stderr.read()[-2000:] if process.stderr else ''}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit(f"{url} did not answer")


def measure(url: str, steps: int, artifact: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, url, str(steps), str(artifact)], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"the client failed against {url}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="log_metric calls (one request each)")
    parser.add_argument("--mlflow", default=str(ROOT / ".venv-mlflow" / "bin" / "mlflow"), help="mlflow's CLI")
    args = parser.parse_args()
    if not Path(args.mlflow).exists():
        raise SystemExit(
            f"no mlflow server at {args.mlflow}: python3.11 -m venv .venv-mlflow && "
            ".venv-mlflow/bin/pip install mlflow==3.17.2"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-mlflow-"))
    artifact = work / "weights.bin"
    artifact.write_bytes(os.urandom(1 << 20))
    repo = work / "repo"
    shutil.copytree(ROOT / "definitions", repo, ignore=shutil.ignore_patterns("data"))
    ours_port, theirs_port = free_port(), free_port()
    env = {**os.environ, "FEATURESTORE_DATA_DIR": str(work / "data")}
    subprocess.run(
        [sys.executable, "-m", "featurestore", "apply", "--repo", str(repo)], env=env, check=True, capture_output=True
    )
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "featurestore", "ui", "--repo", str(repo), "--port", str(ours_port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ),
        subprocess.Popen(
            [
                args.mlflow,
                "server",
                "--backend-store-uri",
                f"sqlite:///{work}/mlflow.db",
                "--artifacts-destination",
                str(work / "mlartifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(theirs_port),
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        ours, theirs = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{theirs_port}"
        wait(ours + "/ui/", servers[0])
        wait(theirs + "/health", servers[1])
        measure(ours, 50, artifact), measure(theirs, 50, artifact)  # warm both (imports, first requests)
        a, b = measure(ours, args.steps, artifact), measure(theirs, args.steps, artifact)
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    print(f"MLflow client, {args.steps} log_metric requests, 10 x log_batch(1,000), a 1 MB artifact, history read")
    print(f"{'phase':<12} {'ours (s)':>9} {'mlflow server (s)':>18} {'theirs/ours':>12}")
    for phase in a:
        print(f"{phase:<12} {a[phase]:>9.3f} {b[phase]:>18.3f} {b[phase] / a[phase]:>11.2f}x")
    print(
        f"log_metric: ours {args.steps / a['log_metric']:,.0f} requests/s, mlflow {args.steps / b['log_metric']:,.0f}"
    )


if __name__ == "__main__":
    main()
