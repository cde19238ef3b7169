"""Promotions broadcast in memory to inference servers (issue #28), with real processes: each
replica (its own registry, no shared folder) flips in place between requests while a request
loop runs, serves the source's weights bit for bit, and keeps what it has when a bucket arrives
damaged; a replica killed mid-broadcast does not hold the others, and catches up from a peer."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import httpx
import pytest
import torch
import uvicorn

from featurestore import FeatureStore
from featurestore.auth import ApiKey, hash_key
from featurestore.broadcast_rounds import Coordinator, Transport
from featurestore.checkpoint_engine import Publisher
from featurestore.demo.generate import generate, load_demo
from featurestore.online.embedded import EmbeddedRedis
from featurestore.training.model_registry import ModelRegistry
from serving.checkpoint_engine import create_app

from .conftest import free_port

DEFINITIONS = Path(__file__).resolve().parents[1] / "definitions"
INSTANCE = {"card_id": 7, "merchant_id": 3, "amount": 120.0}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The demo's fraud pipeline once: a source data dir with a run trained by 2 ranks sharing
    one FSDP-sharded model (torchrun, gloo), its Redis."""
    root = tmp_path_factory.mktemp("broadcast")
    redis_server = EmbeddedRedis(root / "redis")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FEATURESTORE_DATA_DIR", str(root / "source"))
        env.setenv("REDIS_URL", redis_server.ensure_running())
        try:
            data = generate(n_cards=200, days=6, seed=5)
            with FeatureStore(DEFINITIONS) as store:
                load_demo(store, data, root / "dataset")
            trained = subprocess.run(
                [
                    *(sys.executable, "-m", "featurestore.cli", "train", "--repo", str(DEFINITIONS)),
                    *("--dataset", str(root / "dataset"), "--request-input", "amount", "--entity-key", "card_id"),
                    *("--epochs", "1", "--device", "cpu", "--nproc-per-node", "2", "--shard-group-size", "2"),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                timeout=300,
            )
            assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
            run = root / "source" / "runs" / trained.stdout.split("run ", 1)[1].split(":", 1)[0]
            yield {"root": root, "run": run, "redis": os.environ["REDIS_URL"]}
        finally:
            redis_server.stop()


def _variant(run: Path, folder: Path, seed: int, embedding_rows: int | None = None) -> Path:
    """A copy of ``run`` with other weights (and, given ``embedding_rows``, a larger key table)."""
    shutil.copytree(run, folder)
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    for name, tensor in state["model"].items():
        if name.startswith("embeddings.") and embedding_rows and tensor.shape[0] > 1000:
            state["model"][name] = torch.randn(embedding_rows + 1, tensor.shape[1], generator=g)
            state["model_config"]["vocab_sizes"][int(name.split(".")[1])] = embedding_rows + 1
        elif tensor.is_floating_point():
            state["model"][name] = tensor + 0.01 * torch.randn(tensor.shape, generator=g)
    if embedding_rows:
        state["preprocessor"]["hashed"] = {k: embedding_rows for k in state["preprocessor"]["hashed"]}
    torch.save(state, folder / "checkpoint.pt")
    return folder


KEY = "key-replicas"  # the only key the source takes; each replica presents it (FEATURESTORE_API_KEY)


class Source:
    """The trainer-side engine in broadcast mode, in this process (so a test can tamper with it),
    behind one API key."""

    def __init__(self, data_dir: Path, bucket_bytes: int, timeout: float = 10.0, transport: Transport = "auto"):
        self.registry = ModelRegistry(data_dir / "models", data_dir / "registry" / "models.json")
        self.coordinator = Coordinator(
            bucket_bytes=bucket_bytes, timeout_seconds=timeout, gather_seconds=3.0, transport=transport
        )
        self.publisher = Publisher(self.registry, "fraud", self.coordinator)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        keys = [ApiKey("replicas", hash_key(KEY), frozenset({"read"}))]
        config = SimpleNamespace(server=SimpleNamespace(api_keys=keys, max_request_bytes=1 << 20))
        app = create_app(self.registry, config=config, publisher=self.publisher)  # type: ignore[arg-type]
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _until(lambda: httpx.get(self.url + "/stats", headers={"X-API-Key": KEY}).status_code == 200, [])

    def promote(self, version: int) -> None:
        self.registry.promote("fraud", version, "production")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class Replica:
    """An inference server with a registry of its own, taking the source's broadcasts."""

    def __init__(self, data_dir: Path, redis_url: str, source: str):
        self.data_dir, self.port = data_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "FEATURESTORE_DATA_DIR": str(data_dir), "REDIS_URL": redis_url}
        self.env["FEATURESTORE_API_KEY"] = KEY
        self.args = [
            *(sys.executable, "-m", "featurestore.cli", "serve-model", "--repo", str(DEFINITIONS)),
            *("--model", "fraud", "--port", str(self.port), "--source", source, "--no-access-log"),
        ]
        self.start()

    def start(self) -> None:
        self.process = _spawn(self.args, self.env, self.data_dir / "server.log")
        _until(lambda: httpx.get(self.url + "/health").status_code == 200, [self.process])

    @property
    def registry(self) -> ModelRegistry:
        return ModelRegistry(self.data_dir / "models", self.data_dir / "registry" / "models.json")

    def version(self) -> int:
        return httpx.get(self.url + "/health").json()["version"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A server process logging to ``log`` (a pipe nobody reads would fill and stall it)."""
    with open(log, "ab") as out:
        process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=out)
    process.log = log  # type: ignore[attr-defined]
    return process


def _until(condition, processes, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in processes:
            if p.poll() is not None:
                pytest.fail(f"process exited: {p.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            if condition():
                return
        time.sleep(0.1)
    logs = "\n".join(f"{p.log}: {p.log.read_text()[-1500:]}" for p in processes)
    pytest.fail(f"condition not met in time\n{logs}")


def _setup(
    pipeline,
    tmp_path,
    replicas: int,
    bucket_bytes: int,
    embedding_rows: int | None = None,
    transport: Transport = "auto",
):
    """A source with v1 promoted and v2, v3, v4 registered (other weights each; v2 the trained
    run's own, unless ``embedding_rows`` grows its table); replicas holding v1."""
    source_dir = pipeline["root"] / "source"
    data = tmp_path / "source"
    shutil.copytree(source_dir / "registry", data / "registry")
    runs = [
        pipeline["run"]
        if i == 1 and not embedding_rows
        else _variant(pipeline["run"], tmp_path / f"run{i}", i, embedding_rows)
        for i in range(4)
    ]
    source = Source(data, bucket_bytes, transport=transport)
    v1, v2, v3, v4 = (source.registry.register("fraud", run) for run in runs)
    source.promote(v1)
    members = []
    for i in range(replicas):  # each replica's own folders: the definitions registry, and v1 installed
        own = tmp_path / f"replica{i}"
        shutil.copytree(source_dir / "registry", own / "registry")
        registry = ModelRegistry(own / "models", own / "registry" / "models.json")
        registry.install("fraud", v1, source.registry.verify("fraud", v1), source.registry.hashes("fraud")[v1])
        registry.promote("fraud", v1, "production")
        members.append(Replica(own, pipeline["redis"], source.url))
    return source, members, (v1, v2, v3, v4)


class Answer(NamedTuple):
    replica: int
    status: int  # -1: no answer (connection failed)
    version: int
    score: float
    sent: float  # time.monotonic()
    answered: float


class Requests:
    """A closed loop of /predict requests to every replica, each answer recorded with when it ran."""

    def __init__(self, replicas: list[Replica]):
        self.seen: list[Answer] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i, r.url)) for i, r in enumerate(replicas)]
        for t in self.threads:
            t.start()

    def _loop(self, index: int, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    r = client.post("/predict", json={"instances": [INSTANCE]})
                except httpx.HTTPError:
                    self.seen.append(Answer(index, -1, -1, 0.0, sent, time.monotonic()))
                    continue
                body = r.json() if r.status_code == 200 else {}
                version = body.get("model", {}).get("version", -1)
                score = body["predictions"][0]["score"] if body else 0.0
                self.seen.append(Answer(index, r.status_code, version, score, sent, time.monotonic()))

    def answered(self, version: int) -> bool:
        """Whether every replica has answered a request with ``version``."""
        return all(
            any(a.replica == i and a.version == version for a in list(self.seen)) for i in range(len(self.threads))
        )

    def finish(self) -> list[Answer]:
        self.stop.set()
        for t in self.threads:
            t.join()
        return self.seen


def _scores(source: Source, data_dir: Path, versions: tuple[int, ...], monkeypatch) -> dict[int, float]:
    """What each version scores for INSTANCE, served here by an inference app over the source's own
    registry (loaded from its files, not broadcast)."""
    from fastapi.testclient import TestClient

    from serving.inference_server import create_app as inference_app

    monkeypatch.setenv("FEATURESTORE_DATA_DIR", str(data_dir))
    scores = {}
    for version in versions:
        source.promote(version)
        with TestClient(inference_app(DEFINITIONS, log_features=False)) as client:
            body = client.post("/predict", json={"instances": [INSTANCE]}).json()
        assert body["model"]["version"] == version
        scores[version] = body["predictions"][0]["score"]
    return scores


def _assembled_shards(run: Path, into: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as the ranks' shards in ``run``'s last sharded checkpoint hold them,
    assembled by torch's own converter (every rank wrote a part)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = run / "dcp" / (run / "dcp" / "latest").read_text().split()[0]
    assert len(list(checkpoint.glob("*.distcp"))) == 2
    dcp_to_torch_save(checkpoint, into)
    return torch.load(into, weights_only=True)["model"]


def test_promotions_reach_every_replica_in_memory_and_a_damaged_bucket_flips_nobody(pipeline, tmp_path, monkeypatch):
    source, replicas, (v1, v2, v3, v4) = _setup(pipeline, tmp_path, replicas=2, bucket_bytes=64 * 1024)
    processes = [r.process for r in replicas]

    stalled: list[float] = []  # when replica 0 was stopped, when it went on

    def pause(bucket: int, _data) -> None:  # a replica that stalls 2 s (GC, swap) mid-broadcast
        if bucket == 1:
            stalled.append(time.monotonic())
            replicas[0].process.send_signal(signal.SIGSTOP)
            threading.Timer(2.0, resume).start()

    def resume() -> None:
        replicas[0].process.send_signal(signal.SIGCONT)
        stalled.append(time.monotonic())

    try:
        _until(lambda: len(source.coordinator._seen) == 2, processes)  # both seated
        load = Requests(replicas)
        _until(lambda: load.answered(v1), processes)
        source.promote(v2)
        _until(lambda: all(r.version() == v2 for r in replicas) and load.answered(v2), processes)
        # a stall shorter than the round's timeout fails nothing (the source's own side had 1 s)
        source.coordinator.tamper = pause
        source.promote(v3)
        _until(lambda: all(r.version() == v3 for r in replicas), processes)
        # a bucket damaged after hashing: every replica refuses the round and keeps v3
        source.coordinator.tamper = lambda bucket, data: data.__setitem__(0, data[0] ^ 1) if bucket == 1 else None
        source.promote(v4)
        _until(lambda: len(source.publisher.outcomes) == 4, processes)
        time.sleep(1.0)
        assert [r.version() for r in replicas] == [v3, v3]
        seen = load.finish()
    finally:
        for r in replicas:
            r.stop()
        source.stop()
    plain, paused, damaged = list(source.publisher.outcomes)[-3:]  # (v1 went out before anyone sat down)
    assert plain["ok"] and len(plain["members"]) == 2 and plain["attempts"] == 0
    assert plain["transport"] == "shared"  # the replicas are on the source's machine: shared memory
    assert paused["ok"] and len(paused["members"]) == 2 and paused["attempts"] == 0, paused
    assert not damaged["ok"] and "keep" in damaged["error"]
    # no request failed while flipping; one in flight on the stopped replica may outlive its own
    # Redis deadline (0.5 s: a 503, as in any outage), which is the stall's doing, not the flip's
    stopped, went_on = stalled
    failed = [a for a in seen if a.status != 200]
    assert all(a.replica == 0 and a.status == 503 and a.sent < went_on and a.answered > stopped for a in failed), (
        failed,
        stalled,
    )
    seen = [a for a in seen if a.status == 200]
    expected = _scores(source, tmp_path / "source", (v1, v2, v3), monkeypatch)
    shards = _assembled_shards(pipeline["run"], tmp_path / "assembled.pt")
    assert len(set(expected.values())) == 3
    for index, replica in enumerate(replicas):
        versions = [a.version for a in seen if a.replica == index]
        assert versions[0] == v1 and versions[-1] == v3 and versions == sorted(versions)  # flips, never back
        # each answer scored by exactly the version it names, with the source's weights
        assert {(a.version, a.score) for a in seen if a.replica == index} == {(v, expected[v]) for v in (v1, v2, v3)}
        # installed from the broadcast bytes: the same files as registered at the source (hash-checked)
        for version in (v2, v3):
            assert replica.registry.hashes("fraud")[version] == source.registry.hashes("fraud")[version]
        # v2 is what the two sharded ranks trained: their shards, put together from the sharded
        # checkpoint on their own, are the weights this replica took, bit for bit
        served = torch.load(io.BytesIO(replica.registry.file("fraud", v2, "model.pt")), weights_only=True)
        assert set(served["state_dict"]) == set(shards)
        assert all(torch.equal(served["state_dict"][k], shards[k]) for k in shards)
        assert replica.registry.aliases("fraud")["production"] == v3 and v4 not in replica.registry.versions("fraud")


@pytest.mark.slow
def test_a_replica_killed_mid_broadcast_holds_nobody_and_catches_up_from_a_peer(pipeline, tmp_path):
    # a ~50 MB model in 1 MB buckets (its key table one bucket of its own), over the network (the
    # default test covers shared memory): the victim dies after the first bucket reached it, while
    # the rest is on the wire
    source, replicas, (v1, v2, *_) = _setup(
        pipeline, tmp_path, 3, 1 << 20, embedding_rows=1_600_000, transport="network"
    )
    victim = replicas[2]
    kill_at = 1

    def kill(bucket: int, _data) -> None:
        if bucket == kill_at and victim.process.poll() is None:
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()

    engines: list[subprocess.Popen] = []
    try:
        _until(lambda: len(source.coordinator._seen) == 3, [r.process for r in replicas])
        load = Requests(replicas[:2])
        source.coordinator.tamper = kill
        source.promote(v2)
        _until(lambda: all(r.version() == v2 for r in replicas[:2]), [r.process for r in replicas[:2]])
        seen = load.finish()
        outcome = source.publisher.outcomes[-1]
        assert outcome["ok"] and outcome["attempts"] == 1 and len(outcome["members"]) == 2, outcome
        assert outcome["transport"] == "network"
        assert {a.status for a in seen} == {200}
        # the peer: an engine over replica 0's registry; the victim's engine fetches from it first
        peer_port, own_port = free_port(), free_port()
        for port, data_dir, extra in (
            (peer_port, replicas[0].data_dir, []),
            (own_port, victim.data_dir, ["--source", source.url, "--upstream", f"http://127.0.0.1:{peer_port}"]),
        ):
            env = {**victim.env, "FEATURESTORE_DATA_DIR": str(data_dir)}
            command = [sys.executable, "-m", "featurestore.cli", "checkpoint-engine", "--model", "fraud"]
            args = [*command, "--repo", str(DEFINITIONS), "--port", str(port), *extra]
            engines.append(_spawn(args, env, data_dir / "engine.log"))
            _until(lambda: httpx.get(f"http://127.0.0.1:{port}/stats").status_code == 200, engines)
        victim.start()
        _until(lambda: victim.version() == v2, [victim.process, *engines])
        assert (
            httpx.get(source.url + "/stats", headers={"X-API-Key": KEY}).json()["files_served"] == 0
        )  # from the peer, not the source
        assert victim.registry.hashes("fraud")[v2] == source.registry.hashes("fraud")[v2]
    finally:
        for p in engines:
            p.kill()
        for r in replicas:
            r.stop()
        source.stop()


def test_a_member_that_hangs_up_gives_up_its_seat_at_once(tmp_path):
    """A member holds a seat up to 20 s while it waits for a broadcast. One that died (its
    connection gone) kept it until then, and the source's shutdown waited for it: ~20 s after
    every test that killed its replicas. The seat goes as soon as its member hangs up."""
    import socket

    source = Source(tmp_path / "source", bucket_bytes=1 << 20)
    body = b'{"member": "m-1", "stage": "production", "wait": 20}'
    request = (
        b"POST /broadcast/join HTTP/1.1\r\nHost: x\r\nX-API-Key: %b\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (KEY.encode(), len(body), body)
    )
    try:
        member = socket.create_connection(("127.0.0.1", source.port))
        member.sendall(request)
        _until(lambda: "m-1" in source.coordinator._seats, [], timeout=30)
        member.close()  # (as a killed process's socket is closed)
        _until(lambda: "m-1" not in source.coordinator._seats, [], timeout=10)
    finally:
        source.stop()
    assert not source.thread.is_alive()
