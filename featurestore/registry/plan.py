"""Diff between the definitions in the repo and the applied registry state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Changing any of these makes stored rows wrong for the new definition.
# (Aggregations are computed from stored events at read time: changing them needs no backfill.)
DATA_ATTRIBUTES = {"source", "schema", "transformation", "join_keys", "entities", "event_id"}


@dataclass
class Change:
    kind: str
    name: str
    action: Literal["add", "change", "remove"]
    attributes: list[str] = field(default_factory=list)

    @property
    def needs_backfill(self) -> bool:
        return self.kind == "feature_view" and self.action == "change" and bool(DATA_ATTRIBUTES & set(self.attributes))

    @property
    def deletes_data(self) -> bool:
        return self.kind == "feature_view" and self.action == "remove"

    def describe(self) -> str:
        symbol = {"add": "+", "change": "~", "remove": "-"}[self.action]
        text = f"{symbol} {self.kind.replace('_', ' ')} {self.name}"
        if self.attributes:
            text += f" (changed: {', '.join(self.attributes)})"
        if self.needs_backfill:
            text += "  [stored data is stale: re-materialize (backfill) this view]"
        if self.deletes_data:
            text += "  [its stored data will be deleted: needs --force]"
        return text


@dataclass
class Plan:
    changes: list[Change]
    objects: dict[str, dict[str, dict]]

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


def make_plan(applied: dict[str, dict[str, dict]], desired: dict[str, dict[str, dict]]) -> Plan:
    changes: list[Change] = []
    for kind in sorted(set(applied) | set(desired)):
        old, new = applied.get(kind, {}), desired.get(kind, {})
        for name in sorted(set(old) | set(new)):
            if name not in old:
                changes.append(Change(kind, name, "add"))
            elif name not in new:
                changes.append(Change(kind, name, "remove"))
            elif old[name]["hash"] != new[name]["hash"]:
                changes.append(Change(kind, name, "change", _changed(old[name]["spec"], new[name]["spec"])))
    return Plan(changes, desired)


def _changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
