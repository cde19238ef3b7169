"""Definitions load, every validation error is reported with a fix, plan/apply diffs, atomic registry."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from featurestore import FeatureStore
from featurestore.config import RepoConfig
from featurestore.errors import DefinitionError, FeatureStoreError
from featurestore.files import atomic_write
from featurestore.online.base import EMBEDDED
from featurestore.registry import RegistryStore

from .conftest import write_repo

REPO_ROOT = Path(__file__).resolve().parents[1]

STATS = pa.table(
    {
        "driver_id": pa.array([1, 2], pa.int64()),
        "event_timestamp": pa.array([datetime(2024, 1, 1, tzinfo=UTC)] * 2, pa.timestamp("us", tz="UTC")),
        "conv_rate": [0.5, 0.7],
        "trips": pa.array([3, 4], pa.int64()),
        "city": ["a", "b"],
    }
)

GOOD = """
from datetime import timedelta
from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64, String

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)
stats = FeatureView(
    name="driver_stats", entities=[driver],
    source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("conv_rate", Float64), Field("trips", Int64)], ttl=timedelta(days=1),
)
svc = FeatureService(name="svc", features=[stats[["conv_rate"]]])
"""


def test_example_definitions_load(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATURESTORE_DATA_DIR", str(tmp_path))
    store = FeatureStore(REPO_ROOT / "definitions")
    names = {v.name for v in store.list_feature_views()}
    assert {"card_profile", "card_activity", "merchant_risk"} <= names
    assert store.get_feature_service("fraud_model_v1").feature_refs()[0] == "card_profile:credit_limit"


def test_only_listed_modules_are_imported(tmp_path):
    root = write_repo(tmp_path, GOOD, {"stats": STATS})
    (root / "script.py").write_text("raise SystemExit('must not run')\n")
    assert [v.name for v in FeatureStore(root).list_feature_views()] == ["driver_stats"]


BAD = """
from datetime import timedelta
from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64, String

driver = Entity(name="driver", join_keys=["driver_id"], value_type=String)
rider = Entity(name="rider", join_keys=["rider_id"])
src = FileSource(path="data/stats.parquet", timestamp_field="event_timestamp")
a = FeatureView(name="bad_view", entities=[driver, rider], source=src,
                schema=[Field("conv_rate", Int64), Field("missing_col", Float64), Field("city", Float64)],
                ttl=timedelta(days=-1))
b = FeatureView(name="bad_view", entities=[driver], source=src, schema=[Field("trips", Int64)])
c = FeatureView(name="no_file", entities=[driver], source=FileSource(path="data/nope.parquet", timestamp_field="ts"),
                schema=[Field("x", Int64)])
d = FeatureView(name="bad_ts", entities=[rider], source=src, schema=[Field("trips", Int64)]) if False else None
svc = FeatureService(name="svc", features=[a[["not_a_feature"]]])
"""


def test_every_validation_error_is_reported_with_location_and_fix(tmp_path):
    root = write_repo(tmp_path, BAD, {"stats": STATS})
    with pytest.raises(DefinitionError) as info:
        FeatureStore(root).definitions
    text = str(info.value)
    problems = info.value.problems
    assert any("defined twice" in p and "features.py:" in p for p in problems)
    # the second 'bad_view' is rejected as a duplicate; the rest are checked together
    expected = [
        "ttl must be a timedelta >= 0",
        "join key 'rider_id' of entity 'rider' is not in the source",
        "join key 'driver_id' is String on entity 'driver' but int64",
        "feature 'conv_rate' is declared Int64 but is double in the source; declare it as Float64",
        "feature 'missing_col' is not in the source",
        "feature 'city' is declared Float64 but is string in the source; declare it as String",
        "feature view 'no_file'",
        "feature 'not_a_feature' is not in view 'bad_view'",
    ]
    for fragment in expected:
        assert fragment in text, fragment
    assert all("features.py:" in p for p in problems if p.startswith("feature view"))


def test_reserved_and_duplicate_feature_names(tmp_path):
    code = GOOD.replace(
        'schema=[Field("conv_rate", Float64), Field("trips", Int64)]',
        'schema=[Field("conv_rate", Float64), Field("conv_rate", Float64), Field("event_timestamp", Float64)]',
    )
    with pytest.raises(DefinitionError) as info:
        FeatureStore(write_repo(tmp_path, code, {"stats": STATS})).definitions
    assert "appears twice" in str(info.value) and "reserved" in str(info.value)


def test_a_name_ending_in_a_newline_is_no_name(tmp_path):
    """Names are letters, digits and underscores, the whole name: ``driver_stats\\n`` (whose
    line break ``^…$`` let through) names a view's keys and fields, and is refused."""
    code = GOOD.replace('name="driver_stats"', 'name="driver_stats\\n"')
    with pytest.raises(DefinitionError, match="names must be letters, digits and underscores"):
        FeatureStore(write_repo(tmp_path, code, {"stats": STATS})).definitions


def test_a_dedup_window_needs_aggregations(tmp_path):
    """``dedup_window`` says which writes of an event id are one event: a view without
    aggregations stores no events, and is told to remove it (not silently ignored)."""
    code = GOOD.replace('name="driver_stats",', 'name="driver_stats", dedup_window=timedelta(hours=1),')
    with pytest.raises(DefinitionError, match="dedup_window is for views with aggregations"):
        FeatureStore(write_repo(tmp_path, code, {"stats": STATS})).definitions


def test_import_error_names_the_module(tmp_path):
    with pytest.raises(DefinitionError, match="importing .*features.py failed"):
        FeatureStore(write_repo(tmp_path, "import not_a_module\n")).definitions


def test_plan_apply_diff_add_change_remove(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_url)
    root = write_repo(tmp_path, GOOD, {"stats": STATS})
    store = FeatureStore(root)
    plan = store.plan()
    assert {(c.kind, c.name, c.action) for c in plan.changes} == {
        ("entity", "driver", "add"),
        ("feature_view", "driver_stats", "add"),
        ("feature_service", "svc", "add"),
    }
    store.apply()
    assert FeatureStore(root).plan().empty

    # change the ttl (metadata) and the schema (data): only the latter needs a backfill
    (root / "features.py").write_text(GOOD.replace("ttl=timedelta(days=1)", "ttl=timedelta(days=2)"))
    change = FeatureStore(root).plan().changes[0]
    assert (change.action, change.attributes, change.needs_backfill) == ("change", ["ttl_seconds"], False)
    (root / "features.py").write_text(GOOD.replace('Field("trips", Int64)', 'Field("city", String)'))
    change = FeatureStore(root).plan().changes[0]
    assert (
        change.attributes == ["schema"]
        and change.needs_backfill
        and "featurestore backfill driver_stats" in change.describe()
    )

    # removing a view needs force
    (root / "features.py").write_text(GOOD.split("stats = FeatureView")[0])
    plan = FeatureStore(root).plan()
    assert {(c.name, c.action) for c in plan.changes} == {("driver_stats", "remove"), ("svc", "remove")}
    with pytest.raises(FeatureStoreError, match="--force"):
        FeatureStore(root).apply()
    store = FeatureStore(root)
    store.apply(force=True)
    assert store.registry.current()["version"] == 2
    assert store.registry.versions() == [1, 2]
    assert "driver_stats" in store.registry.version(1)["objects"]["feature_view"]
    store.close()


def test_registry_survives_crash_between_temp_write_and_rename(tmp_path, monkeypatch):
    registry = RegistryStore(tmp_path / "reg")
    registry.apply({"entity": {"a": {"hash": "1", "spec": {}}}})
    before = (tmp_path / "reg" / "registry.json").read_bytes()

    def crash(*args, **kwargs):
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        registry.apply({"entity": {"b": {"hash": "2", "spec": {}}}})
    monkeypatch.undo()
    assert (tmp_path / "reg" / "registry.json").read_bytes() == before
    assert RegistryStore(tmp_path / "reg").current()["objects"] == {"entity": {"a": {"hash": "1", "spec": {}}}}
    assert not [p for p in (tmp_path / "reg").rglob("*.tmp")]


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "f.json"
    atomic_write(target, b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"


def test_config_defaults_and_env_override(tmp_path, monkeypatch):
    root = write_repo(tmp_path, GOOD)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("FEATURESTORE_DATA_DIR", raising=False)
    config = RepoConfig.load(root)
    assert config.online.url == EMBEDDED and config.offline.location.path == root / "data" / "offline"
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    assert RepoConfig.load(root).online.url == "redis://example:6379/0"


def test_cli_help_plan_and_readable_errors(tmp_path):
    root = write_repo(tmp_path / "ok", GOOD, {"stats": STATS})
    cli = [sys.executable, "-m", "featurestore.cli"]
    assert "plan" in subprocess.run([*cli, "--help"], capture_output=True, text=True, check=True).stdout
    out = subprocess.run([*cli, "plan", "--repo", str(root)], capture_output=True, text=True, check=True).stdout
    assert "+ feature view driver_stats" in out
    bad = write_repo(tmp_path / "bad", BAD, {"stats": STATS})
    result = subprocess.run([*cli, "plan", "--repo", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "problems in the feature definitions" in result.stderr and "Traceback" not in result.stderr
    missing = subprocess.run([*cli, "plan", "--repo", str(tmp_path / "none")], capture_output=True, text=True)
    assert missing.returncode == 1 and "featurestore init" in missing.stderr


def test_init_scaffold_plans_and_applies(tmp_path, redis_url, monkeypatch):
    from featurestore.scaffold import scaffold

    monkeypatch.setenv("REDIS_URL", redis_url)
    scaffold(tmp_path / "new", "demo_proj")
    store = FeatureStore(tmp_path / "new")
    assert not store.apply().empty
    store.close()


def test_a_type_change_never_serves_old_bytes(make_store, tmp_path):
    """Issue #9: after Int64 -> Float64 a stored 4 used to decode as 2e-323, PRESENT. Values are
    written under the view's storage layout, so until re-materialized the lookup says NOT_FOUND."""
    recent = STATS.set_column(1, "event_timestamp", pa.array([datetime.now(UTC)] * 2, pa.timestamp("us", tz="UTC")))
    store = make_store(GOOD, {"stats": recent})
    store.apply()
    store.materialize(None, None)
    ask = dict(features=["driver_stats:trips"])
    assert store.get_online_features([{"driver_id": 2}], **ask).to_dict()["trips"] == [4]
    (store.config.repo_path / "features.py").write_text(
        GOOD.replace('Field("trips", Int64)', 'Field("trips", Float64)')
    )
    changed = FeatureStore(store.config.repo_path)
    changed.apply()
    response = changed.get_online_features([{"driver_id": 2}], **ask)
    assert response.statuses[1] == ["NOT_FOUND"] and response.to_dict()["trips"] == [None]
    changed.materialize(None, None)  # history already has the rows: the new layout still gets them all
    assert changed.get_online_features([{"driver_id": 2}], **ask).to_dict()["trips"] == [4.0]
    changed.close()


def test_plan_warnings_reach_the_terminal(tmp_path):
    """Issue #9: rich read "[... needs --force]" as markup and printed nothing of it."""
    root = write_repo(tmp_path, GOOD, {"stats": STATS})
    assert (
        subprocess.run(
            [sys.executable, "-m", "featurestore.cli", "apply", "--repo", str(root)], capture_output=True
        ).returncode
        == 0
    )
    (root / "features.py").write_text(GOOD.replace('Field("trips", Int64)', 'Field("trips", Float64)'))
    out = subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "plan", "--repo", str(root)], capture_output=True, text=True
    ).stdout
    assert (
        "[new version v2: its history starts empty and its online values read NOT_FOUND until `featurestore backfill driver_stats`"
        in out
    )
    assert "[Redis keeps its values of the earlier layout until `featurestore compact --drop-old-layouts`]" in out
    (root / "features.py").write_text("from featurestore import Entity\n")
    out = subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "plan", "--repo", str(root)], capture_output=True, text=True
    ).stdout
    assert "[its stored data will be deleted: needs --force]" in out


def test_metadata_edits_do_not_change_definition_hashes(tmp_path):
    """Models and manifests record these hashes: a description edit must not make them stale (issue #9)."""
    root = write_repo(tmp_path, GOOD, {"stats": STATS})
    before = FeatureStore(root).definition_hashes(["driver_stats"])
    (root / "features.py").write_text(
        GOOD.replace("ttl=timedelta(days=1),", "ttl=timedelta(days=1), description='now documented', owner='me',")
    )
    assert FeatureStore(root).definition_hashes(["driver_stats"]) == before
    (root / "features.py").write_text(GOOD.replace("ttl=timedelta(days=1)", "ttl=timedelta(days=2)"))
    assert FeatureStore(root).definition_hashes(["driver_stats"]) != before


def test_unapplied_code_is_never_used(make_store):
    """Issue #9: materialize and lookups read features.py whether or not it was applied."""
    store = make_store(GOOD, {"stats": STATS})
    root = store.config.repo_path
    (root / "features.py").write_text(GOOD.replace('Field("trips", Int64)', 'Field("trips", Float64)'))
    edited = FeatureStore(root)
    for attempt in (
        lambda: edited.materialize(None, None),
        lambda: edited.get_online_features([{"driver_id": 1}], features=["driver_stats:trips"]),
        lambda: edited.get_historical_features(
            pa.table({"driver_id": [1], "event_timestamp": STATS["event_timestamp"][:1]}), feature_service="svc"
        ),
    ):
        with pytest.raises(
            FeatureStoreError,
            match=r"differ from the applied registry: feature view 'driver_stats' \(changed: schema\).*featurestore apply",
        ):
            attempt()
    listed = subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "list", "--repo", str(root)], capture_output=True, text=True
    ).stdout
    assert "Not applied" in listed and "feature view 'driver_stats' (changed: schema)" in listed
    edited.apply()
    assert edited.materialize(None, None).views
    edited.close()


def test_layers_import_one_way():
    """Issue #9: engines took the whole FeatureStore and imported feature_store.py, which imported
    them back; the library imported the serving app. Engines now take their parts."""
    import ast

    package = REPO_ROOT / "featurestore"
    engines = ["materialization", "retrieval", "offline", "online", "registry", "aggregation", "training"]
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "serving" or m.startswith("serving.") for m in imported), f"{path} imports the serving app"
        if path.relative_to(package).parts[0] in engines:
            assert "featurestore.feature_store" not in imported, f"{path} reaches back into the FeatureStore façade"
