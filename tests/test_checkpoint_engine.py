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

from featurestore.training.model_registry import MODEL_FILES, ModelRegistry
from featurestore.training.trainer import TrainConfig, train

from .conftest import free_port, write_repo
from .test_distributed_training import make_dataset


class Engine:
    def __init__(self, root: Path, redis_url: str, source: str | None = None, upstream: str | None = None):
        self.repo = write_repo(root, "", url=redis_url)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "featurestore.cli", "checkpoint-engine", "--model", "m", "--repo", str(self.repo),
                     "--port", str(self.port), *(["--source", source] if source else []), *(["--upstream", upstream] if upstream else [])]
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _until(lambda: httpx.get(self.url + "/stats").status_code == 200, [self])

    @property
    def registry(self) -> ModelRegistry:
        return ModelRegistry(self.repo / "data" / "models", self.repo / "data" / "registry" / "models.json")

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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    dataset = make_dataset(folder / "ds", rows=1500)
    return train(TrainConfig(dataset=str(dataset), epochs=1, device="cpu"), folder / "runs", progress=False)


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
        subprocess.run([sys.executable, "-m", "featurestore.cli", "models", "rollback", "m", "--repo", str(source.repo)], check=True,
                       capture_output=True)
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
