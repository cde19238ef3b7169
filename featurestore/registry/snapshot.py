"""Definitions read back from an applied registry state, for reading history as it was.

``export --from-manifest`` of a dataset made under an older definition joins that version's
history tables with that version's keys, features, ttls and aggregations. Sources keep their
spec; transformations are not restored (their code may be gone): such a snapshot reads
history and never computes rows.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from featurestore.definitions import (
    Aggregation,
    Entity,
    FeatureService,
    FeatureView,
    FeatureViewProjection,
    Field,
    FileSource,
    PushSource,
    SqlSource,
    StreamSource,
    content_hash,
)
from featurestore.errors import FeatureStoreError
from featurestore.registry.loader import Definitions
from featurestore.types import from_name

METADATA = ("description", "owner", "tags")  # spec fields that never change a value


def value_hash(spec: dict[str, Any]) -> str:
    """Hash of what determines a view's values (not its description, owner or tags): manifests and
    model cards record it, so metadata edits never make a model or dataset stale."""
    return content_hash({k: v for k, v in spec.items() if k not in METADATA})


def applied_hashes(state: dict[str, Any], views: list[str]) -> dict[str, str]:
    specs = {**state["objects"].get("feature_view", {}), **state["objects"].get("on_demand_feature_view", {})}
    return {v: value_hash(specs[v]["spec"]) for v in views if v in specs}


def applied_definitions(state: dict[str, Any]) -> Definitions:
    """The views, entities and services of a registry state (see the module docstring)."""
    objects = state["objects"]
    defs = Definitions()
    for name, entry in objects.get("entity", {}).items():
        spec = entry["spec"]
        types = {k: from_name(t) for k, t in spec["key_types"].items() if t}
        defs.entities[name] = Entity(name, list(spec["join_keys"]), types or None, spec.get("description", ""))
    for name, entry in objects.get("push_source", {}).items():
        defs.push_sources[name] = _source(entry["spec"])
    for name, entry in objects.get("feature_view", {}).items():
        view = view_from_spec(entry["spec"], defs.entities)
        defs.feature_views[name] = view
        recorded = state.get("key_types", {}).get(name)
        defs.key_types[name] = (
            {k: from_name(t) for k, t in recorded.items()}
            if recorded
            else {k: t for e in view.entities for k, t in e.key_types().items() if t}
        )
    for name, entry in objects.get("feature_service", {}).items():
        items: list[FeatureViewProjection] = []
        for ref in entry["spec"]["features"]:
            view_name, feature = ref.split(":", 1)
            if view_name not in defs.feature_views:  # an on-demand view: its function is code, not registry state
                raise FeatureStoreError(
                    f"feature service {name!r} of an older registry version uses on-demand view "
                    f"{view_name!r}, whose function cannot be read back; check out that version's code"
                )
            if items and items[-1].view.name == view_name:
                items[-1].features.append(feature)
            else:
                items.append(FeatureViewProjection(defs.feature_views[view_name], [feature]))
        defs.feature_services[name] = FeatureService(name, items)  # type: ignore[arg-type]
    defs.versions = {n: v for n, v in state.get("history_versions", {}).items() if n in defs.feature_views}
    return defs


def view_from_spec(spec: dict[str, Any], entities: dict[str, Entity]) -> FeatureView:
    """A feature view as applied (its transformation, code, is not part of the registry state)."""
    view = FeatureView(
        spec["name"],
        [entities[e] for e in spec["entities"]],
        _source(spec["source"]),
        _fields(spec["schema"]),
        ttl=timedelta(seconds=spec["ttl_seconds"]) if spec["ttl_seconds"] is not None else None,
        online=spec["online"],
        offline=spec["offline"],
        description=spec.get("description", ""),
        owner=spec.get("owner", ""),
        tags=spec.get("tags", {}),
        aggregations=[_aggregation(a) for a in spec.get("aggregations", [])],
        event_id=spec.get("event_id"),
        dedup_window=timedelta(microseconds=spec["dedup_window_us"]) if "dedup_window_us" in spec else None,
    )
    return view


def _fields(specs: list[dict]) -> list[Field]:
    return [Field(f["name"], from_name(f["dtype"])) for f in specs]


def _source(spec: dict) -> Any:
    ts, created = spec["timestamp_field"], spec["created_timestamp_field"]
    if spec["kind"] == "file":
        return FileSource(spec["path"], ts, created, spec["format"])
    if spec["kind"] == "sql":
        return SqlSource(spec["query"], ts, created)
    if spec["kind"] == "stream":
        return StreamSource(spec["name"], _fields(spec["schema"]), ts, created, stream=spec["stream"])
    return PushSource(spec["name"], _fields(spec["schema"]), ts, created)


def _aggregation(spec: dict) -> Aggregation:
    return Aggregation(
        spec["function"],
        timedelta(microseconds=spec["window_us"]),
        spec["column"],
        spec["name"],
        spec["n"],
        tuple(spec["where"]) if spec["where"] else None,
    )
