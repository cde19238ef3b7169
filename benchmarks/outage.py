"""Redis outages under a request loop: how fast the feature server says 503, and how fast it recovers.

A real `featurestore serve` process and a real redis-server. A closed loop of lookups runs for
the whole script (bounded by time); meanwhile Redis is SIGSTOPped for 3 s (hung), resumed,
then killed with SIGKILL and restarted 2 s later on the same data. Prints, per phase, the
statuses seen, the slowest answer, and the time from Redis being back to the first 200.

    python benchmarks/outage.py [--read-timeout-ms 100]
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

DEFS = """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
events = PushSource(name="events", schema=[Field("card_id", Int64), Field("amount", Float64), Field("event_timestamp", UnixTimestamp)])
spend = FeatureView(name="spend", entities=[card], source=events, schema=[Field("amount", Float64)])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import argparse

    from featurestore import FeatureStore

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--read-timeout-ms", type=int, default=500)
    args = parser.parse_args()
    from featurestore.online.embedded import EmbeddedRedis

    root = Path(tempfile.mkdtemp(prefix="bench-outage-"))
    redis_server = EmbeddedRedis(root / "redis-data")
    url = redis_server.ensure_running()
    (root / "featurestore.yaml").write_text(
        f"project: bench_outage\nmodules: [features.py]\nonline_store: {{url: '{url}', read_timeout_ms: {args.read_timeout_ms}}}\n"
    )
    (root / "features.py").write_text(DEFS)
    with FeatureStore(root) as store:
        store.apply()
        store.push("events", {"card_id": [1], "amount": [1.0], "event_timestamp": [datetime.now(UTC)]}, to="online")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve",
            "--repo",
            str(root),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    samples: list[tuple[float, int, float]] = []  # (start, status, seconds)
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            body = {"features": ["spend:amount"], "entities": {"card_id": [1]}}
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = client.post("/get-online-features", json=body).status_code
                except httpx.HTTPError:
                    status = 0
                samples.append((t0, status, time.perf_counter() - t0))

    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        worker = threading.Thread(target=loop)
        worker.start()
        marks = {"start": time.perf_counter()}
        time.sleep(1)
        pid = redis_server.redis_pid()
        marks["stopped"] = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
        marks["resumed"] = time.perf_counter()
        time.sleep(2)
        marks["killed"] = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while redis_server.redis_pid() is not None:  # reaped by its supervisor, which then exits
            time.sleep(0.01)
        time.sleep(2)
        redis_server.ensure_running()
        marks["restarted"] = time.perf_counter()
        time.sleep(2)
        stop.set()
        worker.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
        redis_server.stop()

    def phase(name: str, lo: float, hi: float, back: float | None) -> None:
        inside = [s for s in samples if lo <= s[0] < hi]
        statuses = sorted({s[1] for s in inside})
        slowest = max((s[2] for s in inside), default=0.0) * 1000
        line = f"  {name:<22} {len(inside):>6} requests, statuses {statuses}, slowest {slowest:7.1f} ms"
        if back is not None:
            first_ok = next((s[0] + s[2] for s in samples if s[0] >= back and s[1] == 200), None)
            line += (
                f", first 200 {((first_ok - back) * 1000 if first_ok else float('nan')):7.1f} ms after Redis was back"
            )
        print(line)

    print(f"feature server under a request loop while Redis fails (read timeout {args.read_timeout_ms} ms):")
    phase("healthy", marks["start"], marks["stopped"], None)
    phase("hung (SIGSTOP, 3 s)", marks["stopped"], marks["resumed"], marks["resumed"])
    phase("killed (SIGKILL, 2 s)", marks["killed"], marks["restarted"], marks["restarted"])
    bad = [s for s in samples if s[1] not in (200, 503)]
    print(f"  answers other than 200/503: {len(bad)}")


if __name__ == "__main__":
    main()
