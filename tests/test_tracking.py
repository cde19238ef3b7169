"""Run comparison and curve downsampling (issue #16, first part)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore.tracking import compare, lttb, read_run


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
            area = abs((data[a][0] - avg_x) * (data[j][1] - data[a][1]) - (data[a][0] - data[j][0]) * (avg_y - data[a][1]))
            if area > best_area:
                best, best_area = j, area
        sampled.append(data[best])
        a = best
    sampled.append(data[-1])
    return sampled


@settings(max_examples=200, deadline=None)
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


def test_runs_compare_side_by_side(tmp_path):
    for name, lr, auc in (("a", 0.01, 0.91), ("b", 0.02, 0.93)):
        run = tmp_path / "data" / "runs" / name
        run.mkdir(parents=True)
        (run / "params.json").write_text(json.dumps({"config": {"learning_rate": lr, "epochs": 2}, "code_version": "x"}))
        (run / "final.json").write_text(json.dumps({"val_auc": auc}))
        (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "epoch": 0, "train_loss": math.exp(-s / 50)})
                                                     for s in range(1, 200)) + "\n{\"step\": 20")  # a live run's last, partial line
    runs = [read_run(tmp_path / "data" / "runs" / n) for n in ("a", "b")]
    table = compare(runs)
    assert table["differs"] == ["config.learning_rate"] and table["final"]["val_auc"] == [0.91, 0.93]
    (tmp_path / "featurestore.yaml").write_text("project: p\nmodules: []\n")
    out = subprocess.run([sys.executable, "-m", "featurestore", "runs", "compare", "a", "b", "--repo", str(tmp_path),
                          "--plot", str(tmp_path / "cmp.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "config.learning_rate" in out.stdout and "0.93" in out.stdout and (tmp_path / "cmp.png").stat().st_size > 1000
