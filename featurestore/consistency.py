"""Training/serving consistency: replay the feature log against the history store.

For every logged (entity, served time) the point-in-time row is fetched offline with
``as_of="created"`` (what the online store could have known then) and compared feature by
feature: value, null-ness and dtype. Windowed float sums, means and variances may differ
by rounding (see ``featurestore.aggregation``): they match within ``FLOAT_TOLERANCE``, and the
largest relative difference seen is reported. The model's score is recomputed from the
offline row, in the same request groups, and compared with the logged score bit for bit (float32).

A replay that serves at simulated past times (``at``) is checked with ``as_of="event"``: its
rows were written at wall-clock times after the simulated ones. Every logged vector says which
it was (``replayed``), and the default, ``as_of="auto"``, checks each the way it was served:
replayed ones as of event time, the others as of created time. Each recorded check says its mode.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.aggregation import FLOAT_TOLERANCE, is_inexact
from featurestore.feature_logging import MODEL_COLUMNS, log_path, read_log

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore
    from featurestore.retrieval.historical import AsOf


@dataclass
class ConsistencyReport:
    rows: int
    feature_match: dict[str, float]
    score_match: float
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    has_scores: bool = True
    max_relative_difference: float = 0.0  # over matched inexact aggregates (0: all bit-identical)
    over_time: list[dict[str, Any]] = field(default_factory=list)  # match rate of whole vectors per served-time bucket
    mode: str = "created"  # auto (each vector as served), event or created
    as_of: str = "history as of created time"  # the same, in words, with the vectors read each way

    @property
    def overall(self) -> float:
        rates = list(self.feature_match.values())
        return float(np.mean(rates)) if rates else 1.0

    @property
    def ok(self) -> bool:
        return self.rows > 0 and self.overall == 1.0 and self.score_match == 1.0

    def describe(self) -> str:
        lines = [f"Consistency over {self.rows} served feature vectors ({self.as_of}):"]
        lines += [f"  {name:<28} {rate:8.3%}" for name, rate in self.feature_match.items()]
        lines.append(f"  {'all features':<28} {self.overall:8.3%}")
        if self.max_relative_difference:
            lines.append(f"  (windowed float aggregates matched within a relative {self.max_relative_difference:.1e})")
        if self.has_scores:
            lines.append(f"  {'model score (float32 bits)':<28} {self.score_match:8.3%}")
        for m in self.mismatches[:10]:
            lines.append(f"  mismatch: {m}")
        return "\n".join(lines)


MODES = ("auto", "event", "created")


def _by_mode(log: pa.Table, as_of: str) -> list[tuple[AsOf, pa.Table]]:
    """The log's vectors in groups checked alike: all of them as ``as_of`` says, or with ``auto``
    the replayed ones (served at a time the caller gave) as of event time, the rest as of created time."""
    if as_of not in MODES:
        raise ValueError(f"as_of is one of {list(MODES)}, not {as_of!r}")
    if as_of != "auto":
        return [(cast("AsOf", as_of), log)]
    replayed = (
        pc.fill_null(log["replayed"], False) if "replayed" in log.column_names else pa.array([False] * log.num_rows)
    )
    groups: list[tuple[AsOf, pa.Table]] = [
        ("event", log.filter(replayed)),
        ("created", log.filter(pc.invert(replayed))),
    ]
    return [(mode, part) for mode, part in groups if part.num_rows]


def _mode_name(as_of: str, groups: list[tuple[AsOf, pa.Table]]) -> str:
    """How a check read the history, in words (what it prints and records)."""
    if as_of != "auto":
        return f"history as of {as_of} time"
    return "history as each vector was served: " + ", ".join(
        f"as of {mode} time for {part.num_rows:,} {'replayed' if mode == 'event' else 'live'} vectors"
        for mode, part in groups
    )


def check_consistency(
    store: FeatureStore, model_name: str, max_mismatches: int = 20, as_of: str = "auto"
) -> ConsistencyReport:
    """Check an inference server's log: features, and the model's scores rescored offline."""

    logs = read_log(log_path(store.config.data_dir, model_name))
    served: list[Any] = []
    registry = store.model_registry()
    report = ConsistencyReport(logs.num_rows, {}, 1.0)
    hits: dict[str, list[bool]] = {}
    score_hits = 0
    groups = [
        (mode, sub, version)
        for version in pc.unique(logs["model_version"]).to_pylist()
        for mode, sub in _by_mode(logs.filter(pc.equal(logs["model_version"], version)), as_of)
    ]
    report.mode, report.as_of = as_of, _mode_name(as_of, [(mode, sub) for mode, sub, _ in groups])
    for mode, part, version in groups:
        served.append(part["served_at"])
        loaded = registry.load(model_name, int(version))
        offline, names = _compare_features(
            store,
            part,
            loaded.card["feature_service"],
            loaded.card["request_inputs"],
            hits,
            report,
            max_mismatches,
            mode,
        )
        # recompute scores per request (same batch composition as at serving time)
        request_ids = part["request_id"].to_numpy(zero_copy_only=False)
        recomputed = np.empty(part.num_rows, dtype=np.float32)
        for rid in dict.fromkeys(request_ids.tolist()):
            take = pa.array(np.flatnonzero(request_ids == rid))
            columns = {n: offline[n].take(take) for n in names}
            columns.update(
                {i: part[i].take(take) for i in [*loaded.card["request_inputs"], *loaded.preprocessor.hashed]}
            )
            recomputed[take.to_numpy()] = loaded.predict(columns)
        logged = part["score"].to_numpy(zero_copy_only=False).astype(np.float32)
        score_hits += int((recomputed.view(np.uint32) == logged.view(np.uint32)).sum())
    report.feature_match = {n: float(np.mean(v)) for n, v in hits.items()}
    report.score_match = score_hits / logs.num_rows if logs.num_rows else 1.0
    report.over_time = _over_time(served, hits)
    return report


def check_service_log(
    store: FeatureStore, service: str, max_mismatches: int = 20, as_of: str = "auto"
) -> ConsistencyReport:
    """Check the feature server's log of lookups by ``service`` (``featurestore serve --log-features``)."""
    logs = read_log(log_path(store.config.data_dir, f"service:{service}"))
    report = ConsistencyReport(logs.num_rows, {}, 1.0, has_scores=False)
    hits: dict[str, list[bool]] = {}
    groups = _by_mode(logs, as_of)
    report.mode, report.as_of = as_of, _mode_name(as_of, groups)
    for mode, part in groups:
        _compare_features(store, part, service, [], hits, report, max_mismatches, mode)
    report.feature_match = {n: float(np.mean(v)) for n, v in hits.items()}
    report.over_time = _over_time([part["served_at"] for _, part in groups], hits)
    return report


def _over_time(served: list[Any], hits: dict[str, list[bool]], buckets: int = 24) -> list[dict[str, Any]]:
    """Share of vectors with every feature matching, in ``buckets`` equal spans of served time."""
    if not served or not hits:
        return []
    times = np.concatenate([pc.cast(s, pa.int64()).to_numpy(zero_copy_only=False) for s in served])
    if not len(times):
        return []
    whole = np.logical_and.reduce([np.asarray(v, dtype=bool) for v in hits.values()])
    lo, hi = int(times.min()), int(times.max()) + 1
    edges = np.linspace(lo, hi, buckets + 1).astype(np.int64)
    which = np.clip(np.searchsorted(edges, times, side="right") - 1, 0, buckets - 1)
    out = []
    for b in range(buckets):
        inside = which == b
        if inside.any():
            out.append(
                {
                    "from_us": int(edges[b]),
                    "to_us": int(edges[b + 1]),
                    "rows": int(inside.sum()),
                    "match": float(whole[inside].mean()),
                }
            )
    return out


def record_check(report: ConsistencyReport, data_dir: Path, name: str) -> Path:
    """Append a check's result to ``<data_dir>/consistency/<name>.jsonl`` (what the web UI charts)."""
    folder = Path(data_dir) / "consistency"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{name.replace(':', '_').replace('/', '_')}.jsonl"
    entry = {
        "checked_at": time.time(),
        "name": name,
        "mode": report.mode,
        "as_of": report.as_of,
        "rows": report.rows,
        "overall": report.overall,
        "score_match": report.score_match if report.has_scores else None,
        "feature_match": report.feature_match,
        "over_time": report.over_time,
    }
    with open(file, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return file


def read_checks(data_dir: Path) -> list[dict[str, Any]]:
    """Every recorded check, oldest first."""
    entries = []
    for file in sorted((Path(data_dir) / "consistency").glob("*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
    return sorted(entries, key=lambda e: e["checked_at"])


def _compare_features(
    store: FeatureStore,
    part: pa.Table,
    service: str,
    request_inputs: list[str],
    hits: dict[str, list[bool]],
    report: ConsistencyReport,
    max_mismatches: int,
    as_of: AsOf,
) -> tuple[pa.Table, list[str]]:
    """Point-in-time rows at each served time (as known then), compared feature by feature.

    The logged value is compared whatever its status: a NOT_FOUND window serves its empty
    value (0 for counts), which is what the offline join yields too."""
    refs = store.get_feature_service(service).feature_refs()
    names = [ref.split(":")[1] for ref in refs]
    inexact = {ref.split(":")[1] for ref in refs if _inexact(store, ref)}
    meta = {"served_at", "request_id", "replayed", *MODEL_COLUMNS, *request_inputs}
    keys = [c for c in part.column_names if c not in meta and c not in names and not c.endswith("__status")]
    entity_df = pa.table({**{k: part[k] for k in keys}, "event_timestamp": part["served_at"]})
    offline = store.get_historical_features(entity_df, feature_service=service, as_of=as_of).to_arrow()
    mismatches = report.mismatches
    for name in names:
        served, expected = part[name], offline[name]
        if served.type != expected.type:  # a dtype drift is a mismatch on every row
            equal = pa.array([False] * part.num_rows)
        elif name in inexact:
            a = served.to_numpy(zero_copy_only=False).astype(float)
            b = expected.to_numpy(zero_copy_only=False).astype(float)
            close = np.isclose(a, b, rtol=FLOAT_TOLERANCE, atol=0.0, equal_nan=True)
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.abs(a - b) / np.maximum(np.abs(a), np.abs(b))
            differing = close & (a != b) & np.isfinite(rel)
            if differing.any():
                report.max_relative_difference = max(report.max_relative_difference, float(rel[differing].max()))
            equal = pa.array(close)
        else:
            equal = pc.fill_null(pc.equal(served, expected), False)
        hit = pc.or_(equal, pc.and_(pc.is_null(served), pc.is_null(expected))).to_numpy(zero_copy_only=False)
        hits.setdefault(name, []).extend(hit.tolist())
        for i in np.flatnonzero(~hit)[: max(0, max_mismatches - len(mismatches))]:
            mismatches.append(
                {
                    "feature": name,
                    **{k: part[k][i].as_py() for k in keys},
                    "served_at": str(part["served_at"][i].as_py()),
                    "status": part[f"{name}__status"][i].as_py(),
                    "online": served[i].as_py(),
                    "offline": expected[i].as_py(),
                }
            )
    return offline, names


def _inexact(store: FeatureStore, ref: str) -> bool:
    view_name, feature = ref.split(":")
    odfv = store.definitions.on_demand_feature_views.get(view_name)
    if odfv is not None:  # the same function on inputs that may differ by rounding
        return any(_inexact(store, r) for r in odfv.input_refs)
    view = store.get_feature_view(view_name)
    return any(a.output_name == feature and is_inexact(a, view) for a in view.aggregations)
