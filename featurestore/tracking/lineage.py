"""Lineage, end to end: model version → training run → dataset manifest → feature definitions →
Delta table versions. Each hop is checked, not just quoted: hashes are recomputed and every
place a link could have gone stale (a deleted run, an edited manifest, a view changed since)
says so in its ``ok``/``current`` fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featurestore.registry.snapshot import applied_hashes
from featurestore.registry.store import RegistryStore
from featurestore.retrieval.export import manifest_hash

if TYPE_CHECKING:
    from featurestore.offline.base import HistoryFiles
    from featurestore.training.model_registry import ModelRegistry


def model_lineage(
    models: ModelRegistry,
    name: str,
    version: int,
    runs_root: Path,
    registry: RegistryStore,
    offline: HistoryFiles,
) -> dict[str, Any]:
    card = models.card(name, version)
    stages = [stage for stage, v in models.aliases(name).items() if v == version]
    run_dir = Path(runs_root) / card["run"]
    params = json.loads((run_dir / "params.json").read_text()) if (run_dir / "params.json").exists() else {}
    dataset = params.get("dataset_path") or params.get("config", {}).get("dataset")
    return {
        "model": {
            "name": name,
            "version": version,
            "stages": stages,
            "metrics": card["metrics"],
            "registered_at": card["registered_at"],
            "feature_service": card["feature_service"],
            "files": models.hashes(name).get(version, {}),
            "code_version": card["code_version"],
        },
        "run": {
            "id": card["run"],
            "exists": run_dir.is_dir(),
            "code_version": params.get("code_version"),
            "dataset_manifest_hash": params.get("dataset_manifest_hash"),
        },
        "dataset": _dataset(Path(dataset) if dataset else None, card["dataset_manifest_hash"]),
        "definitions": definitions_lineage(registry, card["definition_hashes"]),
        "tables": _tables(Path(dataset) if dataset else None, offline),
    }


def _manifest(dataset: Path | None) -> dict[str, Any] | None:
    file = dataset / "manifest.json" if dataset else None
    return json.loads(file.read_text()) if file and file.exists() else None


def _dataset(dataset: Path | None, expected_hash: str) -> dict[str, Any]:
    manifest = _manifest(dataset)
    if manifest is None:
        return {"path": str(dataset) if dataset else None, "exists": False, "manifest_hash": expected_hash, "ok": False}
    recomputed = manifest_hash(manifest)
    return {
        "path": str(dataset),
        "exists": True,
        "manifest_hash": expected_hash,
        "ok": recomputed == expected_hash,
        "recomputed_hash": recomputed,
        "rows": manifest["row_count"],
        "created_at": manifest["created_at"],
        "registry_version": manifest.get("registry_version"),
        "files": manifest["files"],
        "entities": manifest["entities"],
    }


def definitions_lineage(registry: RegistryStore, hashes: dict[str, str]) -> list[dict[str, Any]]:
    """Per view: the hash trained on, the registry version that first applied it, and whether the
    view is still defined so (``current``)."""
    current = applied_hashes(registry.current(), list(hashes))
    first_applied: dict[str, int] = {}
    for number in registry.versions():
        for view, h in applied_hashes(registry.version(number), list(hashes)).items():
            if h == hashes[view]:
                first_applied.setdefault(view, number)
    return [
        {
            "view": view,
            "hash": h,
            "registry_version": first_applied.get(view),
            "current_hash": current.get(view),
            "current": current.get(view) == h,
        }
        for view, h in sorted(hashes.items())
    ]


def _tables(dataset: Path | None, offline: HistoryFiles) -> list[dict[str, Any]]:
    """Per view: the history table and Delta version the dataset read, beside the table's version now."""
    manifest = _manifest(dataset)
    if manifest is None:
        return []
    return [
        {
            "view": view,
            "table": manifest["history_tables"].get(view),
            "version": version,
            "latest_version": offline.version(manifest["history_tables"].get(view, view)),
        }
        for view, version in sorted(manifest["table_versions"].items())
    ]
