"""What a view's values are, for people to look at (issue #30): per feature, its figures, a
histogram of history beside the served values and each registered model's training set on the
same bins, and its rows, null rate, mean, median and PSI against the whole span over time; per
service that serves it, the NOT_FOUND and null rates over time; the drift reports recorded for
it. Built from the statistics (``offline.statistics``), never from the rows, and downsampled by
merging neighbouring buckets (exact for counts and rates), so a year costs what a few hundred
points cost.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq

from featurestore.drift import read_drift, summary_drift
from featurestore.feature_logging import log_path, served_statistics_versioned
from featurestore.offline.statistics import LAG_COLUMN
from featurestore.statistics import Summary, from_table, merged, merged_by

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

HISTOGRAM_BINS = 20
TOP_VALUES = 12
DEFAULT_POINTS = 200
PROFILES_KEPT = 32  # profiles kept computed, by the statistics' versions they were computed from
_PROFILES: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
_PROFILES_LOCK = threading.Lock()


def view_profile(
    store: FeatureStore,
    view: str,
    since: datetime | None = None,
    until: datetime | None = None,
    points: int = DEFAULT_POINTS,
) -> dict[str, Any]:
    """The JSON the UI's view page draws (see the module's docstring); ``points``: the most a series holds."""
    definition = store.definitions.view(view)
    features = [f.name for f in definition.schema if f.name != getattr(definition, "event_id", None)]
    table = store.definitions.layout(view).history_table
    history_version, history = store.offline_store.statistics.versioned(table, since, until)
    served, versions = {}, []
    for service, (version, rows) in _served(store, view, since, until):
        served[service] = rows
        versions.append((service, version))
    # what a service looks up of this view: its features, or for an aggregated view its aggregates
    looked_up = {
        svc: [r.split(":")[1] for r in store.definitions.service(svc).feature_refs() if r.split(":")[0] == view]
        for svc in served
    }
    trained = _trained(store, view)
    # the same statistics (by version) and window: the same answer, kept (drift reports are read anew)
    datasets = tuple((name, str(path)) for name, path in trained.items())
    key = (str(store.config.data_dir), table, history_version, tuple(versions), datasets, since, until, points)
    with _PROFILES_LOCK:
        profile = _PROFILES.get(key)
    if profile is None:
        training = {name: merged(from_table(pq.read_table(path))) for name, path in trained.items()}
        lag = [(at, s) for at, column, s in history if column == LAG_COLUMN]
        profile = {
            "view": view,
            "features": _features(features, history, served, looked_up, training, points),
            # freshness over time: how long after their event time each day's rows were known
            "known_after": [
                {"t": at.timestamp(), **dict(zip(("p50", "p99"), [_finite(q) for q in s.quantiles([0.5, 0.99])]))}
                for at, s in coarsen(lag, points)
            ],
            "served": [
                {
                    "service": svc,
                    "features": looked_up[svc],
                    "over_time": _served_over_time(rows, looked_up[svc], points),
                }
                for svc, rows in served.items()
            ],
        }
        with _PROFILES_LOCK:
            _PROFILES[key] = profile
            while len(_PROFILES) > PROFILES_KEPT:
                _PROFILES.popitem(last=False)
    names = [*features, *(n for names in looked_up.values() for n in names)]
    drift = [r for r in read_drift(store.config.data_dir) if r.get("view") == view or _serves(r, names)]
    return {**profile, "drift": drift}


def _features(
    features: list[str],
    history: list[tuple[datetime, str, Summary]],
    served: dict[str, list[tuple[datetime, str, Summary]]],
    looked_up: dict[str, list[str]],
    training: dict[str, dict[str, Summary]],
    points: int,
) -> list[dict[str, Any]]:
    stored = _by_column(history)
    by_service = {svc: _by_column(rows) for svc, rows in served.items()}

    def beside(name: str) -> dict[str, Summary]:
        """What else to draw on the feature's bins: each service's served values, each model's training set."""
        found = {
            f"served by {svc}": merged((at, name, s) for at, s in cols[name])[name]
            for svc, cols in by_service.items()
            if name in cols
        }
        found.update(
            {f"training set of {model}": columns[name] for model, columns in training.items() if name in columns}
        )
        return found

    out: list[dict[str, Any]] = []
    for name in features:  # stored values: history, beside what was served and trained on
        if name in stored:
            out.append(_feature(name, "history", stored[name], beside(name), points))
    for svc, cols in by_service.items():  # served only (an aggregated view's aggregates): what was served
        for name in looked_up[svc]:
            if name in cols and name not in features and name not in {f["name"] for f in out}:
                others = {k: v for k, v in beside(name).items() if k != f"served by {svc}"}
                out.append(_feature(name, f"served by {svc}", cols[name], others, points))
    return out


def _trained(store: FeatureStore, view: str) -> dict[str, Path]:
    """Each registered model trained on a service that reads this view: its production version
    (else its latest), with the statistics file of the dataset it trained on, where that is here."""
    from featurestore.retrieval.export import STATISTICS_FILE

    found: dict[str, Path] = {}
    registry = store.model_registry()
    for name in registry.names():
        version = registry.aliases(name).get("production") or max(registry.versions(name), default=None)
        if version is None:
            continue
        card = registry.card(name, version)
        service = store.definitions.feature_services.get(card.get("feature_service") or "")
        if service is None or not any(r.split(":")[0] == view for r in service.feature_refs()):
            continue
        params_file = store.config.data_dir / "runs" / card["run"] / "params.json"  # (the local copy: no pull)
        params = json.loads(params_file.read_text()) if params_file.exists() else {}
        dataset = params.get("dataset_path") or params.get("config", {}).get("dataset")
        if dataset and (Path(dataset) / STATISTICS_FILE).exists():
            found[f"{name} v{version}"] = Path(dataset) / STATISTICS_FILE
    return found


def _feature(
    name: str, source: str, buckets: list[tuple[datetime, Summary]], served: dict[str, Summary], points: int
) -> dict[str, Any]:
    """One feature's figures, histogram (``source``'s values beside each of ``served``, by label)
    and buckets over time."""
    whole = merged((at, name, s) for at, s in buckets)[name]
    return {
        "name": name,
        "kind": whole.kind,
        "source": source,  # history (per event day) or a service's log (per hour served)
        "summary": figures(whole),
        "histogram": _histogram(whole, served),
        "over_time": [
            {
                "t": at.timestamp(),
                "psi": _finite(summary_drift(name, whole, s, math.inf).psi),  # this bucket against the whole span
                "rows": s.rows,
                "null_rate": s.null_rate,
                "mean": _finite(s.mean) if s.finite else None,
                "median": _finite(next(iter(s.quantiles([0.5])), None)),
            }
            for at, s in coarsen(buckets, points)
        ],
    }


def figures(s: Summary) -> dict[str, Any]:
    """A summary's figures as JSON (quartiles for numbers, top values for text)."""
    out: dict[str, Any] = {"rows": s.rows, "nulls": s.nulls, "null_rate": s.null_rate}
    if s.kind == "number":
        q = s.quantiles([0.01, 0.25, 0.5, 0.75, 0.99])
        out.update(
            nans=s.nans,
            min=_finite(s.min),
            max=_finite(s.max),
            mean=_finite(s.mean) if s.finite else None,
            stddev=_finite(s.stddev),
            quantiles=dict(zip(("p01", "p25", "p50", "p75", "p99"), [_finite(v) for v in q], strict=False)),
        )
    else:
        out["top"] = s.top(TOP_VALUES)
    return out


def coarsen(buckets: list[tuple[datetime, Summary]], points: int) -> list[tuple[datetime, Summary]]:
    """At most ``points`` buckets: each run of neighbours merged into its first one's time."""
    buckets = sorted(merged_by(buckets).items())
    step = max(1, math.ceil(len(buckets) / max(points, 1)))
    out = []
    for i in range(0, len(buckets), step):
        run = buckets[i : i + step]
        out.append((run[0][0], merged_by((0, s) for _, s in run)[0]))
    return out


def _by_column(found: Iterable[tuple[datetime, str, Summary]]) -> dict[str, list[tuple[datetime, Summary]]]:
    columns: dict[str, list[tuple[datetime, Summary]]] = {}
    for at, column, s in found:
        columns.setdefault(column, []).append((at, s))
    return columns


def _histogram(history: Summary, served: dict[str, Summary]) -> dict[str, Any]:
    """Counts of ``history``'s values (``values``) and of each of ``served`` (``beside``, by label)
    on bins from ``history``."""
    if history.kind == "number":
        low, high = history.quantiles([0.005, 0.995]) or [0.0, 0.0]
        if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
            low, high = (history.min or 0.0), (history.max or 0.0) + 1.0
        edges = [float(e) for e in np.linspace(low, high, HISTOGRAM_BINS + 1)[1:-1]]
        return {
            "edges": [low, *edges, high],  # the first and last bins also hold what lies beyond
            "values": history.histogram(edges),
            "beside": {label: s.histogram(edges) for label, s in served.items()},
        }
    categories = [value for value, _ in history.top(TOP_VALUES)]
    return {
        "categories": [*categories, "(other)"],
        "values": history.counts(categories),
        "beside": {label: s.counts(categories) for label, s in served.items()},
    }


def _served(
    store: FeatureStore, view: str, since: datetime | None, until: datetime | None
) -> Iterable[tuple[str, tuple[str | None, list[tuple[datetime, str, Summary]]]]]:
    """Each feature service looking up this view whose lookups are logged, with its log's statistics."""
    for service in store.definitions.feature_services.values():
        if not any(r.split(":")[0] == view for r in service.feature_refs()):
            continue
        name = f"service:{service.name}"
        if (log_path(store.config.data_dir, name) / "_delta_log").exists():
            yield service.name, served_statistics_versioned(store.config.data_dir, name, since, until)


def _served_over_time(
    rows: list[tuple[datetime, str, Summary]], features: list[str], points: int
) -> list[dict[str, Any]]:
    """Per (coarsened) hour: lookups, and the shares of the view's served values answered
    NOT_FOUND and null (counts added up: no sketch is merged)."""
    columns = _by_column(rows)
    served = sorted({c.removesuffix("__status") for c in columns if c.endswith("__status")} & set(features))
    hours = sorted({at for name in served for at, _ in columns[f"{name}__status"]})
    step = max(1, math.ceil(len(hours) / max(points, 1)))
    slot = {at: i // step for i, at in enumerate(hours)}
    # per slot: lookups' statuses, NOT_FOUND among them, values and null values
    counts = np.zeros((math.ceil(len(hours) / step), 4))
    for name in served:
        for at, s in columns[f"{name}__status"]:
            counts[slot[at], :2] += (s.rows - s.nulls, s.counts(["NOT_FOUND"])[0])
        for at, s in columns.get(name, []):
            if at in slot:
                counts[slot[at], 2:] += (s.rows, s.nulls)
    return [
        {
            "t": hours[i * step].timestamp(),
            "lookups": int(answered) // max(1, len(served)),  # (each lookup has a status per feature)
            "not_found_rate": float(not_found / answered) if answered else 0.0,
            "null_rate": float(nulls / values) if values else None,
        }
        for i, (answered, not_found, values, nulls) in enumerate(counts)
    ]


def _serves(report: dict[str, Any], features: list[str]) -> bool:
    return report.get("kind", "service") == "service" and any(
        f.get("name") in features for f in report.get("features", [])
    )


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those read as null (their counts are beside them)."""
    return value if value is not None and math.isfinite(value) else None
