"""Versioned training-dataset export: Parquet + ``manifest.json`` that can reproduce it byte for byte.

The entity input is first written into the export folder (``entities.parquet``), and the
join always reads it from there, so a reproduction runs the very same plan. Delta time
travel pins every history table to the version the original export read.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from featurestore.errors import FeatureStoreError
from featurestore.registry.store import atomic_write
from featurestore.retrieval.historical import RetrievalJob, entity_input

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

DATA_FILE = "data-00000.parquet"
ENTITIES_FILE = "entities.parquet"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entity_table(entity_df: Any) -> pa.Table:
    if isinstance(entity_df, pa.Table):
        return entity_df
    if isinstance(entity_df, (str, Path)):
        rows = entity_input(entity_df)
        return pq.read_table(rows) if isinstance(rows, Path) else rows
    return pa.Table.from_pandas(entity_df, preserve_index=False)


def export_training_dataset(
    store: "FeatureStore", entity_df: Any, feature_service: str, out: Path, *, progress: bool = False,
    versions: dict[str, int | None] | None = None, expected_hashes: dict[str, str] | None = None,
) -> dict[str, Any]:
    from featurestore import __version__

    out.mkdir(parents=True, exist_ok=True)
    entities_path = out / ENTITIES_FILE
    if entity_df is not None:
        pq.write_table(_entity_table(entity_df), entities_path, compression="zstd")
    service = store.get_feature_service(feature_service)
    refs = service.feature_refs()
    views = list(dict.fromkeys(r.split(":")[0] for r in refs))
    hashes = store.definition_hashes(views)
    if expected_hashes is not None:
        changed = sorted(v for v in views if expected_hashes.get(v) != hashes.get(v))
        if changed:
            raise FeatureStoreError(
                f"the definitions of {changed} changed since this dataset was exported; "
                "check out the definitions the manifest names to reproduce it"
            )
    job = RetrievalJob.build(store, str(entities_path), None, feature_service, False, versions=versions)
    total = pq.ParquetFile(entities_path).metadata.num_rows
    columns = [TextColumn("exporting {task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=Console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task(feature_service, total=total)
        rows = job.to_parquet(out / DATA_FILE, on_batch=lambda n: bar.advance(task, n))
    schema = pq.read_schema(out / DATA_FILE)
    manifest = {
        "feature_service": feature_service,
        "features": refs,
        "definition_hashes": hashes,
        "table_versions": job.table_versions,
        "entities": {"file": ENTITIES_FILE, "sha256": sha256_file(entities_path), "rows": total},
        "row_count": rows,
        "schema": [{"name": f.name, "type": str(f.type)} for f in schema],
        "files": [{"path": DATA_FILE, "sha256": sha256_file(out / DATA_FILE), "rows": rows}],
        "created_at": datetime.now(timezone.utc).isoformat(),
        "package_version": __version__,
    }
    manifest["manifest_hash"] = hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "created_at"}, sort_keys=True).encode()).hexdigest()
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


def reproduce(store: "FeatureStore", manifest_path: Path, out: Path, progress: bool = False) -> dict[str, Any]:
    """Re-run an export from its manifest into ``out``; raise if any data file differs."""
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
    new = export_training_dataset(
        store, None, manifest["feature_service"], out, progress=progress,
        versions=manifest["table_versions"], expected_hashes=manifest["definition_hashes"],
    )
    mismatched = [f["path"] for f, g in zip(manifest["files"], new["files"]) if f["sha256"] != g["sha256"]]
    if mismatched:
        raise FeatureStoreError(f"reproduced files {mismatched} differ from the manifest's hashes")
    return new
