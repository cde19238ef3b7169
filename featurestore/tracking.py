"""Training runs side by side: their parameters, final metrics and downsampled curves.

A run folder (``<data_dir>/runs/<id>``) holds ``params.json``, ``metrics.jsonl`` (one line per
step, written as training goes, so it can be read while the run is live) and ``final.json``.
Curves are downsampled with Largest-Triangle-Three-Buckets: a million-step curve becomes a few
hundred points that keep its shape (first and last points, spikes and dips).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np


def lttb(x: Sequence[float], y: Sequence[float], points: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest-Triangle-Three-Buckets (Steinarsson 2013): ``points`` of the series, first and last
    kept; from each bucket between them, the point making the largest triangle with the point kept
    before it and the mean of the next bucket."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(xs)
    if points >= n or points < 3:
        return xs, ys
    every = (n - 2) / (points - 2)  # points - 2 buckets over the interior
    keep = [0]
    for b in range(points - 2):
        lo, hi = int(b * every) + 1, int((b + 1) * every) + 1
        nxt_lo, nxt_hi = hi, min(int((b + 2) * every) + 1, n)
        next_x, next_y = xs[nxt_lo:nxt_hi].mean(), ys[nxt_lo:nxt_hi].mean()
        ax, ay = xs[keep[-1]], ys[keep[-1]]
        area = np.abs((ax - next_x) * (ys[lo:hi] - ay) - (ax - xs[lo:hi]) * (next_y - ay))
        keep.append(lo + int(np.argmax(area)))
    keep.append(n - 1)
    return xs[keep], ys[keep]


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's params, final metrics (if finished) and metric records."""
    run_dir = Path(run_dir)
    params = json.loads((run_dir / "params.json").read_text()) if (run_dir / "params.json").exists() else {}
    final = json.loads((run_dir / "final.json").read_text()) if (run_dir / "final.json").exists() else {}
    records = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # the line a live run is writing
                break
    return {"id": run_dir.name, "params": params, "final": final, "records": records}


def curve(run: dict[str, Any], metric: str, points: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric, downsampled to at most ``points``."""
    pairs = [(r["step"], r[metric]) for r in run["records"] if metric in r]
    if not pairs:
        return np.array([]), np.array([])
    steps, values = zip(*pairs)
    return lttb(steps, values, points)


def flat_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"config": {"epochs": 4}}`` -> ``{"config.epochs": 4}``, for side-by-side tables."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Parameters and final metrics of ``runs`` side by side; ``differs`` names what changed."""
    params = [flat_params(r["params"]) for r in runs]
    keys = sorted(set().union(*params))
    table = {k: [p.get(k) for p in params] for k in keys}
    finals = sorted(set().union(*(r["final"] for r in runs)))
    return {"runs": [r["id"] for r in runs], "params": table,
            "differs": [k for k, v in table.items() if len({json.dumps(x, sort_keys=True, default=str) for x in v}) > 1],
            "final": {k: [r["final"].get(k) for r in runs] for k in finals}}


def plot_compare(runs: list[dict[str, Any]], metrics: Sequence[str], out: Path, points: int = 500) -> Path:
    """Curves of each metric, runs overlaid, one panel per metric (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for run in runs:
            steps, values = curve(run, metric, points)
            if len(steps):
                ax.plot(steps, values, "o-" if len(steps) < 30 else "-", label=run["id"], alpha=0.8)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
