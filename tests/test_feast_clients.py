"""Feast 0.67's own SDK against our feature server (issue #12): lookups by list and by service,
`write_to_online_store`, `push` through Feast's `remote` online store, and errors Feast's client
raises as its own typed exceptions.

Slow: Feast lives in its own virtualenv (its pins differ from ours), made on first use under
`.venv-feast/` (about 90 s) or taken from `FEAST_PYTHON`. Run with `python -m pytest -m slow`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import free_port, write_repo
from .test_feature_server import DEFS

HERE = Path(__file__).parent
FEAST = "feast==0.67.0"


def feast_python() -> str:
    if os.environ.get("FEAST_PYTHON"):
        return os.environ["FEAST_PYTHON"]
    venv = HERE.parent / ".venv-feast"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", FEAST], check=True)
    return str(python)


@pytest.mark.slow
def test_feasts_own_sdk_works_against_our_server(tmp_path, redis_url, monkeypatch):
    python = feast_python()
    monkeypatch.delenv("REDIS_URL", raising=False)
    ours = write_repo(tmp_path / "ours", DEFS, url=redis_url)
    (ours / "featurestore.yaml").write_text((ours / "featurestore.yaml").read_text() + "server: {errors: feast}\n")
    subprocess.run(
        [sys.executable, "-m", "featurestore", "apply", "--repo", str(ours)], check=True, capture_output=True
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "featurestore", "serve", "--repo", str(ours), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    shutil.copy(HERE / "feast_client" / "features.py", theirs / "features.py")
    (theirs / "feature_store.yaml").write_text(
        f"project: compat\nregistry: registry.db\nprovider: local\nentity_key_serialization_version: 3\n"
        f"online_store: {{type: remote, path: 'http://127.0.0.1:{port}'}}\noffline_store: {{type: file}}\n"
    )
    try:
        subprocess.run([str(Path(python).parent / "feast"), "apply"], cwd=theirs, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        out = subprocess.run(
            [python, str(HERE / "feast_client" / "client.py"), str(theirs)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert seen["list"] == {"card_id": [1, 2, 99], "amount": [10.5, 20.0, None], "country": ["FR", "DE", None]}
    assert seen["service"] == {"card_id": [1, 2, 99], "amount": [10.5, 20.0, None]}
    assert seen["pushed"] == {"card_id": [3], "amount": [7.0]}
    assert seen["error"]["type"] == "FeastObjectNotFoundException" and "nope" in seen["error"]["message"]
