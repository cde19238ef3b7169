"""The OpenAPI documents say what the servers do: schemathesis (``--checks all``: undocumented
statuses and content types, schema-valid requests refused, schema-violating ones accepted,
5xx) against real server processes reports nothing. The inference server's run is in
``test_training_serving`` (it needs a trained model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from featurestore import FeatureStore

from .conftest import free_port, write_repo
from .test_feature_server import DEFS

EXAMPLES = os.environ.get("FEATURESTORE_SCHEMATHESIS_EXAMPLES", "10")  # more in a thorough run


def schemathesis(url: str, timeout: float = 300) -> None:
    """``st run`` over the server's document; its report on failure."""
    st = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "-n",
        EXAMPLES,
        "--seed",
        "1",
        "--request-timeout",
        "30",
    ]
    out = subprocess.run(st, capture_output=True, text=True, timeout=timeout, env={**os.environ, "NO_COLOR": "1"})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "generated" in out.stdout, out.stdout[-2000:]


def serving(command: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"{command} did not serve")


def test_the_feature_servers_document_matches_it(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", DEFS, url=redis_url)
    with FeatureStore(root) as store:
        store.apply()
    port = free_port()
    server = serving(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve",
            "--repo",
            str(root),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        port,
    )
    try:
        schemathesis(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(30)


def test_the_checkpoint_engines_document_matches_it(tmp_path, redis_url):
    root = write_repo(tmp_path / "repo", DEFS, url=redis_url)
    port = free_port()
    engine = serving(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "checkpoint-engine",
            "--model",
            "m",
            "--repo",
            str(root),
            "--port",
            str(port),
        ],
        port,
    )
    try:
        schemathesis(f"http://127.0.0.1:{port}")
    finally:
        engine.terminate()
        engine.wait(30)


def test_the_uis_document_matches_it(tmp_path, redis_url, monkeypatch):
    """The UI's API (``/ui/api``): its 404s were undocumented, its names' and hashes' patterns
    unsaid (refused as 422s the document did not foresee), its one-message 422s outside the
    document's shape of FastAPI's list, and a model name the registry refuses a 400."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", DEFS, url=redis_url)
    with FeatureStore(root) as store:
        store.apply()
    port = free_port()
    ui = serving([sys.executable, "-m", "featurestore.cli", "ui", "--repo", str(root), "--port", str(port)], port)
    try:
        schemathesis(f"http://127.0.0.1:{port}/ui")
    finally:
        ui.terminate()
        ui.wait(30)
