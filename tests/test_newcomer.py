"""A newcomer's first hour, end to end through the CLI (issue #12): init → plan → apply →
materialize → serve → a lookup over HTTP → export → the generated training script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import free_port


def test_init_to_served_lookup_to_export_and_training(tmp_path, redis_url):
    env = {**os.environ, "REDIS_URL": redis_url}
    repo = tmp_path / "my_repo"

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "featurestore", *args], cwd=repo if repo.exists() else tmp_path,
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    cli("init", str(repo), "--project", f"newcomer{os.getpid()}")
    assert {p.name for p in repo.iterdir()} >= {"featurestore.yaml", "features.py", "README.md", ".gitignore", "train.py", "sources"}
    assert "+ feature view driver_stats" in cli("plan")
    cli("apply")
    assert "driver_stats: 20 rows computed" in cli("materialize-incremental")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "featurestore", "serve", "--port", str(port)], cwd=repo, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = httpx.post(f"http://127.0.0.1:{port}/get-online-features",  # the README's curl
                                  json={"features": ["driver_stats:conv_rate"], "entities": {"driver_id": [1001, 1002]}}).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert body["results"][1]["values"] == [0.9, 0.9] and body["results"][1]["statuses"] == ["PRESENT", "PRESENT"]
    finally:
        server.terminate()
        startup = server.communicate(timeout=30)[1]
    assert "featurestore: serving" in startup
    cli("export", "--service", "driver_activity", "--entities", "sources/labels.parquet", "--out", "datasets/v1")
    assert json.loads((repo / "datasets" / "v1" / "manifest.json").read_text())["row_count"] == 20
    out = subprocess.run([sys.executable, "train.py"], cwd=repo, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "registered as drivers v1" in out.stdout, out.stderr


USER_CODE = '''
from datetime import datetime, timezone

from featurestore import FeatureStore


def main() -> None:
    store = FeatureStore(".")
    store.apply()
    store.materialize_incremental()
    online = store.get_online_features([{"driver_id": 1001}], features=["driver_stats:conv_rate"])
    values: dict[str, list[object]] = online.to_dict()
    rows = {"driver_id": [1001], "event_timestamp": [datetime.now(timezone.utc)]}
    table = store.get_historical_features(rows, features=["driver_stats:conv_rate"]).to_arrow()
    print(values, table.num_rows, store.plan().describe())
'''


@pytest.mark.slow
def test_a_users_repo_passes_mypy_strict(tmp_path):
    """Issue #12: the package shipped no py.typed, so a user's type checker saw none of its API."""
    from pathlib import Path

    from featurestore.scaffold import scaffold

    scaffold(tmp_path / "repo", "typed")
    (tmp_path / "repo" / "use.py").write_text(USER_CODE)
    # installed as a user installs it (not editable), so mypy treats it as PEP 561 says: typed only with py.typed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
                    str(Path(__file__).resolve().parents[1])], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "env")], check=True)
    subprocess.run([str(tmp_path / "env" / "bin" / "pip"), "install", "-q", "--no-deps", *map(str, (tmp_path / "wheel").glob("*.whl"))],
                   check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"),
                          "--python-executable", str(tmp_path / "env" / "bin" / "python"), "features.py", "train.py", "use.py"],
                         cwd=tmp_path / "repo", capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
