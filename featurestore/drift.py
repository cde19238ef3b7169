"""Drift between what a model trained on and what is served (issue #30): per feature, the
population stability index and the Jensen–Shannon distance over bins taken from the training
values (deciles for numbers, categories for text, each with a bucket for the rest), beside the
null rate on both sides and the share of lookups served NOT_FOUND.

Training values come from an exported dataset (``data-00000.parquet`` beside its manifest),
served ones from a feature service's log (``featurestore serve --log-features``), optionally
over a recent window only. A feature is flagged past ``psi_threshold`` (0.2 is the usual "the
population moved" mark; 0.1 "watch it"); ``featurestore monitor`` exits 1 when any is, and
records its report (``<data_dir>/drift/<service>.json``), which the feature server's ``/metrics``
exports for alerting.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError
from featurestore.feature_logging import log_path, read_log
from featurestore.files import atomic_write

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

PSI_THRESHOLD = 0.2
BINS = 10
FLOOR = 1e-4  # an empty bin's share in PSI (log of 0 otherwise): the usual convention


@dataclass
class FeatureDrift:
    name: str
    train_rows: int
    served_rows: int
    psi: float
    js_distance: float
    train_null_rate: float
    served_null_rate: float
    not_found_rate: float
    flagged: bool


@dataclass
class DriftReport:
    service: str
    since: datetime | None
    psi_threshold: float
    features: list[FeatureDrift] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.flagged for f in self.features)

    def describe(self) -> str:
        window = f"since {self.since:%Y-%m-%d %H:%M} UTC" if self.since else "all logged lookups"
        lines = [f"Drift of {self.service!r}: training dataset against served values ({window}):"]
        lines.append(
            f"  {'feature':<28} {'PSI':>7} {'JS dist':>8} {'null train':>10} {'null served':>11} {'NOT_FOUND':>9}"
        )
        for f in self.features:
            mark = "  << drifted" if f.flagged else ""
            lines.append(
                f"  {f.name:<28} {f.psi:7.3f} {f.js_distance:8.3f} {f.train_null_rate:10.1%} "
                f"{f.served_null_rate:11.1%} {f.not_found_rate:9.1%}{mark}"
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
    psi = population_stability(expected, actual) if expected.sum() and actual.sum() else math.nan
    js = jensen_shannon(expected, actual) if expected.sum() and actual.sum() else math.nan
    not_found = 0
    if statuses is not None:
        not_found = pc.sum(pc.equal(statuses, "NOT_FOUND")).as_py() or 0
    return FeatureDrift(
        name,
        len(train),
        len(served),
        psi,
        js,
        _rate(train.null_count, len(train)),
        _rate(served.null_count, len(served)),
        _rate(not_found, len(served)),
        flagged=not math.isnan(psi) and psi > psi_threshold,
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
    report = DriftReport(service, start, psi_threshold)
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


def record_drift(report: DriftReport, data_dir: Path) -> Path:
    """Keep a service's latest drift report where the servers' /metrics find it."""
    path = Path(data_dir) / "drift" / f"{report.service}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "service": report.service,
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
    """Every service's latest recorded drift report (unreadable ones skipped: a scrape never fails on them)."""
    found = []
    for path in sorted((Path(data_dir) / "drift").glob("*.json")):
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
