"""Model swaps under load: requests failed while a new version is promoted (goal 0).

The demo's fraud pipeline (small), a real `featurestore serve-model` process and a closed loop
of `/predict` requests from 4 threads; meanwhile new versions are promoted every second (and
rolled back once). Prints requests made, failures, how many answers came from each version,
and whether any answer went back to an older version after a newer one was served.

    python benchmarks/model_swap.py [--swaps 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from featurestore import FeatureStore
from featurestore.demo.generate import generate, load_demo
from featurestore.online.embedded import EmbeddedRedis
from featurestore.training.trainer import TrainConfig, train

DEFINITIONS = Path(__file__).resolve().parents[1] / "definitions"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=5)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    redis_server = EmbeddedRedis(data_dir / "redis")
    os.environ.update(FEATURESTORE_DATA_DIR=str(data_dir), REDIS_URL=redis_server.ensure_running())
    data = generate(n_cards=300, days=10, seed=3)
    with FeatureStore(DEFINITIONS) as store:
        load_demo(store, data, data_dir / "dataset")
        run = train(
            TrainConfig(dataset=str(data_dir / "dataset"), request_inputs=["amount"], epochs=1),
            data_dir / "runs",
            progress=False,
        )
        registry = store.model_registry()
        versions = [registry.register("fraud", run) for _ in range(args.swaps + 1)]
        registry.promote("fraud", versions[0], "production")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve-model",
            "--repo",
            str(DEFINITIONS),
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    answers: list[tuple[float, int]] = []  # (time, version or -status)
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                r = client.post("/predict", json={"instances": [{"card_id": 7, "merchant_id": 3, "amount": 120.0}]})
                answers.append(
                    (time.monotonic(), r.json()["model"]["version"] if r.status_code == 200 else -r.status_code)
                )

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        with FeatureStore(DEFINITIONS) as store:
            registry = store.model_registry()
            for version in versions[1:]:
                time.sleep(1.0)
                registry.promote("fraud", version, "production")
            time.sleep(1.0)
            registry.rollback("fraud")
            time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.terminate()
        server.wait(timeout=30)
        redis_server.stop()
    failed = [a for a in answers if a[1] < 0]
    by_version = Counter(v for _, v in answers if v > 0)
    print(
        f"{len(answers):,} /predict requests over {args.swaps} promotions and 1 rollback: {len(failed)} failed; "
        f"answers per version {dict(sorted(by_version.items()))}"
    )


if __name__ == "__main__":
    main()
