"""Diff between the definitions in the repo and the applied registry state.

Every change to a feature view has one defined outcome for its stored data:

- a change that makes stored rows wrong (source, transformation, join keys, a key's or a
  column's type, event id, a column added to an event view) starts a **new version**: its
  history starts empty in a table of its own, filled by ``featurestore backfill``; older
  versions stay readable, so datasets exported under them still reproduce;
- an added column **evolves** the history (older rows read null until a backfill);
- a removed column is no longer served; its stored data stays;
- ttl, aggregations and metadata are applied at read time: stored data stays valid (a change of
  an aggregated view's longest window or dedup window changes its online layout: see
  ``Change.relayout``).

Whenever the online layout changes (any of the above but the read-time ones), values written
before read NOT_FOUND until the next ``materialize``/``backfill`` re-sends them: bytes are
never decoded under a layout they were not written with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Changing any of these makes the stored rows wrong for the new definition.
REBUILD_ATTRIBUTES = {"source", "transformation", "join_keys", "entities", "event_id"}


@dataclass
class Change:
    kind: str
    name: str
    action: Literal["add", "change", "remove"]
    attributes: list[str] = field(default_factory=list)
    new_version: int | None = None  # a feature view's new history version, when it gets one
    # what changed an aggregated view's online layout ("longest window", "dedup window"): online reads
    # NOT_FOUND until re-sent
    relayout: str = ""
    online: bool = False  # a view served online (what it holds there under its earlier layout stays)
    added_columns: list[str] = field(default_factory=list)
    removed_columns: list[str] = field(default_factory=list)

    @property
    def needs_backfill(self) -> bool:
        return self.new_version is not None or bool(self.added_columns)

    @property
    def deletes_data(self) -> bool:
        return self.kind == "feature_view" and self.action == "remove"

    def describe(self) -> str:
        symbol = {"add": "+", "change": "~", "remove": "-"}[self.action]
        text = f"{symbol} {self.kind.replace('_', ' ')} {self.name}"
        if self.attributes:
            text += f" (changed: {', '.join(self.attributes)})"
        backfill = f"`featurestore backfill {self.name}`"
        if self.new_version is not None:
            text += (
                f"  [new version v{self.new_version}: its history starts empty and its online values read "
                f"NOT_FOUND until {backfill}; v{self.new_version - 1} stays readable for datasets exported under it]"
            )
        elif self.added_columns:
            text += (
                f"  [history gains {', '.join(self.added_columns)} (older rows null) and online values read "
                f"NOT_FOUND until {backfill}]"
            )
        if self.removed_columns:
            text += f"  [{', '.join(self.removed_columns)} no longer served; stored data stays]"
        if self.relayout and self.new_version is None:
            text += (
                f"  [its {self.relayout} changed what Redis keeps and which writes of an event id are duplicates: "
                "online values read NOT_FOUND until `featurestore materialize` re-sends its history]"
            )
        if self.online and (self.needs_backfill or self.removed_columns or self.relayout):
            text += "  [Redis keeps its values of the earlier layout until `featurestore compact --drop-old-layouts`]"
        if self.deletes_data:
            text += "  [its stored data will be deleted: needs --force]"
        return text


@dataclass
class Plan:
    changes: list[Change]
    objects: dict[str, dict[str, dict]]
    history_versions: dict[str, int] = field(default_factory=dict)  # per view, after applying
    key_types: dict[str, dict[str, str]] = field(default_factory=dict)  # per view, resolved type names
    base_version: int = 0  # the registry version the plan was made against

    @property
    def empty(self) -> bool:
        return not self.changes

    @property
    def deletes_data(self) -> bool:
        return any(c.deletes_data for c in self.changes)

    def describe(self) -> str:
        if self.empty:
            return "No changes: the registry matches the definitions."
        lines = [c.describe() for c in self.changes]
        counts = {a: sum(c.action == a for c in self.changes) for a in ("add", "change", "remove")}
        lines.append(f"Plan: {counts['add']} to add, {counts['change']} to change, {counts['remove']} to remove.")
        return "\n".join(lines)


def make_plan(
    applied: dict[str, Any], desired: dict[str, dict[str, dict]], key_types: dict[str, dict[str, str]]
) -> Plan:
    """``applied``: the registry's current state; ``desired``: the code's specs; ``key_types``: the
    code's join-key type names per view (declared or read from the source)."""
    before_objects = applied.get("objects", {})
    changes: list[Change] = []
    for kind in sorted(set(before_objects) | set(desired)):
        old, new = before_objects.get(kind, {}), desired.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if name not in old:
                changes.append(Change(kind, name, "add"))
            elif name not in new:
                changes.append(Change(kind, name, "remove"))
            elif old[name]["hash"] != new[name]["hash"]:
                changes.append(Change(kind, name, "change", _changed(old[name]["spec"], new[name]["spec"])))
    by_name = {(c.kind, c.name): c for c in changes}
    versions: dict[str, int] = {}
    for name, entry in desired.get("feature_view", {}).items():
        before = before_objects.get("feature_view", {}).get(name)
        version = applied.get("history_versions", {}).get(name, 1) if before is not None else 1
        if before is not None:
            change = by_name.get(("feature_view", name)) or Change("feature_view", name, "change")
            old_keys = applied.get("key_types", {}).get(name)
            keys_changed = (
                old_keys != key_types.get(name)
                if old_keys is not None  # registries from before key types were kept:
                else _entity_keys(before_objects, before["spec"]) != _entity_keys(desired, entry["spec"])
            )
            if _starts_new_version(change, before["spec"], entry["spec"], keys_changed):
                version = change.new_version = version + 1
            change.relayout = " and ".join(
                what
                for what, old, new in zip(WINDOWS, _windows(before["spec"]), _windows(entry["spec"]), strict=True)
                if old != new
            )
            change.online = bool(entry["spec"].get("online", True))
            if (
                keys_changed and old_keys is not None
            ):  # (say which: the attributes show none when only a source's column type changed)
                change.attributes = sorted(
                    {
                        *change.attributes,
                        *(
                            f"type of join key {k!r} ({old_keys.get(k)} -> {t})"
                            for k, t in (key_types.get(name) or {}).items()
                            if old_keys.get(k) != t
                        ),
                    }
                )
            if change.needs_backfill and ("feature_view", name) not in by_name:  # only an entity's key type changed
                changes.append(change)
        versions[name] = version
    return Plan(changes, desired, versions, key_types, applied.get("version", 0))


def _entity_keys(objects: dict[str, dict[str, dict]], view_spec: dict) -> dict[str, Any]:
    entities = objects.get("entity", {})
    return {e: entities[e]["spec"].get("key_types") for e in view_spec["entities"] if e in entities}


def _starts_new_version(change: Change, old: dict, new: dict, keys_changed: bool) -> bool:
    """Fill in the change's columns; whether it makes stored rows wrong (see the module docstring)."""
    old_types = {f["name"]: f["dtype"] for f in old["schema"]}
    new_types = {f["name"]: f["dtype"] for f in new["schema"]}
    change.added_columns = [c for c in new_types if c not in old_types]
    change.removed_columns = [c for c in old_types if c not in new_types]
    retyped = [c for c in new_types if c in old_types and old_types[c] != new_types[c]]
    events = bool(new.get("aggregations"))  # an event is stored once (first write wins): never amended
    if (REBUILD_ATTRIBUTES & set(change.attributes)) or retyped or keys_changed or (events and change.added_columns):
        change.added_columns = []
        return True
    return False


WINDOWS = ("longest window", "dedup window")


def _windows(spec: dict) -> tuple[int | None, int | None]:
    """An aggregated view's longest window and dedup window (µs; None: none, or the default)."""
    windows = [a["window_us"] for a in spec.get("aggregations") or []]
    return max(windows) if windows else None, spec.get("dedup_window_us")


def _changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
