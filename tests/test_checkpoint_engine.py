"""The checkpoint engine (issue #13) with real processes: a source and replica engines with their
own registries (no shared folder), a broadcast tree, a replica killed and restarted, a corrupt
copy refused, and rollback."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from featurestore import FeatureStore
from featurestore.training.model_registry import MODEL_FILES, ModelRegistry

from .conftest import free_port, write_repo


class Engine:
    def __init__(
        self,
        root: Path,
        redis_url: str,
        source: str | None = None,
        upstream: str | None = None,
        storage: str = "",
        *extra: str,
    ):
        self.repo = write_repo(root, "", url=redis_url, storage=storage)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "featurestore.cli",
            "checkpoint-engine",
            "--model",
            "m",
            "--repo",
            str(self.repo),
            "--port",
            str(self.port),
            *(["--source", source] if source else []),
            *(["--upstream", upstream] if upstream else []),
            *extra,
        ]
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _until(lambda: httpx.get(self.url + "/stats").status_code == 200, [self])

    @property
    def registry(self) -> ModelRegistry:
        return FeatureStore(self.repo).model_registry()

    def serves(self, version: int) -> bool:
        try:
            return self.registry.aliases("m").get("production") == version
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _until(condition, engines, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines:
            if e.process.poll() is not None:
                pytest.fail(f"engine exited: {e.process.stderr.read()[-2000:]}")
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail("condition not met in time")


@pytest.mark.slow
def test_versions_reach_every_replica_through_a_tree_and_catch_up(tmp_path, redis_url, run):
    source = Engine(tmp_path / "source", redis_url)
    first = Engine(tmp_path / "r1", redis_url, source=source.url)
    second = Engine(tmp_path / "r2", redis_url, source=source.url, upstream=first.url)
    third = Engine(tmp_path / "r3", redis_url, source=source.url, upstream=first.url)
    engines = [source, first, second, third]
    try:
        v1 = source.registry.register("m", run)
        source.registry.promote("m", v1, "production")
        _until(lambda: all(e.serves(v1) for e in engines[1:]), engines)
        for replica in engines[1:]:  # byte for byte what was registered, verified by hash
            assert replica.registry.hashes("m")[v1] == source.registry.hashes("m")[v1]
            assert replica.registry.load("m", "production").version == v1
        # the source sent the version once (to r1); r2 and r3 took it from r1
        assert httpx.get(source.url + "/stats").json()["files_served"] == len(MODEL_FILES)

        third.stop()  # a replica down while a new version is promoted catches up when it is back
        v2 = source.registry.register("m", run)
        source.registry.promote("m", v2, "production")
        _until(lambda: first.serves(v2) and second.serves(v2), engines[:3])
        assert third.serves(v1)
        third.start()
        _until(lambda: third.serves(v2), engines)

        # a corrupt copy upstream is refused; the replica gets an intact one from the source
        (first.registry.root / "m" / str(v2) / "model.pt").write_bytes(b"not the weights")
        fourth = Engine(tmp_path / "r4", redis_url, source=source.url, upstream=first.url)
        engines.append(fourth)
        _until(lambda: fourth.serves(v2), engines)
        assert fourth.registry.hashes("m")[v2] == source.registry.hashes("m")[v2]
        fourth.registry.verify("m", v2)

        # rollback is one command, and reaches the replicas like a promotion
        subprocess.run(
            [sys.executable, "-m", "featurestore.cli", "models", "rollback", "m", "--repo", str(source.repo)],
            check=True,
            capture_output=True,
        )
        _until(lambda: all(e.serves(v1) for e in (second, third, fourth)), engines)
    finally:
        for e in engines:
            e.stop()


def test_a_version_that_does_not_load_is_never_promoted_on_a_replica(tmp_path, redis_url, run):
    source = Engine(tmp_path / "source", redis_url)
    replica = Engine(tmp_path / "r1", redis_url, source=source.url)
    try:
        good = source.registry.register("m", run)
        source.registry.promote("m", good, "production")
        _until(lambda: replica.serves(good), [source, replica])
        # a version whose weights are not a model: registered (hashes match), but it does not load
        bad = source.registry.register("m", run)
        folder = source.registry.root / "m" / str(bad)
        (folder / "model.pt").write_bytes(b"garbage")
        ledger = json.loads(source.registry.ledger.read_text())
        ledger["m"][str(bad)]["model.pt"] = hashlib.sha256(b"garbage").hexdigest()
        source.registry.ledger.write_text(json.dumps(ledger))
        aliases = source.registry.root / "m" / "aliases.json"
        aliases.write_text(json.dumps({"production": bad}))  # forced past `promote`'s own check
        time.sleep(3)
        assert replica.serves(good) and replica.process.poll() is None  # keeps the good one, keeps running
    finally:
        for e in (source, replica):
            e.stop()


def test_engines_take_the_servers_api_keys_and_replicas_present_theirs(tmp_path, redis_url, run, monkeypatch):
    """With keys configured, anonymous ``GET /models/m/1/model.pt`` returned the weights, the
    engine started on 0.0.0.0 without keys, and replicas sent no credentials."""
    import os

    from featurestore.auth import hash_key

    entries = [
        {"name": "replicas", "sha256": hash_key("key-replicas"), "scopes": ["read"]},
        {"name": "pusher", "sha256": hash_key("key-pusher"), "scopes": ["push"]},
    ]
    source = Engine.__new__(Engine)
    source.repo = write_repo(tmp_path / "source", "", url=redis_url)
    with open(source.repo / "featurestore.yaml", "a") as f:
        f.write("server:\n  auth:\n    keys: " + json.dumps(entries) + "\n")
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "checkpoint-engine",
            "--model",
            "m",
            "--repo",
            str(write_repo(tmp_path / "open", "", url=redis_url)),
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "server.auth" in refused.stderr and "Traceback" not in refused.stderr
    source.port = free_port()
    source.url = f"http://127.0.0.1:{source.port}"
    source.args = [
        sys.executable,
        "-m",
        "featurestore.cli",
        "checkpoint-engine",
        "--model",
        "m",
        "--repo",
        str(source.repo),
        "--port",
        str(source.port),
        "--broadcast",
    ]
    source.process = subprocess.Popen(source.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    monkeypatch.setenv("FEATURESTORE_API_KEY", "key-replicas")  # what the replica presents
    replica = None
    try:
        _until(
            lambda: httpx.get(source.url + "/stats", headers={"X-API-Key": "key-replicas"}).status_code == 200, [source]
        )
        v1 = source.registry.register("m", run)
        source.registry.promote("m", v1, "production")
        assert httpx.get(f"{source.url}/models/m/{v1}/model.pt").status_code == 401
        assert httpx.get(f"{source.url}/models/m/{v1}/model.pt", headers={"X-API-Key": "key-pusher"}).status_code == 403
        assert httpx.get(f"{source.url}/models/m", headers={"X-API-Key": "key-replicas"}).status_code == 200
        # a seat in the weight broadcast (where its group meets) is given to the same keys only
        join = {"member": "someone", "wait": 0}
        assert httpx.post(f"{source.url}/broadcast/join", json=join).status_code == 401
        assert (
            httpx.post(f"{source.url}/broadcast/join", json=join, headers={"X-API-Key": "key-pusher"}).status_code
            == 403
        )
        assert (
            httpx.post(f"{source.url}/broadcast/join", json=join, headers={"X-API-Key": "key-replicas"}).status_code
            == 204
        )
        replica = Engine(tmp_path / "r1", redis_url, source=source.url)
        _until(lambda: replica.serves(v1), [source, replica])
        assert os.environ["FEATURESTORE_API_KEY"] == "key-replicas"
    finally:
        for e in (source, replica):
            if e is not None:
                e.stop()


def test_a_replica_refuses_names_and_versions_that_would_leave_its_registry(tmp_path):
    """A source announcing version ``"../../../t9-escaped"`` made the replica create that folder
    with the source's files and record it in its ledger. Peers' names and versions are now
    checked like user input."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from featurestore.checkpoint_engine import Replica
    from featurestore.errors import FeatureStoreError

    digest = hashlib.sha256(b"x").hexdigest()
    answers = [
        {
            "aliases": {"production": "../../../t9-escaped"},
            "versions": {"../../../t9-escaped": {f: digest for f in MODEL_FILES}},
            "revision": "a",
        },
        {
            "aliases": {"production": 1},
            "versions": {"1": {f: digest for f in MODEL_FILES}, "../../x": {}},
            "revision": "b",
        },
        {"aliases": {"../stage": 1}, "versions": {"1": {f: digest for f in MODEL_FILES}}, "revision": "c"},
        {"aliases": {"production": 1}, "versions": {"1": {f: "../../etc" for f in MODEL_FILES}}, "revision": "d"},
    ]

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(answers[0]).encode() if self.path.startswith("/models/m") else b"x"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = ModelRegistry(tmp_path / "replica" / "models", tmp_path / "replica" / "registry" / "models.json")
    replica = Replica(registry, "m", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        while answers:
            with pytest.raises(FeatureStoreError, match="refusing its state"):
                replica.sync_once()
            answers.pop(0)
    finally:
        server.shutdown()
    assert not any(p.name.startswith("t9") for p in tmp_path.rglob("*")) and not registry.ledger.exists()
    with pytest.raises(FeatureStoreError, match="not a model name"):
        Replica(registry, "../escape", "http://127.0.0.1:1").registry.versions("../escape")


@pytest.mark.slow
def test_replicas_fetch_from_the_object_store_before_the_source(tmp_path, redis_url, run, s3_endpoint):
    """The source's durable state on S3: a replica given --models-from fetches each version there,
    verified against the source's hashes, and the source sends it no file; a replica pointed at
    an object store without the version gets it from the source."""
    from .conftest import s3_bucket

    bucket, options = s3_bucket(s3_endpoint)
    empty, _ = s3_bucket(s3_endpoint)
    reach = f"storage_options: {json.dumps(options)}\n"
    source = Engine(tmp_path / "source", redis_url, None, None, f"data_dir: s3://{bucket}/data\n{reach}")
    stored = Engine(tmp_path / "r1", redis_url, source.url, None, reach, "--models-from", f"s3://{bucket}/data")
    wrong = Engine(tmp_path / "r2", redis_url, source.url, None, reach, "--models-from", f"s3://{empty}/data")
    engines = [source, stored, wrong]
    try:
        for round in (1, 2):
            version = source.registry.register("m", run)
            source.registry.promote("m", version, "production")
            _until(lambda: stored.serves(version) and wrong.serves(version), engines)
            for replica in (stored, wrong):
                assert replica.registry.hashes("m")[version] == source.registry.hashes("m")[version]
            # the one copy the source sent per version went to the replica without the version in its store
            assert httpx.get(source.url + "/stats").json()["files_served"] == round * len(MODEL_FILES)
    finally:
        for e in engines:
            e.stop()
