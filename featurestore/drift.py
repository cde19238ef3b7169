"""Drift (issue #30): per feature, the population stability index and the Jensen–Shannon
distance over bins taken from the expected side (deciles for numbers, categories for text, each
with a bin for the rest), beside the null rate on both sides and, served, the share of lookups
answered NOT_FOUND. Two comparisons:

- a **feature service**: the exported training dataset (``data-00000.parquet`` beside its
  manifest) against the service's logged lookups (``featurestore serve --log-features``),
  optionally over a recent window only; exact, from the rows;
- a **view**: its history's recent event days against the days before (``view_drift``), from
  the history's statistics (``offline.statistics``: KLL quantiles, top values), so a year of
  history is compared without reading it.

A feature is flagged past its threshold (``monitoring:`` in featurestore.yaml, per view or
service; 0.2 is the usual "the population moved" mark, 0.1 "watch it"); ``featurestore monitor``
exits 1 when any is, and records its report (``<data_dir>/drift/``), which the feature server's
``/metrics`` exports for alerting.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError
from featurestore.feature_logging import log_path, read_log
from featurestore.files import atomic_write
from featurestore.statistics import DAY, Summary, bucket_start, merged

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

PSI_THRESHOLD = 0.2
BINS = 10
FLOOR = 1e-4  # an empty bin's share in PSI (log of 0 otherwise): the usual convention


@dataclass
class FeatureDrift:
    name: str
    expected_rows: int  # training rows, or the baseline window's
    actual_rows: int  # served rows, or the recent window's
    psi: float
    js_distance: float
    expected_null_rate: float
    actual_null_rate: float
    not_found_rate: float | None  # served only
    flagged: bool


@dataclass
class DriftReport:
    subject: str  # the feature service or view
    kind: Literal["service", "view"]
    compared: str  # what is compared with what, in words
    since: datetime | None
    psi_threshold: float
    features: list[FeatureDrift] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.flagged for f in self.features)

    def describe(self) -> str:
        sides = ("train", "served") if self.kind == "service" else ("before", "recent")
        lines = [f"Drift of {self.kind} {self.subject!r}: {self.compared}:"]
        lines.append(
            f"  {'feature':<28} {'PSI':>7} {'JS dist':>8} {'null ' + sides[0]:>11} {'null ' + sides[1]:>11} {'NOT_FOUND':>9}"
        )
        for f in self.features:
            mark = "  << drifted" if f.flagged else ""
            not_found = f"{f.not_found_rate:9.1%}" if f.not_found_rate is not None else f"{'-':>9}"
            lines.append(
                f"  {f.name:<28} {f.psi:7.3f} {f.js_distance:8.3f} {f.expected_null_rate:11.1%} "
                f"{f.actual_null_rate:11.1%} {not_found}{mark}"
            )
        flagged = [f.name for f in self.features if f.flagged]
        lines.append(
            f"{len(flagged)} of {len(self.features)} features past PSI {self.psi_threshold:g}"
            + (f": {', '.join(flagged)}" if flagged else "")
        )
        return "\n".join(lines)


def population_stability(expected: np.ndarray, actual: np.ndarray) -> float:
    """PSI of two histograms over the same bins: sum of (a - e) * ln(a / e) over their shares."""
    e, a = _shares(expected), _shares(actual)
    e, a = np.maximum(e, FLOOR), np.maximum(a, FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


def jensen_shannon(p: np.ndarray, q: np.ndarray) -> float:
    """The Jensen–Shannon distance (square root of the divergence, base 2: 0 same, 1 disjoint)."""
    p, q = _shares(p), _shares(q)
    m = (p + q) / 2

    def kl(x: np.ndarray) -> float:
        nonzero = x > 0
        return float(np.sum(x[nonzero] * np.log2(x[nonzero] / m[nonzero])))

    return math.sqrt(max((kl(p) + kl(q)) / 2, 0.0))


def histograms(train: pa.Array, served: pa.Array, bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """Counts of both sides' non-null values over bins from the training values: numbers by its
    deciles (a bin each for NaN), text and booleans by its categories (the rest in one bin)."""
    train, served = pc.drop_null(train), pc.drop_null(served)
    if pa.types.is_floating(train.type) or pa.types.is_integer(train.type):
        t = train.to_numpy(zero_copy_only=False).astype(float)
        s = served.to_numpy(zero_copy_only=False).astype(float)
        finite = t[np.isfinite(t)]
        edges = np.unique(np.quantile(finite, np.linspace(0, 1, bins + 1)[1:-1])) if finite.size else np.array([])

        def count(x: np.ndarray) -> np.ndarray:
            real = x[~np.isnan(x)]
            return np.append(
                np.bincount(np.searchsorted(edges, real, side="right"), minlength=edges.size + 1), np.isnan(x).sum()
            )

        return count(t), count(s)
    categories = {v: i for i, v in enumerate(pc.unique(train).to_pylist())}
    other = len(categories)

    def tally(x: pa.Array) -> np.ndarray:
        codes = np.array([categories.get(v, other) for v in x.to_pylist()], dtype=np.int64)
        return np.bincount(codes, minlength=other + 1)

    return tally(train), tally(served)


def feature_drift(
    name: str, train: pa.Array, served: pa.Array, statuses: pa.Array | None, psi_threshold: float = PSI_THRESHOLD
) -> FeatureDrift:
    expected, actual = histograms(train, served)
    not_found = 0
    if statuses is not None:
        not_found = pc.sum(pc.equal(statuses, "NOT_FOUND")).as_py() or 0
    rates = (_rate(train.null_count, len(train)), _rate(served.null_count, len(served)))
    return _compared(
        name, expected, actual, (len(train), len(served)), rates, _rate(not_found, len(served)), psi_threshold
    )


def service_drift(
    store: FeatureStore,
    service: str,
    dataset: Path,
    since: timedelta | None = None,
    psi_threshold: float = PSI_THRESHOLD,
) -> DriftReport:
    """Each of ``service``'s features: the exported ``dataset`` against the service's feature log."""
    from featurestore.retrieval.export import DATA_FILE, MANIFEST_FILE

    dataset = Path(dataset)
    folder = dataset.parent if dataset.name == MANIFEST_FILE else dataset
    if not (folder / DATA_FILE).exists():
        raise FeatureStoreError(f"no exported dataset at {dataset} (no {DATA_FILE}); pass the folder an export wrote")
    train = pq.read_table(folder / DATA_FILE)
    served = read_log(log_path(store.config.data_dir, f"service:{service}"))
    start = datetime.now(UTC) - since if since is not None else None
    if start is not None:
        served = served.filter(
            pc.greater_equal(served["served_at"], pa.scalar(start, served.schema.field("served_at").type))
        )
    window = f"since {start:%Y-%m-%d %H:%M} UTC" if start else "all logged lookups"
    report = DriftReport(service, "service", f"training dataset against served values ({window})", start, psi_threshold)
    for ref in store.get_feature_service(service).feature_refs():
        name = ref.split(":")[1]
        if name not in train.column_names or name not in served.column_names:
            continue  # (a feature added since the export: nothing to compare it with)
        statuses = served[f"{name}__status"].combine_chunks() if f"{name}__status" in served.column_names else None
        report.features.append(
            feature_drift(name, train[name].combine_chunks(), served[name].combine_chunks(), statuses, psi_threshold)
        )
    if not report.features:
        raise FeatureStoreError(f"the dataset at {dataset} and {service!r}'s log share no feature")
    return report


def summary_drift(name: str, expected: Summary, actual: Summary, psi_threshold: float) -> FeatureDrift:
    """``feature_drift`` from two statistics summaries: numbers binned at the expected side's
    deciles (from its KLL sketch) with a bin for NaN, text over its top values and the rest."""
    if expected.kind == "number":
        edges = sorted(set(expected.quantiles(list(np.linspace(0, 1, BINS + 1)[1:-1]))))
        e = np.array([*expected.histogram(edges), expected.nans])
        a = np.array([*actual.histogram(edges), actual.nans])
    else:
        categories = [value for value, _ in expected.top(64)]
        e, a = np.array(expected.counts(categories)), np.array(actual.counts(categories))
    rows, rates = (expected.rows, actual.rows), (expected.null_rate, actual.null_rate)
    return _compared(name, e, a, rows, rates, None, psi_threshold)


def _compared(
    name: str,
    expected: np.ndarray,
    actual: np.ndarray,
    rows: tuple[int, int],
    null_rates: tuple[float, float],
    not_found_rate: float | None,
    psi_threshold: float,
) -> FeatureDrift:
    """Two histograms on the same bins compared: PSI and JS distance (NaN when a side is empty)."""
    comparable = expected.sum() > 0 and actual.sum() > 0
    psi = population_stability(expected, actual) if comparable else math.nan
    return FeatureDrift(
        name,
        *rows,
        psi,
        jensen_shannon(expected, actual) if comparable else math.nan,
        *null_rates,
        not_found_rate,
        flagged=not math.isnan(psi) and psi > psi_threshold,
    )


def view_drift(
    store: FeatureStore,
    view: str,
    recent: timedelta,
    baseline: timedelta | None = None,
    psi_threshold: float = PSI_THRESHOLD,
) -> DriftReport:
    """Each feature of ``view``: its history's last ``recent`` (whole UTC event days, today
    included) against the ``baseline`` days before (default: all of them), from its statistics."""
    days = max(1, math.ceil(recent / DAY))
    start = bucket_start(datetime.now(UTC), DAY) - (days - 1) * DAY
    first = start - math.ceil(baseline / DAY) * DAY if baseline is not None else None
    found = store.statistics(view, since=first)
    before = merged(x for x in found if x[0] < start)
    after = merged(x for x in found if x[0] >= start)
    span = f"the {math.ceil(baseline / DAY)} days before" if baseline is not None else "all days before"
    compared = f"event days from {start:%Y-%m-%d} against {span}"
    report = DriftReport(view, "view", compared, start, psi_threshold)
    definition = store.definitions.view(view)
    ids = {*store.definitions.key_types[view], getattr(definition, "event_id", None)}  # identities, not values
    for name in [f.name for f in definition.schema]:
        if name in ids or name not in before or name not in after:
            continue  # (nothing on one side: no comparison to make)
        report.features.append(summary_drift(name, before[name], after[name], psi_threshold))
    if not report.features:
        raise FeatureStoreError(
            f"view {view!r} has no feature with history on both sides of {start:%Y-%m-%d}; "
            "materialize or push more, or widen --since"
        )
    return report


def record_drift(report: DriftReport, data_dir: Path) -> Path:
    """Keep a service's or view's latest drift report where the servers' /metrics find it."""
    folder = Path(data_dir) / "drift" / ("views" if report.kind == "view" else "")
    path = folder / f"{report.subject}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "kind": report.kind,
        report.kind: report.subject,
        "compared": report.compared,
        "checked_at": datetime.now(UTC).isoformat(),
        "since": report.since.isoformat() if report.since else None,
        "psi_threshold": report.psi_threshold,
        "features": [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(f).items()}
            for f in report.features
        ],
    }
    atomic_write(path, json.dumps(body, indent=2).encode())
    return path


def read_drift(data_dir: Path) -> list[dict]:
    """Every service's and view's latest recorded drift report (unreadable ones skipped: a scrape
    never fails on them)."""
    found = []
    folder = Path(data_dir) / "drift"
    for path in sorted([*folder.glob("*.json"), *folder.glob("views/*.json")]):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return found


def _shares(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=float)
    return counts / counts.sum()


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
