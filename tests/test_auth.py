"""API keys on both servers: every route, fast lanes included, refuses a missing or wrong key
and accepts the right scope (issue #11)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from featurestore import FeatureStore
from featurestore.auth import hash_key
from serving.feature_server import create_app

from .conftest import write_repo
from .test_feature_server import DEFS, NOW

KEYS = {"reader": ["read"], "pusher": ["push:events"], "operator": ["materialize"], "root": ["admin"]}
LEDGER = """
ledger = PushSource(name="ledger", schema=[Field("card_id", Int64), Field("total", Float64), Field("event_timestamp", UnixTimestamp)])
stats = FeatureView(name="stats", entities=[card], source=ledger, schema=[Field("total", Float64)])
"""


@pytest.fixture
def secured(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", DEFS + LEDGER, url=redis_url)
    entries = [{"name": n, "sha256": hash_key(f"key-{n}"), "scopes": s} for n, s in KEYS.items()]
    with open(root / "featurestore.yaml", "a") as f:
        f.write("server:\n  auth:\n    keys: " + json.dumps(entries) + "\n")
    with FeatureStore(root) as store:
        store.apply()
    with TestClient(create_app(root)) as client:
        yield client, root


ROUTES = [
    ("post", "/get-online-features", {"features": ["spend:amount"], "entities": {"card_id": [1]}}, "read"),
    (
        "post",
        "/push",
        {
            "push_source_name": "events",
            "df": {"card_id": [1], "amount": [1.0], "country": ["FR"], "event_timestamp": [NOW.isoformat()]},
        },
        "push",
    ),
    ("post", "/materialize-incremental", {}, "materialize"),
    ("get", "/jobs", None, "materialize"),
    ("get", "/health", None, "read"),
    ("get", "/metrics", None, "read"),
    ("get", "/docs", None, "read"),
    ("get", "/openapi.json", None, "read"),
]


@pytest.mark.parametrize("method, path, body, scope", ROUTES)
def test_every_route_needs_a_key_with_its_scope(secured, method, path, body, scope):
    client, _ = secured
    call = lambda headers: getattr(client, method)(
        path, headers=headers, **({"json": body} if body is not None else {})
    )  # noqa: E731
    assert call({}).status_code == 401
    assert call({"Authorization": "Bearer wrong"}).status_code == 401
    allowed = {"read": "reader", "push": "pusher", "materialize": "operator"}[scope]
    for name in KEYS:
        status = call({"X-API-Key": f"key-{name}"}).status_code
        if name in (allowed, "root"):  # (409: a job the previous key started still runs)
            assert status < 400 or (status == 409 and scope == "materialize"), (name, status)
        else:
            assert status == 403, (name, status)
    assert call({"Authorization": f"Bearer key-{allowed}"}).status_code in (200, 202, 409)


def test_a_push_scope_names_its_source(secured):
    client, _ = secured
    other = {"push_source_name": "nope", "df": {"x": [1]}}
    response = client.post("/push", json=other, headers={"X-API-Key": "key-pusher"})
    assert response.status_code == 403 and "push:nope" in response.json()["detail"]


def test_serving_beyond_loopback_needs_keys_or_an_explicit_off(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "open", DEFS, url=redis_url)
    FeatureStore(root).apply()
    result = subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "serve", "--repo", str(root), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "server.auth" in result.stderr and "Traceback" not in result.stderr


def test_api_key_command_prints_a_key_and_its_config(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "featurestore.cli", "api-key", "--name", "svc", "--scope", "read"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    key = next(line.split()[-1] for line in result.stdout.splitlines() if line.startswith("key:"))
    assert hash_key(key) in result.stdout


def test_write_to_online_store_honours_the_push_scopes_source(secured):
    """A key scoped only to ``push:events`` wrote view ``stats`` of another source through
    ``/write-to-online-store`` (and a lookup then served the injected row)."""
    client, _ = secured
    rows = {"card_id": [7], "total": [1e9], "event_timestamp": [NOW.isoformat()]}
    response = client.post(
        "/write-to-online-store", json={"feature_view_name": "stats", "df": rows}, headers={"X-API-Key": "key-pusher"}
    )
    assert response.status_code == 403 and "push:ledger" in response.json()["detail"]
    lookup = client.post(
        "/get-online-features",
        json={"features": ["stats:total"], "entities": {"card_id": [7]}},
        headers={"X-API-Key": "key-reader"},
    )
    assert lookup.json()["results"][1]["statuses"] == ["NOT_FOUND"]
    own = {"card_id": [7], "amount": [2.0], "country": ["FR"], "event_timestamp": [NOW.isoformat()]}
    assert (
        client.post(
            "/write-to-online-store",
            json={"feature_view_name": "spend", "df": own},
            headers={"X-API-Key": "key-pusher"},
        ).status_code
        == 200
    )
    assert (
        client.post(
            "/write-to-online-store", json={"feature_view_name": "stats", "df": rows}, headers={"X-API-Key": "key-root"}
        ).status_code
        == 200
    )


def test_a_projects_keys_are_never_another_projects(tmp_path, redis_url, monkeypatch):
    """``apply --force`` removing view ``stats2`` in project ``shop`` also deleted it in ``shop:eu``
    on the same Redis: ``drop_view`` scanned the glob ``fs:shop:*``."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    stores = {}
    for project in ("shop", "shop:eu", "sh*p"):
        root = write_repo(tmp_path / project.replace(":", "_").replace("*", "x"), DEFS, url=redis_url, project=project)
        store = stores[project] = FeatureStore(root)
        store.apply()
        store.push(
            "events", {"card_id": [1], "amount": [3.0], "country": ["FR"], "event_timestamp": [NOW]}, to="online"
        )
    try:
        shop = stores["shop"]
        (shop.config.repo_path / "features.py").write_text(DEFS.split("spend = FeatureView")[0] + "ledger = None\n")
        shop._definitions, shop._unapplied = None, None
        shop.apply(force=True)  # removes every view of project shop
        for project in ("shop:eu", "sh*p"):
            values = stores[project].get_online_features({"card_id": [1]}, features=["spend:amount"]).to_dict()
            assert values["amount"] == [3.0], project
    finally:
        for store in stores.values():
            store.close()


def test_stored_data_is_private_to_its_user(tmp_path, redis_url, monkeypatch):
    """History tables were readable by other local users (the umask gave 0644 files in 0755
    folders). Every folder the stores keep data in is now 0700, wherever it is configured."""
    import os
    import stat

    monkeypatch.delenv("REDIS_URL", raising=False)
    previous = os.umask(0o022)
    root = write_repo(tmp_path / "repo", DEFS, url=redis_url)
    (tmp_path / "elsewhere").mkdir(mode=0o755)
    with open(root / "featurestore.yaml", "a") as f:
        f.write(f"offline_store: {{path: '{tmp_path / 'elsewhere' / 'history'}'}}\n")
    with FeatureStore(root) as store:
        store.apply()
        store.push(
            "events", {"card_id": [1], "amount": [3.0], "country": ["FR"], "event_timestamp": [NOW]}, to="offline"
        )
        store.flush()
        for folder in (store.config.data_dir, store.config.offline.location.path, store.config.registry.path):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        assert any(store.config.offline.location.path.rglob("*.parquet"))  # the history written, behind a 0700 folder
    os.umask(previous)
