"""What is defined and how it is doing: the catalogue of applied objects and per-view status.

Read from the applied registry state (what is served), not from the definition files, so it
needs neither the user's modules nor their dependencies. Status reads the stores: the newest
event written online, the last materialization, history rows and rejects, stream consumer lag.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import redis

from featurestore.definitions import Entity, StreamSource
from featurestore.errors import NotFoundError, OnlineStoreUnavailable
from featurestore.registry.layout import layout_of
from featurestore.registry.snapshot import from_name, value_hash, view_from_spec
from featurestore.registry.store import RegistryStore, Watermark
from featurestore.streaming import stream_key

if TYPE_CHECKING:
    from featurestore.offline.base import HistoryFiles
    from featurestore.online.base import OnlineStore

_versions_cache: dict[tuple[str, int], dict[str, list[int]]] = {}


def definition_versions(registry: RegistryStore) -> dict[str, list[int]]:
    """Per object (``kind/name``), the registry versions in which its definition changed.
    Computed once per registry version (history files never change)."""
    numbers = registry.versions()
    key = (registry.location.url, numbers[-1] if numbers else 0)
    if key not in _versions_cache:
        changed: dict[str, list[int]] = {}
        last: dict[str, str] = {}
        for number in numbers:
            for kind, objects in registry.version(number)["objects"].items():
                for name, entry in objects.items():
                    if last.get(f"{kind}/{name}") != entry["hash"]:
                        last[f"{kind}/{name}"] = entry["hash"]
                        changed.setdefault(f"{kind}/{name}", []).append(number)
        _versions_cache.clear()  # one repo's history is all a process needs
        _versions_cache[key] = changed
    return _versions_cache[key]


def catalogue(registry: RegistryStore) -> dict[str, Any]:
    """Entities, feature views (with their features' types and windows), on-demand views,
    services and sources of the applied registry, each with its definition versions."""
    state = registry.current()
    objects = state["objects"]
    versions = definition_versions(registry)
    entities = _entities(state)
    views = []
    for name, entry in sorted(objects.get("feature_view", {}).items()):
        spec = entry["spec"]
        view = view_from_spec(spec, entities)
        windows = {a.name: a for a in view.aggregations}
        views.append(
            {
                "name": name,
                "kind": "feature_view",
                "description": spec.get("description", ""),
                "owner": spec.get("owner", ""),
                "tags": spec.get("tags", {}),
                "entities": spec["entities"],
                "join_keys": spec["join_keys"],
                "ttl_seconds": spec["ttl_seconds"],
                "online": spec["online"],
                "offline": spec["offline"],
                "source": {k: spec["source"].get(k) for k in ("kind", "name", "path", "timestamp_field")},
                "event_id": spec.get("event_id"),
                "transformation": bool(spec.get("transformation")),
                "features": [
                    {"name": f.name, "dtype": f.dtype.name, **(_window(windows[f.name]) if f.name in windows else {})}
                    for f in view.features
                ],
                "hash": entry["hash"],  # the definition as applied, metadata included
                "values_hash": value_hash(spec),  # what determines its values: datasets and models record this one
                "versions": versions.get(f"feature_view/{name}", []),
                "history_version": state.get("history_versions", {}).get(name, 1),
            }
        )
    for name, entry in sorted(objects.get("on_demand_feature_view", {}).items()):
        spec = entry["spec"]
        views.append(
            {
                "name": name,
                "kind": "on_demand_feature_view",
                "description": spec.get("description", ""),
                "owner": spec.get("owner", ""),
                "tags": spec.get("tags", {}),
                "entities": [],
                "join_keys": [],
                "ttl_seconds": None,
                "online": True,
                "offline": True,
                "source": {"kind": "on_demand", "name": None},
                "features": [{"name": f["name"], "dtype": f["dtype"]} for f in spec.get("schema", [])],
                "hash": entry["hash"],  # the definition as applied, metadata included
                "values_hash": value_hash(spec),  # what determines its values: datasets and models record this one
                "versions": versions.get(f"on_demand_feature_view/{name}", []),
            }
        )
    return {
        "project_registry_version": state["version"],
        "applied_at": state.get("applied_at"),
        "entities": [
            {
                "name": n,
                "join_keys": e["spec"]["join_keys"],
                "key_types": e["spec"]["key_types"],
                "description": e["spec"].get("description", ""),
                "versions": versions.get(f"entity/{n}", []),
            }
            for n, e in sorted(objects.get("entity", {}).items())
        ],
        "views": views,
        "services": [
            {
                "name": n,
                "features": s["spec"]["features"],
                "description": s["spec"].get("description", ""),
                "owner": s["spec"].get("owner", ""),
                "tags": s["spec"].get("tags", {}),
                "versions": versions.get(f"feature_service/{n}", []),
            }
            for n, s in sorted(objects.get("feature_service", {}).items())
        ],
        "sources": [
            {
                "name": n,
                "kind": s["spec"]["kind"],
                "fields": [f["name"] for f in s["spec"]["schema"]],
                "stream": s["spec"].get("stream"),
            }
            for n, s in sorted(objects.get("push_source", {}).items())
        ],
    }


def _entities(state: dict[str, Any]) -> dict[str, Entity]:
    return {
        name: Entity(
            name,
            list(e["spec"]["join_keys"]),
            {k: from_name(t) for k, t in e["spec"]["key_types"].items() if t} or None,
        )
        for name, e in state["objects"].get("entity", {}).items()
    }


def _window(aggregation: Any) -> dict[str, Any]:
    return {
        "function": aggregation.function,
        "column": aggregation.column,
        "window_seconds": aggregation.window.total_seconds(),
        "where": aggregation.where,
    }


def view_status(
    registry: RegistryStore,
    offline: HistoryFiles,
    online: OnlineStore | None,
    project: str,
    name: str,
    now: float | None = None,
) -> dict[str, Any]:
    """Freshness and volume of one view: age of the newest online event, the last
    materialization, history rows and table version, rejected rows, stream consumer lag."""
    now = time.time() if now is None else now
    state = registry.current()
    if name not in state["objects"].get("feature_view", {}):
        raise NotFoundError(f"no applied feature view named {name!r}")
    spec = state["objects"]["feature_view"][name]["spec"]
    view = view_from_spec(spec, _entities(state))
    layout = layout_of(view, state.get("history_versions", {}).get(name, 1))
    table = layout.history_table
    mark = registry.watermark(name)
    history = offline.stats(table)
    behind = _behind(mark, layout.storage_id) if history["table_version"] is not None else None
    status: dict[str, Any] = {
        "view": name,
        "last_materialized_at": mark.materialized_at,
        "max_event_timestamp": mark.max_event_timestamp,
        # whether the online store holds the whole history (none: nothing to hold), and if not, why
        "online_synced": behind is None,
        "online_behind": behind,
        "history_table": table,
        **history,
        "rejected_rows": offline.rejected_rows(name),
        "newest_online_event": None,
        "online_age_seconds": None,
        "stream": None,
        "online_error": None,
    }
    if online is not None:
        try:
            newest = online.newest().get(name)  # the view's newest event written online, µs
            if newest is not None:
                status["newest_online_event"] = newest
                status["online_age_seconds"] = round(now - newest / 1e6, 3)
            if isinstance(view.source, StreamSource):
                status["stream"] = stream_lag(online.client, stream_key(project, view.source))
            if history["table_version"] is not None and behind is None and not mark.token_kept(online.sync_token(name)):
                status["online_synced"] = False
                status["online_behind"] = (
                    "the online store lacks the token its last fill left there (emptied, replaced or restored "
                    "from an older copy): run `featurestore materialize`"
                )
        except (OnlineStoreUnavailable, redis.RedisError, OSError) as exc:
            status["online_error"] = f"online store unreachable: {exc}"
    return status


def online_behind(registry: RegistryStore, online: OnlineStore, layouts: dict[str, str]) -> dict[str, bool]:
    """Of the views in ``layouts`` (name -> storage id) materialized before: whether the online store
    lacks rows of the view's history (the next materialization re-sends it), by watermark and sync token."""
    return {
        name: not (mark.synced_under(layouts[name]) and mark.token_kept(online.sync_token(name)))
        for name, mark in registry.watermarks().items()
        if name in layouts
    }


def _behind(mark: Watermark, storage_id: str) -> str | None:
    """Why the online store may lack rows of the view's history, as the registry knows it; None if it holds all."""
    if mark.synced_under(storage_id):
        return None
    if mark.online_synced:
        return "written under another layout (an upgrade or a changed definition): run `featurestore materialize`"
    return "history holds rows the online store lacks (never materialized, a crash, an offline-only push): run `featurestore materialize`"


def stream_lag(client: Any, key: str) -> dict[str, Any]:
    """Per consumer group of a stream: entries delivered but not acknowledged, and not yet delivered."""
    try:
        groups = client.xinfo_groups(key)
    except redis.ResponseError:  # no stream yet
        return {"stream": key, "length": 0, "groups": []}
    return {
        "stream": key,
        "length": client.xlen(key),
        "groups": [
            {
                "name": _text(g["name"]),
                "pending": g["pending"],
                "lag": _lag(client, key, g),
                "consumers": g["consumers"],
            }
            for g in groups
        ],
    }


LAG_COUNT_LIMIT = 10_000  # counted past the last delivered entry at most (Redis < 7 does not report lag)


def _lag(client: Any, key: str, group: dict[str, Any]) -> int | None:
    if group.get("lag") is not None:
        return int(group["lag"])
    last = _text(group["last-delivered-id"])
    return len(client.xrange(key, min=f"({last}", max="+", count=LAG_COUNT_LIMIT))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
