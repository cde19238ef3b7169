"""`featurestore demo`: the whole loop on embedded defaults, with figures at the end.

generate → apply → push history + materialize → export → train → register + promote →
start the inference server → replay held-out payments in time order, each as it happens
(predict it at its own time, then push it: the online windows update at once; history is
appended in batches) → AUC on the replayed payments from a point-in-time join vs as served, the
validation AUC, latency, and the consistency report.

The replay runs on the payments' clock: each /predict carries ``at`` (the payment's time,
less 1 µs, like the training rows), so windows online are evaluated exactly when the
training rows were.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.progress import Progress

from featurestore.consistency import ConsistencyReport, check_consistency, record_check
from featurestore.demo.generate import generate, label_rows
from featurestore.feature_store import FeatureStore
from featurestore.training.metrics import roc_auc
from featurestore.training.trainer import TrainConfig, train

console = Console()
MODEL = "fraud"
SERVICE = "fraud_model_v1"


@dataclass
class DemoResult:
    offline_auc: float  # validation split
    online_auc: float  # replayed payments, features as served
    replay_offline_auc: float  # the same payments, features from a point-in-time join
    latency_ms: dict[str, float]
    consistency: ConsistencyReport
    data_dir: Path


def _between(table: pa.Table, lo, hi) -> pa.Table:
    ts = table["event_timestamp"]
    return table.filter(pc.and_(pc.greater_equal(ts, pa.scalar(lo, ts.type)), pc.less(ts, pa.scalar(hi, ts.type))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(
    repo: Path,
    data_dir: Path | None = None,
    cards: int = 2000,
    days: int = 30,
    replay_days: float = 2,
    batch_hours: float = 2,
    seed: int = 7,
) -> DemoResult:
    data_dir = Path(data_dir or tempfile.mkdtemp(prefix="featurestore-demo-")).resolve()
    os.environ["FEATURESTORE_DATA_DIR"] = str(data_dir)
    console.rule("[bold]featurestore demo: card-payment fraud")
    console.print(f"data directory: {data_dir}")

    data = generate(n_cards=cards, days=days, seed=seed)
    end = data.transactions["event_timestamp"][-1].as_py() + timedelta(seconds=1)
    replay_start = end - timedelta(days=replay_days)
    first = data.profiles["event_timestamp"][0].as_py()
    history = _between(data.transactions, first, replay_start)
    heldout = _between(data.transactions, replay_start, end)
    console.print(
        f"generated {data.transactions.num_rows} payments ({pc.sum(data.transactions['label']).as_py()} fraudulent) "
        f"for {cards} cards; replaying the last {replay_days} days ({heldout.num_rows} payments)"
    )

    with FeatureStore(repo) as store:
        console.print(store.apply().describe())
        store.push("card_profiles", _between(data.profiles, first, replay_start))
        store.push("transactions", history.drop_columns(["label"]), to="offline")
        console.print(store.materialize_incremental(progress=True).describe())

        dataset = data_dir / "datasets" / "fraud-train"
        manifest = store.export_training_dataset(label_rows(history), SERVICE, dataset, progress=True)
        console.print(
            f"exported {manifest['row_count']} training rows → {dataset} (manifest {manifest['manifest_hash'][:12]})"
        )
        run = train(TrainConfig(dataset=str(dataset), request_inputs=["amount"], seed=seed), data_dir / "runs")
        registry = store.model_registry()
        version = registry.register(MODEL, run)
        registry.promote(MODEL, version, "production")
        offline_auc = registry.card(MODEL, version)["metrics"]["val_auc"]
        console.print(
            f"trained run {run.name}: validation AUC {offline_auc:.3f}; registered {MODEL} v{version} → production"
        )

        port = _free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "featurestore.cli",
                "serve-model",
                "--repo",
                str(repo),
                "--model",
                MODEL,
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            env={**os.environ, "FEATURESTORE_DATA_DIR": str(data_dir)},
        )
        try:
            scores, labels, latencies = _replay(store, server, port, data, heldout, replay_start, end, batch_hours)
        finally:
            server.send_signal(signal.SIGTERM)  # graceful: flushes the feature log
            server.wait(timeout=60)
        report = check_consistency(
            store, MODEL
        )  # each vector as served: the replay's as of event time (see the module doc)
        record_check(report, store.config.data_dir, MODEL)

    online_auc = roc_auc(np.array(labels), np.array(scores))
    with FeatureStore(repo) as store:
        replay_offline_auc = _offline_auc(store, heldout)
    lat = np.array(latencies) * 1000
    latency = {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "max": float(lat.max())}
    console.rule("[bold]results")
    console.print(
        f"AUC on the {len(labels):,} replayed payments: offline {replay_offline_auc:.3f} (features from a point-in-time "
        f"join, as in training)   online {online_auc:.3f} (features as served)   difference {online_auc - replay_offline_auc:+.3f}"
    )
    console.print(
        "  (each payment is scored with the windows as they stood just before it: every earlier payment pushed, "
        f"history appended every {batch_hours:g} h of replayed time)"
    )
    console.print(f"AUC offline on the validation split (earlier days, other payments): {offline_auc:.3f}")
    console.print(
        f"/predict latency over {len(lat)} requests: p50 {latency['p50']:.2f} ms, p99 {latency['p99']:.2f} ms"
    )
    console.print(report.describe())
    console.print(
        "[bold green]training and serving saw the same values[/]"
        if report.ok
        else "[bold red]skew found: see mismatches above[/]"
    )
    return DemoResult(offline_auc, online_auc, replay_offline_auc, latency, report, data_dir)


def _offline_auc(store: FeatureStore, heldout: pa.Table) -> float:
    """The production model's AUC on the replayed payments, features from a point-in-time join (the
    training path): what the online AUC is worth comparing with, on the same payments."""
    rows = label_rows(heldout)
    model = store.model_registry().load(MODEL, "production")
    joined = store.get_historical_features(rows.drop_columns(["label"]), feature_service=SERVICE).to_arrow()
    names = [ref.split(":")[1] for ref in store.get_feature_service(SERVICE).feature_refs()]
    inputs = [*names, *model.card["request_inputs"], *model.preprocessor.hashed]
    scores = model.predict({name: joined[name] for name in inputs})
    return roc_auc(rows["label"].to_numpy(), scores)


def _replay(store, server, port, data, heldout, start, end, batch_hours):
    base = f"http://127.0.0.1:{port}"
    schema = heldout.schema.remove(heldout.schema.get_field_index("label"))
    with httpx.Client(base_url=base, timeout=30) as client:
        deadline = time.time() + 120
        while True:
            if server.poll() is not None:
                raise RuntimeError("the inference server exited at start; see its output above")
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the inference server did not become healthy in 120 s")
            time.sleep(0.2)
        scores, labels, latencies = [], [], []
        step = timedelta(hours=batch_hours)
        profiles = sorted(_between(data.profiles, start, end).to_pylist(), key=lambda row: row["event_timestamp"])
        payments = heldout.to_pylist()
        pending: list[dict] = []  # pushed online, not yet appended to history
        flush_at = start + step
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("replaying", total=len(payments))
            for payment in payments:
                at = payment["event_timestamp"]
                while profiles and profiles[0]["event_timestamp"] < at:  # profile changes, as they happen
                    store.push("card_profiles", pa.Table.from_pylist([profiles.pop(0)], data.profiles.schema))
                if at >= flush_at:  # the history store takes batches
                    store.push("transactions", pa.Table.from_pylist(pending, schema), to="offline")
                    pending, flush_at = [], at + step
                label = payment.pop("label")
                instance = {k: payment[k] for k in ("card_id", "merchant_id", "amount")}
                when = (at - timedelta(microseconds=1)).isoformat()
                t0 = time.perf_counter()
                response = client.post("/predict", json={"instances": [instance], "at": when})
                latencies.append(time.perf_counter() - t0)
                response.raise_for_status()
                scores.append(response.json()["predictions"][0]["score"])
                labels.append(label)
                store.push("transactions", pa.Table.from_pylist([payment], schema), to="online")
                pending.append(payment)
                bar.advance(task)
            if pending:
                store.push("transactions", pa.Table.from_pylist(pending, schema), to="offline")
    return scores, labels, latencies
