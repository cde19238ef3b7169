"""What a view's values are, for people to look at (issue #30): per feature, its figures, a
histogram of history beside the served values on the same bins, and its rows, null rate, mean
and median over time; per service that serves it, the NOT_FOUND and null rates over time; the
drift reports recorded for it and each bucket's PSI against the whole span. Built from the statistics (``offline.statistics``), never from
the rows, and downsampled by merging neighbouring buckets (exact for counts and rates), so a year
costs what a few hundred points cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore.drift import read_drift, summary_drift
from featurestore.feature_logging import log_path, served_statistics
from featurestore.statistics import Summary, merged

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

HISTOGRAM_BINS = 20
TOP_VALUES = 12
DEFAULT_POINTS = 200


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
    history = store.statistics(view, since, until)
    served = {service: rows for service, rows in _served(store, view, since, until)}
    # what a service looks up of this view: its features, or for an aggregated view its aggregates
    looked_up = {
        svc: [r.split(":")[1] for r in store.definitions.service(svc).feature_refs() if r.split(":")[0] == view]
        for svc in served
    }
    out: list[dict[str, Any]] = []
    for name in features:  # stored values: history, beside what each service served of them
        mine = [(at, s) for at, column, s in history if column == name]
        if mine:
            serving = {svc: merged(x for x in rows if x[1] == name).get(name) for svc, rows in served.items()}
            out.append(_feature(name, "history", mine, {svc: s for svc, s in serving.items() if s is not None}, points))
    for svc, rows in served.items():  # served only (an aggregated view's aggregates): what was served
        for name in looked_up[svc]:
            mine = [(at, s) for at, column, s in rows if column == name]
            if mine and name not in features and name not in {f["name"] for f in out}:
                out.append(_feature(name, f"served by {svc}", mine, {}, points))
    return {
        "view": view,
        "features": out,
        "served": [
            {"service": svc, "features": looked_up[svc], "over_time": _served_over_time(rows, looked_up[svc], points)}
            for svc, rows in served.items()
        ],
        "drift": [
            r
            for r in read_drift(store.config.data_dir)
            if r.get("view") == view or _serves(r, [*features, *(n for names in looked_up.values() for n in names)])
        ],
    }


def _feature(
    name: str, source: str, buckets: list[tuple[datetime, Summary]], served: dict[str, Summary], points: int
) -> dict[str, Any]:
    """One feature's figures, histogram (``source``'s values beside each of ``served``) and buckets over time."""
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
    buckets = sorted(_by_bucket(buckets).items())
    step = max(1, math.ceil(len(buckets) / max(points, 1)))
    out = []
    for i in range(0, len(buckets), step):
        run = buckets[i : i + step]
        out.append((run[0][0], merged((at, "x", s) for at, s in run)["x"]))
    return out


def _by_bucket(buckets: Iterable[tuple[datetime, Summary]]) -> dict[datetime, Summary]:
    found: dict[datetime, Summary] = {}
    for at, s in buckets:
        found[at] = found[at].merge(s, in_place=True) if at in found else s.merge(Summary(s.kind))
    return found


def _histogram(history: Summary, served: dict[str, Summary]) -> dict[str, Any]:
    """Counts of ``history``'s values (``values``) and each of ``served`` on bins from ``history``."""
    if history.kind == "number":
        low, high = history.quantiles([0.005, 0.995]) or [0.0, 0.0]
        if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
            low, high = (history.min or 0.0), (history.max or 0.0) + 1.0
        edges = [float(e) for e in np.linspace(low, high, HISTOGRAM_BINS + 1)[1:-1]]
        return {
            "edges": [low, *edges, high],  # the first and last bins also hold what lies beyond
            "values": history.histogram(edges),
            "served": {svc: s.histogram(edges) for svc, s in served.items()},
        }
    categories = [value for value, _ in history.top(TOP_VALUES)]
    return {
        "categories": [*categories, "(other)"],
        "values": history.counts(categories),
        "served": {svc: s.counts(categories) for svc, s in served.items()},
    }


def _served(
    store: FeatureStore, view: str, since: datetime | None, until: datetime | None
) -> Iterable[tuple[str, list[tuple[datetime, str, Summary]]]]:
    """Each feature service looking up this view whose lookups are logged, with its log's statistics."""
    for service in store.definitions.feature_services.values():
        if not any(r.split(":")[0] == view for r in service.feature_refs()):
            continue
        name = f"service:{service.name}"
        if (log_path(store.config.data_dir, name) / "_delta_log").exists():
            yield service.name, served_statistics(store.config.data_dir, name, since, until)


def _served_over_time(
    rows: list[tuple[datetime, str, Summary]], features: list[str], points: int
) -> list[dict[str, Any]]:
    """Per (coarsened) hour: lookups, and the shares of the view's served values answered
    NOT_FOUND and null."""
    served = {c.removesuffix("__status") for _, c, _ in rows if c.endswith("__status")} & set(features)
    statuses = [
        (at, s) for at, column, s in rows if column.removesuffix("__status") in served and column.endswith("__status")
    ]
    values: dict[datetime, list[int]] = {}  # (rows, nulls) over features of any kind, per bucket
    for column in served:
        for at, s in coarsen([(at, s) for at, c, s in rows if c == column], points):
            counted = values.setdefault(at, [0, 0])
            counted[0], counted[1] = counted[0] + s.rows, counted[1] + s.nulls
    out = []
    for at, s in coarsen(statuses, points):
        answered = s.rows - s.nulls
        total, nulls = values.get(at, [0, 0])
        out.append(
            {
                "t": at.timestamp(),
                "lookups": s.rows // max(1, len(served)),  # (each lookup has a status per feature)
                "not_found_rate": dict(s.top(64)).get("NOT_FOUND", 0) / answered if answered else 0.0,
                "null_rate": nulls / total if total else None,
            }
        )
    return out


def _serves(report: dict[str, Any], features: list[str]) -> bool:
    return report.get("kind", "service") == "service" and any(
        f.get("name") in features for f in report.get("features", [])
    )


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those read as null (their counts are beside them)."""
    return value if value is not None and math.isfinite(value) else None
