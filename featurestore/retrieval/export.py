"""Versioned training-dataset export: Parquet + ``manifest.json`` that can reproduce it byte for byte.

The entity input is first written into the export folder (``entities.parquet``), and the
join always reads it from there, so a reproduction runs the very same plan. Delta time
travel pins every history table to the version the original export read.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError
from featurestore.files import atomic_write
from featurestore.offline.base import OfflineStore
from featurestore.progress import progress_bar
from featurestore.registry.loader import Definitions
from featurestore.registry.snapshot import applied_definitions, applied_hashes, value_hash
from featurestore.registry.store import RegistryStore
from featurestore.retrieval.historical import JoinBuilder, RetrievalJob, entity_table

DATA_FILE = "data-00000.parquet"
ENTITIES_FILE = "entities.parquet"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_hash(manifest: dict[str, Any]) -> str:
    """What a manifest says, hashed (not when it was made): models and runs name their dataset by it."""
    content = {k: v for k, v in manifest.items() if k not in ("created_at", "manifest_hash")}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def export_training_dataset(
    defs: Definitions,
    offline: OfflineStore,
    entity_df: Any,
    feature_service: str,
    out: Path,
    *,
    registry_version: int,
    progress: bool = False,
    versions: dict[str, int | None] | None = None,
    join: JoinBuilder = RetrievalJob.build,
) -> dict[str, Any]:
    """Join ``defs``' service over ``offline`` (at table ``versions``, default latest) into ``out``
    with the ``join`` engine (local DuckDB, or Ray: the same rows and bytes)."""
    from featurestore import __version__

    out.mkdir(parents=True, exist_ok=True)
    entities_path = out / ENTITIES_FILE
    if entity_df is not None:
        pq.write_table(entity_table(entity_df), entities_path, compression="zstd")
    refs = defs.service(feature_service).feature_refs()
    views = list(dict.fromkeys(r.split(":")[0] for r in refs))
    hashes = {v: value_hash(defs.spec_of(v)) for v in views}
    job = join(defs, offline, str(entities_path), None, feature_service, False, versions=versions)
    total = pq.ParquetFile(entities_path).metadata.num_rows
    with progress_bar("rows", progress) as bar:
        task = bar.add_task(f"exporting {feature_service}", total=total)
        rows = job.to_parquet(out / DATA_FILE, on_batch=lambda n: bar.advance(task, n))
    schema = pq.read_schema(out / DATA_FILE)
    manifest = {
        "feature_service": feature_service,
        "features": refs,
        "definition_hashes": hashes,
        "registry_version": registry_version,
        "history_tables": job.history_tables,
        "table_versions": job.table_versions,
        "entities": {"file": ENTITIES_FILE, "sha256": sha256_file(entities_path), "rows": total},
        "row_count": rows,
        "schema": [{"name": f.name, "type": str(f.type)} for f in schema],
        "files": [{"path": DATA_FILE, "sha256": sha256_file(out / DATA_FILE), "rows": rows}],
        "created_at": datetime.now(UTC).isoformat(),
        "package_version": __version__,
    }
    manifest["manifest_hash"] = manifest_hash(manifest)
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def reproduce(
    current: Definitions,
    registry: RegistryStore,
    offline: OfflineStore,
    manifest_path: Path,
    out: Path,
    progress: bool = False,
    join: JoinBuilder = RetrievalJob.build,
) -> dict[str, Any]:
    """Re-run an export from its manifest into ``out``; raise if any data file differs.

    Under the ``current`` definitions when the manifest's views are unchanged, else under the
    registry state the export was made with (its view versions' history stays readable)."""
    try:
        manifest = json.loads(Path(manifest_path).read_text())
    except FileNotFoundError:
        raise FeatureStoreError(f"no manifest at {manifest_path}; pass the manifest.json an export wrote") from None
    except json.JSONDecodeError as exc:
        raise FeatureStoreError(f"{manifest_path} is not a manifest (invalid JSON: {exc})") from None
    out.mkdir(parents=True, exist_ok=True)
    source_entities = Path(manifest_path).parent / manifest["entities"]["file"]
    if sha256_file(source_entities) != manifest["entities"]["sha256"]:
        raise FeatureStoreError(f"{source_entities} does not match the manifest's hash; the entity input was modified")
    (out / ENTITIES_FILE).write_bytes(source_entities.read_bytes())
    defs, registry_version = _definitions_of(manifest, current, registry)
    new = export_training_dataset(
        defs,
        offline,
        None,
        manifest["feature_service"],
        out,
        registry_version=registry_version,
        progress=progress,
        versions=manifest["table_versions"],
        join=join,
    )
    mismatched = [f["path"] for f, g in zip(manifest["files"], new["files"]) if f["sha256"] != g["sha256"]]
    if mismatched:
        raise FeatureStoreError(f"reproduced files {mismatched} differ from the manifest's hashes")
    return new


def _definitions_of(manifest: dict[str, Any], current: Definitions, registry: RegistryStore) -> tuple[Definitions, int]:
    """The definitions an export was made under, and the registry version they were applied in."""
    expected = manifest["definition_hashes"]
    views = list(expected)
    specs = {**current.specs().get("feature_view", {}), **current.specs().get("on_demand_feature_view", {})}
    if all(v in specs and value_hash(specs[v]["spec"]) == expected[v] for v in views):
        return current, manifest.get("registry_version") or registry.current()["version"]
    number = manifest.get("registry_version")
    if number is not None and number in registry.versions():
        state = registry.version(number)
        if applied_hashes(state, views) == expected:
            return applied_definitions(state), number
    raise FeatureStoreError(
        f"the definitions of {sorted(v for v in views if v not in specs or value_hash(specs[v]['spec']) != expected[v])} "
        "changed since this dataset was exported and the registry holds no applied version matching the manifest; "
        "check out and apply the definitions the manifest names to reproduce it"
    )
