"""Versioned training-dataset export: Parquet + ``manifest.json`` that can reproduce it byte for byte.

The entity input is first written into the export folder (``entities.parquet``), and the
join always reads it from there, so a reproduction runs the very same plan. Delta time
travel pins every history table to the version the original export read.

An export is written in a folder of its own and published once every file is written (moved
into the output folder, or uploaded to ``s3://``), the earlier manifest removed first and the
new one published last: a reader that finds a manifest finds the files it names. Reproducing
from ``s3://…/manifest.json`` downloads the manifest and the entity input first;
``fetch_dataset`` brings a dataset to a local cache (checked against the manifest's hashes) for
training.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError
from featurestore.files import atomic_write, fsync
from featurestore.offline.base import OfflineStore
from featurestore.progress import progress_bar
from featurestore.registry.loader import Definitions
from featurestore.registry.snapshot import applied_definitions, applied_hashes, value_hash
from featurestore.registry.store import RegistryStore
from featurestore.retrieval.historical import JoinBuilder, RetrievalJob, entity_table, entity_time_column
from featurestore.storage import Location

DATA_FILE = "data-00000.parquet"
ENTITIES_FILE = "entities.parquet"
MANIFEST_FILE = "manifest.json"
STATISTICS_FILE = "statistics.parquet"  # each column summarized per entity event day (``statistics``)


@contextlib.contextmanager
def _written_to(out: Location, scratch: Path | None) -> Iterator[Path]:
    """A local folder whose files replace those in ``out`` once all are written (the block ends
    without an error): ``out``'s manifest removed first, then the files moved in (on disk: a
    hidden folder inside ``out``, on its file system) or uploaded (``scratch`` holds them), the
    manifest last. So a manifest names the files beside it: an export that fails or dies before
    publishing leaves the earlier dataset whole, one that dies while publishing leaves no
    manifest (no dataset) where it was, never one naming other files."""
    if out.is_local:
        out.path.mkdir(parents=True, exist_ok=True)
        for abandoned in out.path.glob(f"{_SCRATCH}*"):
            _remove_unless_held(abandoned)
    elif scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=_SCRATCH, dir=out.path if out.is_local else scratch))
    held = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # (held while it is written: a folder no process holds is abandoned)
        yield folder
        _publish(folder, out)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(held)


_SCRATCH = ".export-"  # an export's folder while it is written


def _remove_unless_held(folder: Path) -> None:
    """Remove an export's folder that no process holds: a killed export's."""
    try:
        held = os.open(folder, os.O_RDONLY)
    except OSError:  # (gone meanwhile)
        return
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(folder, ignore_errors=True)
    except BlockingIOError:  # another export is writing it
        pass
    finally:
        os.close(held)


def _publish(folder: Path, out: Location) -> None:
    """The files of ``folder`` into ``out`` (``_written_to``), durable before the manifest names them."""
    files = sorted(folder.iterdir(), key=lambda f: f.name == MANIFEST_FILE)
    if not out.is_local:
        out.remove(MANIFEST_FILE)
        for file in files:
            out.upload(file, file.name)
        return
    for file in files:
        fsync(file)
    with contextlib.suppress(FileNotFoundError):
        (out.path / MANIFEST_FILE).unlink()
    fsync(out.path)
    for file in files:
        os.replace(file, out.path / file.name)
    fsync(out.path)


def summarize_dataset(data: Path, out: Path, time_column: str) -> None:
    """The training distribution a model saw, per entity event day (``time_column``: the entity
    rows' time), beside the dataset: what the UI overlays on served values (a row group at a time:
    memory stays bounded)."""
    from featurestore.statistics import DAY, summarize

    parts, file = [], pq.ParquetFile(data)
    columns = [c for c in file.schema_arrow.names if c != time_column]
    for i in range(file.num_row_groups):
        parts.append(summarize(file.read_row_group(i), columns, time_column, DAY))
    if parts:
        pq.write_table(pa.concat_tables(parts), out)


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
    out: Path | Location,
    *,
    registry_version: int,
    progress: bool = False,
    versions: dict[str, int | None] | None = None,
    join: JoinBuilder = RetrievalJob.build,
    scratch: Path | None = None,
) -> dict[str, Any]:
    """Join ``defs``' service over ``offline`` (at table ``versions``, default latest) into ``out``
    (a folder or ``s3://`` prefix; ``scratch`` holds the files before they are uploaded) with the
    ``join`` engine (local DuckDB, or Ray: the same rows and bytes)."""
    with _written_to(Location.of(out), scratch) as folder:
        return _export(
            defs, offline, entity_df, feature_service, folder, registry_version, progress, versions or None, join
        )


def _export(
    defs: Definitions,
    offline: OfflineStore,
    entity_df: Any,
    feature_service: str,
    out: Path,
    registry_version: int,
    progress: bool,
    versions: dict[str, int | None] | None,
    join: JoinBuilder,
) -> dict[str, Any]:
    from featurestore import __version__

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
    time_column = entity_time_column(pq.read_schema(entities_path))
    summarize_dataset(out / DATA_FILE, out / STATISTICS_FILE, time_column)
    manifest = {
        "feature_service": feature_service,
        "features": refs,
        "definition_hashes": hashes,
        "registry_version": registry_version,
        "history_tables": job.history_tables,
        "table_versions": job.table_versions,
        "entities": {"file": ENTITIES_FILE, "sha256": sha256_file(entities_path), "rows": total},
        "time_column": time_column,  # (the entity rows': the trainer splits by it)
        "row_count": rows,
        "schema": [{"name": f.name, "type": str(f.type)} for f in schema],
        "files": [{"path": DATA_FILE, "sha256": sha256_file(out / DATA_FILE), "rows": rows}],
        # (not among the files: its sketches are not the same bytes twice, and reproducing checks bytes)
        "statistics": STATISTICS_FILE,
        "created_at": datetime.now(UTC).isoformat(),
        "package_version": __version__,
    }
    manifest["manifest_hash"] = manifest_hash(manifest)
    atomic_write(out / MANIFEST_FILE, json.dumps(manifest, indent=2).encode())
    return manifest


def _read_manifest(where: Location) -> dict[str, Any]:
    """The manifest at ``where`` (a ``manifest.json`` file, local or on object storage)."""
    folder, name = where.split()
    found = folder.objects().get(name)
    if found is None:
        raise FeatureStoreError(f"no manifest at {where}; pass the manifest.json an export wrote")
    try:
        return json.loads(found[0])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FeatureStoreError(f"{where} is not a manifest (invalid JSON: {exc})") from None


def reproduce(
    current: Definitions,
    registry: RegistryStore,
    offline: OfflineStore,
    manifest_path: Path | Location,
    out: Path | Location,
    progress: bool = False,
    join: JoinBuilder = RetrievalJob.build,
    scratch: Path | None = None,
) -> dict[str, Any]:
    """Re-run an export from its manifest into ``out``; raise if any data file differs.

    Under the ``current`` definitions when the manifest's views are unchanged, else under the
    registry state the export was made with (its view versions' history stays readable)."""
    where = Location.of(manifest_path)
    manifest = _read_manifest(where)
    defs, registry_version = _definitions_of(manifest, current, registry)
    with _written_to(Location.of(out), scratch) as folder:
        entities = folder / ENTITIES_FILE
        where.split()[0].download(manifest["entities"]["file"], entities)
        if sha256_file(entities) != manifest["entities"]["sha256"]:
            raise FeatureStoreError(
                f"{where.split()[0].child(manifest['entities']['file'])} does not match the manifest's hash; "
                "the entity input was modified"
            )
        new = _export(
            defs,
            offline,
            None,
            manifest["feature_service"],
            folder,
            registry_version,
            progress,
            manifest["table_versions"],
            join,
        )
        mismatched = [f["path"] for f, g in zip(manifest["files"], new["files"]) if f["sha256"] != g["sha256"]]
        if mismatched:  # (not published: the block ends with an error)
            raise FeatureStoreError(f"reproduced files {mismatched} differ from the manifest's hashes")
    return new


def fetch_dataset(dataset: Location, cache: Path) -> Path:
    """A local copy of the exported dataset at ``dataset`` (its folder): the folder itself on disk,
    else ``cache/<manifest hash>``, downloaded once and checked against the manifest's hashes."""
    if dataset.is_local:
        return dataset.path
    manifest = _read_manifest(dataset.child(MANIFEST_FILE))
    target = cache / manifest["manifest_hash"]
    if (target / MANIFEST_FILE).exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    incoming = Path(tempfile.mkdtemp(prefix=".incoming-", dir=cache))
    try:
        for file in [*manifest["files"], {"path": manifest["entities"]["file"], **manifest["entities"]}]:
            dataset.download(file["path"], incoming / file["path"])
            if sha256_file(incoming / file["path"]) != file["sha256"]:
                raise FeatureStoreError(f"{dataset.child(file['path'])} does not match its manifest's hash")
        atomic_write(incoming / MANIFEST_FILE, json.dumps(manifest, indent=2).encode())
        with contextlib.suppress(OSError):  # another process fetched it first: theirs is as good
            incoming.rename(target)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    return target


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
