"""The web UI at scale: a 1M-step curve, a 500-view catalogue and a year of feature statistics,
through the API and in Chromium.

A run logs 1,000,000 steps through the metric store; a repo defines 500 views, and one more
(``year``) with 365 days of history and a year of served lookups (one log row per minute). The UI
runs as a server process. Timed, in the same run:
  - the curve API (read the run's segments, LTTB to 400 points) against the raw reference of
    shipping every point (the same records read and sent as JSON, as a naive UI would);
  - the catalogue API;
  - the view statistics API over the year (365 event days, 8,760 hours served, merged down to
    200 points a series): its first call (which summarizes the commits not covered yet) and later
    ones, against the raw reference of reading the year's history and log rows themselves;
  - in headless Chromium (when installed): from navigation to the chart drawn, to the 500-row
    catalogue drawn, and to the year's view page drawn.

    python benchmarks/ui.py [--steps 1000000] [--views 500] [--rows-per-day 2000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import percentiles  # noqa: E402
from featurestore.tracking import MetricWriter, read_metrics  # noqa: E402

YEAR = """
year = FeatureView(name="year", entities=[user], source=FileSource(path="data/year.parquet", timestamp_field="ts"),
                   schema=[Field("f_a", Float64), Field("f_b", Int64)], description="A year of history.")
from featurestore import FeatureService
year_service = FeatureService(name="year_service", features=[year])
"""
VIEW = """
v{i} = FeatureView(name="view_{i:03d}", entities=[user], source=FileSource(path="data/rows.parquet", timestamp_field="ts"),
                   schema=[Field("f_a", Float64), Field("f_b", Int64)], ttl=timedelta(days=1), owner="team-{team}",
                   description="Synthetic view {i} for the catalogue benchmark.", tags={{"domain": "d{team}"}})
"""


def make_repo(root: Path, views: int) -> None:
    (root / "data").mkdir(parents=True)
    pq.write_table(
        pa.table({"user_id": [1], "f_a": [1.0], "f_b": [1], "ts": pa.array([0], pa.timestamp("us", tz="UTC"))}),
        root / "data" / "rows.parquet",
    )
    (root / "featurestore.yaml").write_text("project: uibench\nmodules: [features.py]\n")
    body = (
        "from datetime import timedelta\nfrom featurestore import Entity, FeatureView, Field, FileSource\n"
        "from featurestore.types import Float64, Int64\nuser = Entity(name='user', join_keys=['user_id'], value_type=Int64)\n"
    )
    body += "".join(VIEW.format(i=i, team=i % 12) for i in range(views))
    body += YEAR
    (root / "features.py").write_text(body)


def make_year(root: Path, data_dir: Path, rows_per_day: int) -> tuple[Path, Path]:
    """A year of history for view ``year`` (its source file) and of its service's lookups (a
    served-vector log, one row a minute, as ``serve --log-features`` writes it)."""
    from deltalake import write_deltalake

    rng = np.random.default_rng(1)
    start = int(datetime(2025, 1, 1, tzinfo=UTC).timestamp() * 1e6)
    n = 365 * rows_per_day
    drift = np.repeat(np.linspace(0, 1, 365), rows_per_day)  # the values move over the year
    pq.write_table(
        pa.table(
            {
                "user_id": rng.integers(1, 100_000, n),
                "f_a": rng.normal(50 + 20 * drift, 10),
                "f_b": rng.poisson(3 + 2 * drift),
                "ts": pa.array(start + np.sort(rng.integers(0, 365 * 86_400_000_000, n)), pa.timestamp("us", tz="UTC")),
            }
        ),
        root / "data" / "year.parquet",
    )
    minutes = 365 * 24 * 60
    found = rng.random(minutes) > 0.02
    log = pa.table(
        {
            "served_at": pa.array(start + np.arange(minutes) * 60_000_000, pa.timestamp("us", tz="UTC")),
            "request_id": [f"r{i}" for i in range(minutes)],
            "replayed": np.zeros(minutes, bool),
            "user_id": rng.integers(1, 100_000, minutes),
            "f_a": pa.array(np.where(found, rng.normal(60, 10, minutes), np.nan), mask=~found),
            "f_a__status": np.where(found, "PRESENT", "NOT_FOUND"),
            "f_b": pa.array(rng.poisson(4, minutes), mask=~found),
            "f_b__status": np.where(found, "PRESENT", "NOT_FOUND"),
        }
    )
    path = data_dir / "feature_logs" / "services" / "year_service"
    write_deltalake(str(path), log, mode="append")
    return root / "data" / "year.parquet", path


def make_run(run_dir: Path, steps: int) -> float:
    """Log ``steps`` steps as a training loop would (one call per step); returns seconds taken."""
    rng = np.random.default_rng(0)
    loss = np.exp(-np.arange(steps) / (steps / 5)) + np.abs(np.cumsum(rng.normal(0, 0.001, steps)))
    started = time.perf_counter()
    with MetricWriter(run_dir, flush_rows=50_000) as writer:
        for step in range(steps):
            writer.log(step, {"train_loss": float(loss[step])})
    return time.perf_counter() - started


def timed(fn, repeat: int) -> dict[str, float]:
    fn()  # warm
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return percentiles(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--views", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rows-per-day", type=int, default=2000, help="History rows of view `year` per day.")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="featurestore-uibench-"))
    os.environ["FEATURESTORE_DATA_DIR"] = str(root / "store")
    try:
        make_repo(root / "repo", args.views)
        year_source, year_log = make_year(root / "repo", root / "store", args.rows_per_day)
        subprocess.run(
            [sys.executable, "-m", "featurestore", "apply", "--repo", str(root / "repo")],
            check=True,
            capture_output=True,
        )
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "featurestore",
                "materialize",
                "2024-12-31",
                "2026-01-01",
                "--view",
                "year",
                "--repo",
                str(root / "repo"),
            ],
            check=True,
            capture_output=True,
        )
        print(
            f"materialized a year of history ({365 * args.rows_per_day:,} rows) in {time.perf_counter() - started:.1f} s"
        )
        run_dir = root / "store" / "runs" / "big-run"
        logging_s = make_run(run_dir, args.steps)
        size = sum(p.stat().st_size for p in (run_dir / "metrics").rglob("*.parquet"))
        print(
            f"logged {args.steps:,} steps in {logging_s:.2f} s ({args.steps / logging_s:,.0f} steps/s); "
            f"{size / 1e6:.2f} MB on disk ({size / args.steps:.1f} bytes/step)"
        )

        port = 18765
        server = subprocess.Popen(
            [sys.executable, "-m", "featurestore", "ui", "--repo", str(root / "repo"), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}/ui"
        try:
            for _ in range(300):
                if server.poll() is not None:
                    raise SystemExit("the UI server exited; run `featurestore ui` by hand to see why")
                try:
                    httpx.get(base + "/static/app.js", timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            client = httpx.Client(timeout=120)
            curve = timed(
                lambda: client.get(
                    base + "/api/runs/big-run/curve", params={"metric": "train_loss", "points": 400}
                ).json(),
                args.repeat,
            )

            def every_point() -> None:  # what a UI without downsampling ships: every record as JSON
                table = read_metrics(run_dir, "train_loss")
                httpx.Response(
                    200, json={"steps": table["step"].to_pylist(), "values": table["value"].to_pylist()}
                ).read()

            raw = timed(every_point, max(2, args.repeat // 3))
            catalog = timed(lambda: client.get(base + "/api/catalog").json(), args.repeat)
            print(
                f"curve API, 1 metric of {args.steps:,} steps -> 400 points: p50 {curve['p50']:.0f} ms "
                f"(reference, every point as JSON, no server: {raw['p50']:.0f} ms: {raw['p50'] / curve['p50']:.1f}x the API's time)"
            )
            print(f"catalogue API, {args.views} views: p50 {catalog['p50']:.0f} ms")
            statistics = base + "/api/views/year/statistics"
            started = time.perf_counter()
            first = client.get(statistics)
            first.raise_for_status()
            first_s = time.perf_counter() - started
            later = timed(lambda: client.get(statistics).json(), args.repeat)
            points = max(len(f["over_time"]) for f in first.json()["features"])

            def every_row() -> None:  # the reference: the year's rows themselves, history and log
                pq.read_table(year_source)
                DeltaTable(str(year_log)).to_pyarrow_table()

            rows = timed(every_row, max(2, args.repeat // 3))
            print(
                f"view statistics API, a year (365 days of history, 8,760 hours served) -> {points} points a series: "
                f"first call {1000 * first_s:.0f} ms (summarizes the year's commits), then p50 {later['p50']:.0f} ms "
                f"(reference, reading the year's rows alone: {rows['p50']:.0f} ms)"
            )
            browser(base, args.views)
        finally:
            server.terminate()
            server.wait(10)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def browser(base: str, views: int) -> None:
    chromium = shutil.which("chromium")
    if not chromium:
        print("browser: no chromium here (apt-get install chromium) - skipped")
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        engine = p.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        page = engine.new_page(viewport={"width": 1280, "height": 900})
        for name, url, selector in (
            ("1M-step run page, curve drawn", f"{base}/#/runs/big-run", ".chart polyline"),
            (f"catalogue of {views} views drawn", f"{base}/", f"tr[data-view=view_{views - 1:03d}]"),
            (
                "a year's view page, every chart drawn",
                f"{base}/#/views/year",
                "[data-service=year_service] .chart polyline",
            ),
        ):
            times = []
            for _ in range(5):
                page.goto("about:blank")
                started = time.perf_counter()
                page.goto(url)
                page.wait_for_selector(selector)
                times.append(time.perf_counter() - started)
            print(f"browser: {name}: p50 {percentiles(times)['p50']:.0f} ms (navigation to drawn, 5 loads)")
        engine.close()


if __name__ == "__main__":
    main()
