"""Run comparison and curve downsampling (issue #16, first part)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore.tracking import MetricWriter, Run, compare, curve, lttb, read_metrics, read_run

from .conftest import examples


def reference_lttb(data: list[tuple[float, float]], threshold: int) -> list[tuple[float, float]]:
    """The algorithm as published (Steinarsson 2013, fig. 4.4), one point at a time."""
    if threshold >= len(data) or threshold < 3:
        return data
    sampled, every, a = [data[0]], (len(data) - 2) / (threshold - 2), 0
    for i in range(threshold - 2):
        start, end = int((i + 1) * every) + 1, min(int((i + 2) * every) + 1, len(data))
        avg_x = sum(p[0] for p in data[start:end]) / (end - start)
        avg_y = sum(p[1] for p in data[start:end]) / (end - start)
        lo, hi = int(i * every) + 1, int((i + 1) * every) + 1
        best, best_area = lo, -1.0
        for j in range(lo, hi):
            area = abs(
                (data[a][0] - avg_x) * (data[j][1] - data[a][1]) - (data[a][0] - data[j][0]) * (avg_y - data[a][1])
            )
            if area > best_area:
                best, best_area = j, area
        sampled.append(data[best])
        a = best
    sampled.append(data[-1])
    return sampled


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=3, max_size=400), st.integers(3, 60))
def test_lttb_matches_the_published_algorithm(values, points):
    xs = list(range(len(values)))
    got_x, got_y = lttb(xs, values, points)
    expected = reference_lttb(list(zip(map(float, xs), values)), points)
    assert list(zip(got_x.tolist(), got_y.tolist())) == expected
    assert len(got_x) == min(points, len(values)) and got_x[0] == 0 and got_x[-1] == len(values) - 1


def test_a_million_steps_keep_their_spikes():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 0.01, 1_000_000)
    values[123_456], values[654_321] = 5.0, -5.0
    x, y = lttb(np.arange(len(values)), values, 300)
    assert len(x) == 300 and 5.0 in y and -5.0 in y


def _write_run(run_dir, lr, auc, steps=200):
    run = Run(run_dir)
    run.log_params({"config": {"learning_rate": lr, "epochs": 2}, "code_version": "x"})
    for s in range(1, steps):
        run.log(s, train_loss=math.exp(-s / 50))
    run.finish({"val_auc": auc})


def test_runs_compare_side_by_side(tmp_path):
    for name, lr, auc in (("a", 0.01, 0.91), ("b", 0.02, 0.93)):
        _write_run(tmp_path / "data" / "runs" / name, lr, auc)
    runs = [read_run(tmp_path / "data" / "runs" / n) for n in ("a", "b")]
    table = compare(runs)
    assert table["differs"] == ["config.learning_rate"] and table["final"]["val_auc"] == [0.91, 0.93]
    (tmp_path / "featurestore.yaml").write_text("project: p\nmodules: []\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore",
            "runs",
            "compare",
            "a",
            "b",
            "--repo",
            str(tmp_path),
            "--plot",
            str(tmp_path / "cmp.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "config.learning_rate" in out.stdout and "0.93" in out.stdout and (tmp_path / "cmp.png").stat().st_size > 1000
    )


def test_runs_tracked_before_the_metric_store_still_read(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "epoch": 0, "train_loss": 1 / s}) for s in range(1, 50)) + '\n{"step": 50'
    )  # a live run's last, partial line
    line = curve(run, "train_loss", 10)
    assert line["points"] == 49 and line["steps"][0] == 1 and line["steps"][-1] == 49 and len(line["steps"]) == 10


WRITER = """
import sys
from featurestore.tracking.metric_store import MetricWriter
writer = MetricWriter(sys.argv[1], sys.argv[2], flush_rows=int(sys.argv[4]), flush_seconds=60, max_segments=4)
for step in range(int(sys.argv[3])):
    writer.log(step, {"loss": step * 0.5, "lr": 0.1})
writer.close()
"""


def test_concurrent_writers_and_a_reader_see_each_record_once_in_order(tmp_path):
    """Three ranks write at once (flushing and merging segments) while a reader keeps reading:
    every read holds, per writer, a gap-free prefix of its steps, and the end holds them all."""
    steps = 6000
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), f"rank{r}", str(steps), str(50 + 37 * r)])
        for r in range(3)
    ]
    reads = 0
    while any(p.poll() is None for p in procs) or reads == 0:
        table = read_metrics(tmp_path, "loss")
        for writer in set(table["writer"].to_pylist()):
            got = table.filter(pc.equal(table["writer"], writer))["step"].to_pylist()
            assert got == list(range(len(got))), writer
        reads += 1
    assert all(p.wait() == 0 for p in procs)
    table = read_metrics(tmp_path)
    assert table.num_rows == 3 * steps * 2 and sorted(set(table["writer"].to_pylist())) == ["rank0", "rank1", "rank2"]
    assert all(len(list((tmp_path / "metrics" / f"rank{r}").iterdir())) == 1 for r in range(3))  # merged on close
    assert reads > 1


def test_a_million_steps_are_compact_on_disk_and_curve_fast(tmp_path):
    rng = np.random.default_rng(1)
    values = np.cumsum(rng.normal(0, 1, 1_000_000))
    with MetricWriter(tmp_path, flush_rows=200_000) as writer:
        for start in range(0, len(values), 200_000):  # logged in blocks, as a fast loop would flush
            writer._columns = {
                "step": list(range(start, start + 200_000)),
                "wall_time": [1.7e9 + i * 0.01 for i in range(start, start + 200_000)],
                "metric": ["loss"] * 200_000,
                "value": values[start : start + 200_000].tolist(),
            }
            writer.flush()
    size = sum(p.stat().st_size for p in (tmp_path / "metrics").rglob("*.parquet"))
    assert size < 12 * 1_000_000  # random-walk floats barely compress; steps and times nearly vanish
    line = curve(tmp_path, "loss", 500)
    assert line["points"] == 1_000_000 and len(line["steps"]) == 500
    assert line["values"][0] == values[0] and line["values"][-1] == values[-1]
    assert values.max() in line["values"] and values.min() in line["values"]


def test_a_run_knows_how_long_it_took_and_a_resume_keeps_its_start(tmp_path):
    """Start and finish are recorded (not read from files a resume rewrites): the list shows the
    duration between them, whatever the files' times say."""
    import os

    from featurestore.tracking.runs import list_runs, times

    run = Run(tmp_path / "runs" / "r1")
    run.log_params({"config": {"epochs": 1}})
    started, finished = times(run.dir)
    assert finished is None and list_runs(tmp_path / "runs")[0]["duration_s"] is None
    run.record_resume({"world": 2})  # rewrites params.json, whose time once stood for the start
    os.utime(run.dir / "params.json", (started + 3600, started + 3600))
    again = Run(tmp_path / "runs" / "r1")  # the resumed process
    again.finish({"loss": 0.1})
    recorded_start, recorded_finish = times(run.dir)
    assert recorded_start == started and recorded_finish is not None
    listed = list_runs(tmp_path / "runs")[0]
    assert listed["status"] == "finished" and listed["duration_s"] == round(recorded_finish - started, 3)


def test_runs_list_has_a_duration_column():
    from featurestore.cli import _duration

    assert [_duration(s) for s in (None, 4.26, 95.2, 3599.6, 7300)] == ["–", "4.3s", "1m 35s", "1h 00m", "2h 01m"]


def test_compare_marks_the_best_run_by_what_the_metric_name_says():
    from featurestore.tracking.runs import best_run

    runs = [
        {"id": "a", "params": {"lr": 0.1}, "final": {"val_loss": 0.30, "val_auc": 0.91, "epochs_seen": 3}},
        {"id": "b", "params": {"lr": 0.2}, "final": {"val_loss": 0.25, "val_auc": 0.89, "epochs_seen": 5}},
        {"id": "c", "params": {"lr": 0.3}, "final": {"val_loss": float("nan"), "val_auc": 0.93}},
    ]
    assert compare(runs)["best"] == {"val_loss": 1, "val_auc": 2}  # lowest loss, highest AUC, NaN never best
    assert best_run("train/error-rate", [0.2, 0.1]) == 1 and best_run("accuracy", [0.7, 0.9]) == 1
    assert best_run("steps", [1, 2]) is None and best_run("val_auc", [0.5, None]) is None


def test_curves_against_epoch_samples_and_wall_time(tmp_path):
    import pytest

    from featurestore.errors import RequestError
    from featurestore.tracking.runs import record_times

    def make(name: str, batch: int | None, steps_per_epoch: int):
        run = tmp_path / name
        run.mkdir()
        (run / "params.json").write_text(json.dumps({"config": {"batch_size": batch}} if batch else {}))
        record_times(run, started=True, at=1000.0)
        with MetricWriter(run) as writer:
            for step in range(1, 3 * steps_per_epoch + 1):
                epoch = (step - 1) // steps_per_epoch
                writer.log(step, {"train_loss": 1.0 / step, "epoch": epoch}, wall_time=1000.0 + 0.5 * step)
        return run

    small, large = make("small", 64, 40), make("large", 256, 10)  # the same 2,560 samples an epoch
    for run, batch in ((small, 64), (large, 256)):
        line = curve(run, "train_loss", 1000, x="samples")
        assert line["x"] == "samples" and line["xs"] == [batch * s for s in range(1, len(line["xs"]) + 1)]
        assert line["xs"][-1] == 3 * 2560  # both runs end at the same samples seen, not the same step
        wall = curve(run, "train_loss", 1000, x="wall_time")
        assert wall["xs"] == [0.5 * s for s in range(1, len(wall["xs"]) + 1)]  # seconds since the recorded start
    epochs = curve(small, "train_loss", 1000, x="epoch")["xs"]
    assert (
        epochs[0] == 0
        and epochs[40] == 1
        and epochs[20] == pytest.approx(0.5)
        and epochs[-1] == pytest.approx(3 - 1 / 40)
    )
    assert epochs == sorted(epochs)
    unknown = make("unknown", None, 5)
    with pytest.raises(RequestError, match="batch_size"):
        curve(unknown, "train_loss", x="samples")
    with pytest.raises(RequestError, match="x axis"):
        curve(small, "train_loss", x="tokens")
