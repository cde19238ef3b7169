"""Training/serving consistency: replay the feature log against the history store.

For every logged (entity, served time) the point-in-time row is fetched offline with
``as_of="created"`` (what the online store could have known then) and compared feature by
feature: value, null-ness and dtype. The model's score is recomputed from the offline
row, in the same request groups, and compared with the logged score bit for bit (float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.feature_logging import log_path, read_log
from featurestore.retrieval.online import PRESENT

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore


@dataclass
class ConsistencyReport:
    rows: int
    feature_match: dict[str, float]
    score_match: float
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def overall(self) -> float:
        rates = list(self.feature_match.values())
        return float(np.mean(rates)) if rates else 1.0

    @property
    def ok(self) -> bool:
        return self.rows > 0 and self.overall == 1.0 and self.score_match == 1.0

    def describe(self) -> str:
        lines = [f"Consistency over {self.rows} served feature vectors:"]
        lines += [f"  {name:<28} {rate:8.3%}" for name, rate in self.feature_match.items()]
        lines.append(f"  {'all features':<28} {self.overall:8.3%}")
        lines.append(f"  {'model score (float32 bits)':<28} {self.score_match:8.3%}")
        for m in self.mismatches[:10]:
            lines.append(f"  mismatch: {m}")
        return "\n".join(lines)


def check_consistency(store: "FeatureStore", model_name: str, max_mismatches: int = 20) -> ConsistencyReport:
    from serving.inference_server import model_registry  # the registry the servers use

    logs = read_log(log_path(store.config.data_dir, model_name))
    registry = model_registry(store)
    versions = pc.unique(logs["model_version"]).to_pylist()
    feature_match: dict[str, list[int]] = {}
    score_hits, mismatches = 0, []
    for version in versions:
        part = logs.filter(pc.equal(logs["model_version"], version))
        loaded = registry.load(model_name, int(version))
        service = loaded.card["feature_service"]
        names = [ref.split(":")[1] for ref in store.get_feature_service(service).feature_refs()]
        keys = [c for c in part.column_names if c not in {"served_at", "request_id", "model_name", "model_version", "score"}
                and c not in names and not c.endswith("__status") and c not in loaded.card["request_inputs"]]
        entity_df = pa.table({**{k: part[k] for k in keys}, "event_timestamp": part["served_at"]})
        offline = store.get_historical_features(entity_df, feature_service=service, as_of="created").to_arrow()
        for name in names:
            served = pc.if_else(pc.equal(part[f"{name}__status"], PRESENT), part[name], pa.nulls(part.num_rows, part[name].type))
            expected = offline[name]
            same_type = served.type == expected.type
            equal = pc.fill_null(pc.equal(served, expected), False) if same_type else pa.array([False] * part.num_rows)
            both_null = pc.and_(pc.is_null(served), pc.is_null(expected))
            hit = pc.or_(equal, both_null).to_numpy(zero_copy_only=False)
            feature_match.setdefault(name, []).extend(hit.tolist())
            for i in np.flatnonzero(~hit)[: max(0, max_mismatches - len(mismatches))]:
                mismatches.append({
                    "feature": name, **{k: part[k][i].as_py() for k in keys}, "served_at": str(part["served_at"][i].as_py()),
                    "online": served[i].as_py(), "offline": expected[i].as_py(),
                })
        # recompute scores per request (same batch composition as at serving time)
        request_ids = part["request_id"].to_numpy(zero_copy_only=False)
        recomputed = np.empty(part.num_rows, dtype=np.float32)
        for rid in dict.fromkeys(request_ids.tolist()):
            idx = np.flatnonzero(request_ids == rid)
            take = pa.array(idx)
            columns = {n: offline[n].take(take) for n in names}
            columns.update({i: part[i].take(take) for i in loaded.card["request_inputs"]})
            recomputed[idx] = loaded.predict(columns)
        logged = part["score"].to_numpy(zero_copy_only=False).astype(np.float32)
        score_hits += int((recomputed.view(np.uint32) == logged.view(np.uint32)).sum())
    rows = logs.num_rows
    return ConsistencyReport(
        rows=rows,
        feature_match={n: float(np.mean(v)) for n, v in feature_match.items()},
        score_match=score_hits / rows if rows else 1.0,
        mismatches=mismatches,
    )
