"""Training runs: what each was given, what it measured, what it produced, side by side.

A run is a folder ``<data_dir>/runs/<id>``::

    run.json         when it started and finished (epoch seconds)
    params.json      config, dataset manifest hash, definition hashes, code version (written once)
    tags.json        labels, settable any time (``featurestore runs tag``)
    metrics/         the append-only metric store (``metric_store``), one writer per process
    artifacts.json   name -> SHA-256 of files kept in the content-addressed artifact store
    final.json       final metrics; present once the run finished
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.errors import NotFoundError, RequestError
from featurestore.files import atomic_write
from featurestore.tracking.artifacts import ArtifactStore
from featurestore.tracking.lttb import lttb
from featurestore.tracking.metric_store import SCHEMA, MetricWriter, read_metrics, writers


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else {}


class Run:
    """The writing side of one run in one process (``writer``: ``main``, or ``rank<r>``)."""

    def __init__(
        self, run_dir: Path, artifacts: ArtifactStore | None = None, writer: str = "main", **writer_options: Any
    ):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.artifacts = artifacts or ArtifactStore(self.dir.parent.parent / "artifacts")
        self.metrics = MetricWriter(self.dir, writer, **writer_options)
        if writer == "main" or writer == "rank0":  # (one writer of a distributed run keeps its times)
            record_times(self.dir, started=True)

    @property
    def id(self) -> str:
        return self.dir.name

    def log(self, step: int, **values: float) -> None:
        self.metrics.log(step, values)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Parameters are written once: a resumed run keeps what it started with."""
        if not (self.dir / "params.json").exists():
            atomic_write(self.dir / "params.json", json.dumps(params, indent=2, default=str).encode())

    def record_resume(self, entry: Mapping[str, Any]) -> None:
        """Note in the parameters that the run was resumed (where, on what layout): its lineage."""
        params = _json(self.dir / "params.json")
        params["resumes"] = [*params.get("resumes", []), dict(entry)]
        atomic_write(self.dir / "params.json", json.dumps(params, indent=2, default=str).encode())

    def set_tags(self, **tags: str) -> None:
        set_tags(self.dir, tags)

    def log_artifact(self, path: Path, name: str | None = None, link: bool = False) -> str:
        """Keep a file in the artifact store under its hash and list it in the run; returns the hash."""
        sha = self.artifacts.put(Path(path), link=link)
        listed = _json(self.dir / "artifacts.json")
        listed[name or Path(path).name] = {"sha256": sha, "bytes": Path(path).stat().st_size}
        atomic_write(self.dir / "artifacts.json", json.dumps(listed, indent=2).encode())
        return sha

    def finish(self, final: Mapping[str, Any]) -> None:
        self.metrics.close()
        atomic_write(self.dir / "final.json", json.dumps(final, indent=2).encode())
        record_times(self.dir, finished=True)

    def close(self) -> None:
        self.metrics.close()


def set_tags(run_dir: Path, tags: Mapping[str, str]) -> dict[str, str]:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise NotFoundError(f"no run {run_dir.name!r}; see `featurestore runs list`")
    merged = {**_json(run_dir / "tags.json"), **{str(k): str(v) for k, v in tags.items()}}
    atomic_write(run_dir / "tags.json", json.dumps(merged, indent=2).encode())
    return merged


def record_times(run_dir: Path, started: bool = False, finished: bool = False, at: float | None = None) -> None:
    """Note in ``run.json`` when the run started (once: a resumed run keeps its first start) or finished."""
    times = _json(run_dir / "run.json")
    now = time.time() if at is None else at
    if started and "started_at" in times and not finished:
        return  # (a resumed process: nothing to write)
    if started and "started_at" not in times:
        times["started_at"] = now
    if finished:
        times["finished_at"] = now
    atomic_write(run_dir / "run.json", json.dumps(times).encode())


def times(run_dir: Path) -> tuple[float, float | None]:
    """When a run started and finished (None: not yet); runs from before ``run.json``: its files' times."""
    recorded = _json(run_dir / "run.json")
    params, final = run_dir / "params.json", run_dir / "final.json"
    started = recorded.get("started_at") or (params if params.exists() else run_dir).stat().st_mtime
    finished = recorded.get("finished_at") or (final.stat().st_mtime if final.exists() else None)
    return started, finished


def summary(run_dir: Path) -> dict[str, Any]:
    """What a list of runs shows: id, status, start time and duration, tags, final metrics, key parameters."""
    run_dir = Path(run_dir)
    params, final = _json(run_dir / "params.json"), _json(run_dir / "final.json")
    started, finished = times(run_dir)
    status = _json(run_dir / "mlflow.json").get("status", "").lower()  # logged through MLflow's API: its status
    return {
        "id": run_dir.name,
        "status": status if status and status != "running" else "finished" if final else "unfinished",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": None if finished is None else round(max(finished - started, 0.0), 3),
        "tags": _json(run_dir / "tags.json"),
        "final": final,
        "feature_service": params.get("feature_service"),
        "dataset": params.get("config", {}).get("dataset"),
        "params": flat_params(params),  # (``config.learning_rate``: what a list's chosen columns show)
    }


def list_runs(root: Path, search: str = "", tags: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Runs newest first; ``search`` matches the id, tags or feature service; ``tags`` must all match."""
    root = Path(root)
    found = [summary(p) for p in root.iterdir() if p.is_dir()] if root.exists() else []
    needle = search.lower()
    found = [
        r
        for r in found
        if (not needle or needle in json.dumps([r["id"], r["tags"], r["feature_service"]]).lower())
        and all(r["tags"].get(k) == v for k, v in (tags or {}).items())
    ]
    return sorted(found, key=lambda r: (r["started_at"], r["id"]), reverse=True)


def read_run(run_dir: Path) -> dict[str, Any]:
    """Everything about a run but its metric records: params, tags, final metrics, artifacts,
    the metrics it logged and by which writers."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotFoundError(f"no run {run_dir.name!r}; see `featurestore runs list`")
    records = _records(run_dir, columns=["metric"])
    return {
        **summary(run_dir),
        "params": _json(run_dir / "params.json"),
        "artifacts": _json(run_dir / "artifacts.json"),
        "metrics": sorted(pc.unique(records["metric"]).to_pylist()),
        "writers": writers(run_dir) or (["main"] if records.num_rows else []),
    }


def _records(
    run_dir: Path, metric: str | None = None, writer: str | None = None, columns: list[str] | None = None
) -> pa.Table:
    if (run_dir / "metrics").exists():
        return read_metrics(run_dir, metric, writer, columns)
    return _legacy_records(run_dir, metric)


def _legacy_records(run_dir: Path, metric: str | None) -> pa.Table:
    """Runs tracked before the metric store: one JSON line per step in ``metrics.jsonl``."""
    rows: list[tuple[int, str, float]] = []
    file = run_dir / "metrics.jsonl"
    for line in file.read_text().splitlines() if file.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line a live run was writing
            break
        rows += [
            (record["step"], k, float(v))
            for k, v in record.items()
            if k not in ("step", "epoch") and (metric is None or k == metric) and isinstance(v, (int, float))
        ]
    steps, names, values = zip(*rows) if rows else ((), (), ())
    return pa.table(
        {
            "writer": pa.array(["main"] * len(rows), pa.string()),
            "step": pa.array(steps, pa.int64()),
            "wall_time": pa.array([math.nan] * len(rows), pa.float64()),
            "metric": pa.array(names, pa.string()),
            "value": pa.array(values, pa.float64()),
        },
        schema=SCHEMA.insert(0, pa.field("writer", pa.string())),
    )


X_AXES = ("step", "epoch", "samples", "wall_time")  # what a curve can be drawn against


def curve(run_dir: Path, metric: str, points: int = 500, writer: str | None = None, x: str = "step") -> dict[str, Any]:
    """One metric's curve downsampled to at most ``points`` (LTTB) with its raw length; from
    ``writer``, or the first writer that logged it (rank 0 in distributed runs). NaN steps are
    dropped. ``x``: against the step, the epoch (fractional, from the run's ``epoch`` metric),
    samples seen (step × the run's ``batch_size``) or wall time (seconds since the run started):
    runs with different batch sizes compare by samples, not steps."""
    run_dir = Path(run_dir)
    if x not in X_AXES:
        raise RequestError(f"a curve's x axis is one of {', '.join(X_AXES)}, not {x!r}")
    candidates: list[str | None] = [writer] if writer else [*writers(run_dir)] or [None]
    for candidate in candidates:
        records = _records(run_dir, metric, candidate, ["step", "wall_time", "value"])
        if records.num_rows:
            writer = candidate or "main"
            break
    steps = records["step"].to_numpy().astype(float)
    values = records["value"].to_numpy()
    keep = ~np.isnan(values)
    along = _x_values(run_dir, x, steps, records["wall_time"].to_numpy(), writer)
    xs, ys = lttb(along[keep], values[keep], points)
    return {
        "run": run_dir.name,
        "metric": metric,
        "writer": writer,
        "points": int(keep.sum()),
        "x": x,
        "xs": xs.tolist(),
        **({"steps": xs.tolist()} if x == "step" else {}),
        "values": ys.tolist(),
    }


def _x_values(run_dir: Path, x: str, steps: np.ndarray, wall: np.ndarray, writer: str | None) -> np.ndarray:
    if x == "step":
        return steps
    if x == "wall_time":
        if steps.size and np.isnan(wall).all():
            raise RequestError(f"run {run_dir.name} recorded no times (tracked before the metric store); use x=step")
        return wall - times(run_dir)[0]
    if x == "samples":
        params = _json(run_dir / "params.json")
        batch = (params.get("config") or {}).get("batch_size", params.get("batch_size"))
        try:
            return steps * float(batch)
        except (TypeError, ValueError):
            raise RequestError(f"run {run_dir.name} recorded no batch_size parameter; use x=step or x=epoch") from None
    epochs = _records(run_dir, "epoch", writer, ["step", "value"])
    if not epochs.num_rows:
        raise RequestError(f"run {run_dir.name} logged no epoch metric; use x=step or x=samples")
    return fractional_epochs(epochs["step"].to_numpy(), epochs["value"].to_numpy(), steps)


def fractional_epochs(marked_steps: np.ndarray, marked_epochs: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Each step's epoch as a fraction: epoch ``e`` (from the steps it was logged at) plus how far
    the step is through it, each epoch's length being its steps (the last one's: the one before)."""
    order = np.argsort(marked_steps, kind="stable")
    marked_steps, marked_epochs = marked_steps[order].astype(float), marked_epochs[order]
    epochs = np.unique(marked_epochs)
    firsts = np.array([marked_steps[marked_epochs == e].min() for e in epochs])
    lengths = np.diff(firsts, append=np.nan)
    if lengths.size:
        lengths[-1] = lengths[-2] if lengths.size > 1 else marked_steps.max() - firsts[-1] + 1
    at = np.clip(np.searchsorted(firsts, steps, side="right") - 1, 0, max(epochs.size - 1, 0))
    return epochs[at] + np.clip((steps - firsts[at]) / np.maximum(lengths[at], 1), 0, 1)


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
    """Parameters and final metrics of ``runs`` (``read_run``'s) side by side; ``differs`` names what
    changed, ``best`` which run is best on each metric whose name says which way is better."""
    params = [flat_params(r["params"]) for r in runs]
    keys = sorted(set().union(*params))
    table = {k: [p.get(k) for p in params] for k in keys}
    finals = sorted(set().union(*(r["final"] for r in runs)))
    final = {k: [r["final"].get(k) for r in runs] for k in finals}
    return {
        "runs": [r["id"] for r in runs],
        "params": table,
        "differs": [k for k, v in table.items() if len({json.dumps(x, sort_keys=True, default=str) for x in v}) > 1],
        "final": final,
        "best": {k: i for k, values in final.items() if (i := best_run(k, values)) is not None},
    }


LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "rmse", "logloss", "perplexity")
HIGHER_IS_BETTER = ("auc", "accuracy", "acc", "f1", "precision", "recall", "ap", "r2")


def best_run(metric: str, values: Sequence[Any]) -> int | None:
    """Which of ``values`` is best for ``metric``, by its name's last word (``val_loss``: lowest,
    ``val_auc``: highest); None when the name says neither or nothing is comparable."""
    words = metric.lower().replace("-", "_").replace("/", "_").split("_")
    lower = any(w in LOWER_IS_BETTER for w in words)
    if not lower and words[-1] not in HIGHER_IS_BETTER:
        return None
    numbers = [(v, i) for i, v in enumerate(values) if isinstance(v, (int, float)) and not math.isnan(v)]
    if len(numbers) < 2:
        return None
    return (min(numbers) if lower else max(numbers))[1]


def plot_compare(
    run_dirs: Sequence[Path], metrics: Sequence[str], out: Path, points: int = 500, x: str = "step"
) -> Path:
    """Curves of each metric, runs overlaid, one panel per metric (PNG), against ``x`` (``curve``'s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for run_dir in run_dirs:
            line = curve(run_dir, metric, points, x=x)
            if line["xs"]:
                ax.plot(
                    line["xs"],
                    line["values"],
                    "o-" if len(line["xs"]) < 30 else "-",
                    label=line["run"],
                    alpha=0.8,
                )
        ax.set_title(metric)
        ax.set_xlabel({"wall_time": "seconds since the run started", "samples": "samples seen"}.get(x, x))
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
