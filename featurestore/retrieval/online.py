"""Online lookups: entity rows → one pipelined Redis round trip → values with true statuses.

Split in three steps so the SDK (sync) and the servers (async) share everything but the I/O:
``OnlineQuery.prepare`` (validate, build keys), the store's ``read``/``read_async``, and
``OnlineQuery.assemble`` (decode, apply ttl, statuses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Sequence

from featurestore.definitions import FeatureService
from featurestore.errors import RequestError
from featurestore.online.codec import entity_key, make_decoder, micros_to_datetime
from featurestore.registry.loader import Definitions
from featurestore.retrieval.refs import ViewRequest, resolve
from featurestore.types import DType

if TYPE_CHECKING:
    import pandas as pd

    from featurestore.feature_store import FeatureStore

PRESENT, NOT_FOUND, NULL_VALUE, OUTSIDE_MAX_AGE = "PRESENT", "NOT_FOUND", "NULL_VALUE", "OUTSIDE_MAX_AGE"


@dataclass
class OnlineResponse:
    """Column-major lookup result: join keys first, then features in request order."""

    feature_names: list[str]
    values: list[list[Any]]
    statuses: list[list[str]]
    event_timestamps: list[list[datetime | None]]

    def to_dict(self) -> dict[str, Any]:
        """Feast's REST response shape: ``metadata.feature_names`` and per-column ``results``."""
        return {
            "metadata": {"feature_names": self.feature_names},
            "results": [
                {"values": v, "statuses": s, "event_timestamps": [t.isoformat().replace("+00:00", "Z") if t else None for t in ts]}
                for v, s, ts in zip(self.values, self.statuses, self.event_timestamps)
            ],
        }

    def to_values(self) -> dict[str, list[Any]]:
        """``{name: values}`` (what Feast's ``OnlineResponse.to_dict()`` returns)."""
        return dict(zip(self.feature_names, self.values))

    def to_df(self, include_statuses: bool = False) -> "pd.DataFrame":
        import pandas as pd

        data: dict[str, list] = dict(zip(self.feature_names, self.values))
        if include_statuses:
            data.update({f"{n}__status": s for n, s in zip(self.feature_names, self.statuses)})
        return pd.DataFrame(data)


_KEY_CHECKS: dict[str, Callable[[Any], bool]] = {
    "Int32": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31,
    "Int64": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63,
    "String": lambda v: isinstance(v, str),
    "Bool": lambda v: isinstance(v, bool),
    "Bytes": lambda v: isinstance(v, (bytes, str)),
}


@dataclass
class _ViewPlan:
    request: ViewRequest
    slots: list[tuple[int, int]]          # per entity row: (lookup index, field position)
    decode: Callable
    wanted: list[int]
    ttl_us: int | None


@dataclass
class OnlineQuery:
    key_names: list[str]
    key_columns: list[list[Any]]
    views: list[_ViewPlan]
    lookups: list[tuple[bytes, list[str]]] = field(default_factory=list)

    @classmethod
    def prepare(
        cls, defs: Definitions, project: str, entities: Sequence[dict[str, Any]] | dict[str, Sequence[Any]],
        features: Sequence[str] | None, feature_service: str | FeatureService | None, full_feature_names: bool,
        max_entities: int = 10_000, decoders: dict | None = None,
    ) -> "OnlineQuery":
        requests = resolve(defs, features, feature_service, full_feature_names)
        columns = _as_columns(entities)
        n = len(next(iter(columns.values()))) if columns else 0
        if n == 0:
            raise RequestError("no entities given; pass at least one entity row")
        if n > max_entities:
            raise RequestError(f"{n} entities in one request; the limit is {max_entities} (split the request)")
        needed: list[str] = []
        for req in requests:
            needed += [k for k in req.view.join_keys if k not in needed]
        missing = [k for k in needed if k not in columns]
        if missing:
            raise RequestError(f"missing join key(s) {missing} for the requested features; got {sorted(columns)}")
        for name in needed:
            dtype = defs.key_types[next(r.view.name for r in requests if name in r.view.join_keys)][name]
            check = _KEY_CHECKS.get(dtype.name, lambda v: v is not None)
            for value in columns[name]:
                if not check(value):
                    raise RequestError(f"join key {name!r} takes {dtype.name} values; got {value!r} ({type(value).__name__})")
        query = cls(needed, [list(columns[k]) for k in needed], [])
        index: dict[bytes, int] = {}
        groups: dict[tuple[str, ...], list[ViewRequest]] = {}
        for req in requests:
            groups.setdefault(tuple(sorted(req.view.join_keys)), []).append(req)
        for keyset, reqs in groups.items():
            fields = [r.view.name for r in reqs]
            slots_per_view: list[list[tuple[int, int]]] = [[] for _ in reqs]
            for row in range(n):
                key = entity_key(project, {k: columns[k][row] for k in keyset})
                pos = index.get(key)
                if pos is None:  # repeated entities share one lookup
                    pos = index[key] = len(query.lookups)
                    query.lookups.append((key, fields))
                for j in range(len(reqs)):
                    slots_per_view[j].append((pos, j))
            for req, slots in zip(reqs, slots_per_view):
                decode, all_features = _decoder(req.view, decoders)
                wanted = [all_features.index(f) for f in req.features]
                ttl = int(req.view.ttl.total_seconds() * 1_000_000) if req.view.ttl is not None else None
                query.views.append(_ViewPlan(req, slots, decode, wanted, ttl))
        order = {r.view.name: i for i, r in enumerate(requests)}
        query.views.sort(key=lambda v: order[v.request.view.name])
        return query

    def assemble(self, raw: list[list[bytes | None]], now: datetime | None = None) -> OnlineResponse:
        now_us = int((now.timestamp() if now else time.time()) * 1_000_000)
        n = len(self.key_columns[0])
        names = list(self.key_names)
        values: list[list[Any]] = [list(c) for c in self.key_columns]
        statuses: list[list[str]] = [[PRESENT] * n for _ in self.key_columns]
        times: list[list[datetime | None]] = [[None] * n for _ in self.key_columns]
        for plan in self.views:
            width = len(plan.wanted)
            cols_v = [[None] * n for _ in range(width)]
            cols_s = [[NOT_FOUND] * n for _ in range(width)]
            cols_t: list[list[datetime | None]] = [[None] * n for _ in range(width)]
            for row, (pos, j) in enumerate(plan.slots):
                blob = raw[pos][j]
                if blob is None:
                    continue
                event_us, decoded = plan.decode(blob, plan.wanted)
                event = micros_to_datetime(event_us)
                expired = plan.ttl_us is not None and event_us < now_us - plan.ttl_us
                for c in range(width):
                    cols_t[c][row] = event
                    if expired:
                        cols_s[c][row] = OUTSIDE_MAX_AGE
                    elif decoded[c] is None:
                        cols_s[c][row] = NULL_VALUE
                    else:
                        cols_v[c][row] = decoded[c]
                        cols_s[c][row] = PRESENT
            names += plan.request.output_names
            values += cols_v
            statuses += cols_s
            times += cols_t
        return OnlineResponse(names, values, statuses, times)


def _decoder(view, cache: dict | None) -> tuple[Callable, list[str]]:
    features: list[tuple[str, DType]] = [(f.name, f.dtype) for f in view.schema]
    if cache is None:
        return make_decoder(features), [f for f, _ in features]
    if view.name not in cache:
        cache[view.name] = (make_decoder(features), [f for f, _ in features])
    return cache[view.name]


def _as_columns(entities: Sequence[dict[str, Any]] | dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
    if isinstance(entities, dict):
        columns = {k: list(v) if isinstance(v, (list, tuple)) else None for k, v in entities.items()}
        bad = [k for k, v in columns.items() if v is None]
        if bad:
            raise RequestError(f"entities must map each join key to a list of values; {bad} are not lists")
        lengths = {len(v) for v in columns.values()}  # type: ignore[arg-type]
        if len(lengths) > 1:
            raise RequestError(f"entity columns have different lengths {sorted(lengths)}; give one value per row in each")
        return columns  # type: ignore[return-value]
    if not isinstance(entities, (list, tuple)) or not all(isinstance(r, dict) for r in entities):
        raise RequestError("entity_rows must be a list of {join_key: value} dicts")
    keys = list(entities[0]) if entities else []
    for r in entities:
        if list(r) != keys and set(r) != set(keys):
            raise RequestError(f"every entity row needs the same keys; {sorted(r)} differs from {sorted(keys)}")
    return {k: [r[k] for r in entities] for k in keys}


def get_online_features(
    store: "FeatureStore", entity_rows: Any, features: Sequence[str] | None,
    feature_service: str | FeatureService | None, full_feature_names: bool,
) -> OnlineResponse:
    query = OnlineQuery.prepare(
        store.definitions, store.config.project, entity_rows, features, feature_service, full_feature_names,
        store.config.max_request_entities,
    )
    raw = store.online_store.read(query.lookups)
    return query.assemble(raw, datetime.now(timezone.utc))
