"""The registry and the history on S3-compatible object storage (issue #26), against a real
``moto_server`` process: one contract for local disk and S3 (``storage`` runs each test on
both), and many writers without file locks: Delta commits that resolve conflicts on a re-read
snapshot, registry ledgers updated by compare-and-swap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from featurestore import FeatureStore
from featurestore.errors import ConflictError, FeatureStoreError
from featurestore.offline.delta import DeltaOfflineStore
from featurestore.registry.store import RegistryStore
from featurestore.storage import Location, explain

from .conftest import s3_bucket, s3_storage, write_repo
from .test_aggregations import FEATURES, _frame
from .test_push_path import _payments

NOW = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
STATS_DEFS = """
from datetime import timedelta
from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)
stats = FeatureView(
    name="stats", entities=[driver],
    source=FileSource(path="data/stats.parquet", timestamp_field="event_timestamp"),
    schema=[Field("rating", Float64), Field("trips", Int64)], ttl=timedelta(days=2),
)
svc = FeatureService(name="svc", features=[stats])
"""


def _place(backend: str, name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Location:
    """A folder ``name`` on local disk, or in a new bucket of the test S3 server."""
    if backend == "s3":
        bucket, options = s3_bucket(request.getfixturevalue("s3_endpoint"))
        return Location.parse(f"s3://{bucket}/{name}", tmp_path, options)
    return Location.parse(tmp_path / name, tmp_path)


def _stats(n: int = 200, drivers: int = 20) -> pa.Table:
    return pa.table(
        {
            "driver_id": pa.array([i % drivers for i in range(n)], pa.int64()),
            "event_timestamp": pa.array(
                [NOW - timedelta(hours=(i * 7) % 40, minutes=i % 60) for i in range(n)], pa.timestamp("us", tz="UTC")
            ),
            "rating": pa.array([(i * 37 % 101) / 7 for i in range(n)]),
            "trips": pa.array([i % 13 for i in range(n)], pa.int64()),
        }
    )


def _history_ids(store: FeatureStore, view: str) -> list[int]:
    con = duckdb.connect()
    table = store.layout(view).history_table
    store.offline_store.register(con, table, "h", store.definitions.history_schema(store.definitions.view(view)))
    return [r[0] for r in con.execute("SELECT _row_id FROM h").fetchall()]


def test_materialize_join_export_and_push_read_the_same_on_disk_and_on_s3(make_store, s3_endpoint, tmp_path):
    """One repo's data on local disk and in a bucket: history, point-in-time join, export, online
    values and pushed events come out identical."""
    results = []
    for name in ("local", "s3"):
        storage = (lambda: "") if name == "local" else (lambda: s3_storage(s3_endpoint))  # a bucket per repo
        store = make_store(STATS_DEFS, {"stats": _stats()}, name=name, storage=storage())
        assert store.config.offline.location.is_local == (name == "local")
        store.materialize(None, None)
        entities = pd.DataFrame(
            {"driver_id": [1, 2, 3, 99], "event_timestamp": [NOW - timedelta(hours=h) for h in (0, 5, 20, 1)]}
        )
        joined = store.get_historical_features(entities, ["stats:rating", "stats:trips"]).to_df()
        online = store.get_online_features([{"driver_id": d} for d in (1, 5, 99)], ["stats:rating"]).to_dict()
        manifest = store.export_training_dataset(entities, "svc", tmp_path / name)
        store.materialize(None, None)  # history moves on; the export still reproduces from its versions
        store.reproduce_training_dataset(tmp_path / name / "manifest.json", tmp_path / f"{name}-again")
        pushed = make_store(FEATURES, name=f"{name}-push", storage=storage())
        batch = _frame(_payments(50, seed=3, now=NOW))
        pushed.push("payments", batch, to="online_and_offline", idempotency_key="batch-1")
        pushed.flush()
        pushed.push("payments", batch, to="online_and_offline", idempotency_key="batch-1")  # a client's retry
        pushed.flush()
        ids = _history_ids(pushed, "activity")
        history = _history_ids(store, "stats")
        results.append((joined.fillna(-1).to_dict("list"), online, manifest["files"], sorted(history)))
        assert len(ids) == len(set(ids)) == 50  # the retried push stored once
    for on_disk, on_s3 in zip(*results):
        assert on_disk == on_s3


def test_registry_versions_watermarks_and_run_ids_on_s3(make_store, s3_endpoint):
    store = make_store(STATS_DEFS, {"stats": _stats()}, storage=s3_storage(s3_endpoint))
    assert not store.config.registry.is_local
    assert store.registry.versions() == [1] and store.registry.current()["version"] == 1
    store.materialize(None, None)
    assert store.registry.watermark("stats").online_synced
    ids = [store.registry.next_run_id() for _ in range(3)]
    assert ids == sorted(set(ids)) and len(ids) == 3
    stamp = store.registry.stamp()
    path = store.config.repo_path / "features.py"
    path.write_text(path.read_text().replace("days=2", "days=3"))
    again = FeatureStore(store.config.repo_path)
    again.apply()
    assert again.registry.versions() == [1, 2] and again.registry.stamp() != stamp
    assert again.registry.version(1)["objects"]["feature_view"]["stats"]["spec"]["ttl_seconds"] == 2 * 86400
    again.close()


def _history_at(backend: str, tmp_path: Path, request) -> tuple[str, str]:
    """A history location (URL, storage options as JSON) on disk or in a new bucket of the S3 server."""
    if backend == "s3":
        bucket, settings = s3_bucket(request.getfixturevalue("s3_endpoint"))
        return f"s3://{bucket}/offline", json.dumps(settings)
    return str(tmp_path / "offline"), "{}"


def _run_writers(code: str, tmp_path: Path, argument_lists: list[list[str]]) -> None:
    """One process per argument list running ``code``, all at once; each must succeed."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(code))
    writers = [subprocess.Popen([sys.executable, str(script), *a], stderr=subprocess.PIPE) for a in argument_lists]
    for writer in writers:
        _, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err.decode()[-2000:]


_APPEND = """
import json
import shutil
import sys
import time
import pyarrow as pa
import pyarrow.parquet as pq
from featurestore.offline.delta import DeltaOfflineStore

from featurestore.storage import Location, explain

url, options, start, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = DeltaOfflineStore(Location.parse(url, __import__("pathlib").Path("."), options))
ids = list(range(start, start + count))
rows = pa.table({
    "k": pa.array(ids, pa.int64()),
    "event_timestamp": pa.array([1_700_000_000_000_000 + (i % 3) * 86_400_000_000 for i in ids], pa.timestamp("us", tz="UTC")),
    "created_timestamp": pa.array([0] * count, pa.timestamp("us", tz="UTC")),
    "_run_id": pa.array([start] * count, pa.int64()),
    "_row_id": pa.array(ids, pa.int64()),
})
for lo in range(0, count, 10):  # many small commits: many chances to meet the other writers
    store.append("t", rows.slice(lo, 10))
"""


# on S3 slow (moto takes ~14 s): by default the creation race below covers S3's conditional commit
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_concurrent_writers_store_every_row_exactly_once(backend, trial, tmp_path, request):
    """Four processes append overlapping row sets (ids 0-59, 30-89, 60-119, 0-119) to one history
    table at once, in commits of 10: every row is there once. No lock is shared: each writer
    commits expecting the version it deduplicated against, and resolves a lost race by taking
    the rows committed meanwhile out of its files."""
    url, options = _history_at(backend, tmp_path, request)
    _run_writers(
        _APPEND,
        tmp_path,
        [[url, options, str(start), str(count)] for start, count in ((0, 60), (30, 60), (60, 60), (0, 120))],
    )
    store = DeltaOfflineStore(Location.parse(url, Path("."), json.loads(options)))
    con = duckdb.connect()
    schema = pa.schema(
        [
            ("k", pa.int64()),
            ("event_timestamp", pa.timestamp("us", tz="UTC")),
            ("created_timestamp", pa.timestamp("us", tz="UTC")),
            ("_run_id", pa.int64()),
            ("_row_id", pa.int64()),
        ]
    )
    store.register(con, "t", "t", schema)
    ids = sorted(r[0] for r in con.execute("SELECT _row_id FROM t").fetchall())
    assert ids == list(range(120))


_CREATE = """
import json, sys
from pathlib import Path
import pyarrow as pa
from featurestore.offline.delta import DeltaOfflineStore
from featurestore.storage import Location

url, options, tables, meet = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
store = DeltaOfflineStore(Location.parse(url, Path("."), options))
def together(step):  # a barrier of files: both writers go on the instant the second arrives
    (meet / f"{step}-{sys.argv[5]}").touch()
    while len(list(meet.glob(f"{step}-*"))) < 2:
        pass
rows = pa.table({
    "k": pa.array(range(10), pa.int64()),
    "event_timestamp": pa.array([1_700_000_000_000_000] * 10, pa.timestamp("us", tz="UTC")),
    "created_timestamp": pa.array([0] * 10, pa.timestamp("us", tz="UTC")),
    "_run_id": pa.array([1] * 10, pa.int64()),
    "_row_id": pa.array(range(10), pa.int64()),
})
for t in range(tables):  # ``append``'s steps, both writers committing at the same instant
    actions = store.write_files(f"t{t}", store.new_rows(f"t{t}", rows, None))
    together(t)
    store.commit(f"t{t}", actions, rows.schema, None)
"""


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_writers_creating_a_table_at_once_store_each_row_once(backend, tmp_path, request):
    """Two writers append the same rows to a table neither finds: both create it at once. deltalake
    retries a creation that lost the race as the next version (both creations landed, every row
    twice, in 29 of 30 tries); the loser must instead dedupe against the winner."""
    url, options = _history_at(backend, tmp_path, request)
    tables, meet = 3, tmp_path / "meet"
    meet.mkdir()
    _run_writers(_CREATE, tmp_path, [[url, options, str(tables), str(meet), str(writer)] for writer in range(2)])
    store = DeltaOfflineStore(Location.parse(url, Path("."), json.loads(options)))
    schema = pa.schema([("_row_id", pa.int64())])
    for t in range(tables):
        con = duckdb.connect()
        store.register(con, f"t{t}", "t", schema)
        assert sorted(r[0] for r in con.execute("SELECT _row_id FROM t").fetchall()) == list(range(10)), t


_APPLY = """
import sys
import time
from featurestore import FeatureStore
store = FeatureStore(sys.argv[1])
store.apply()
for _ in range(20):
    store.registry.next_run_id()
    store.registry.set_watermark(sys.argv[2], last_run_id=1)
print(store.registry.current()["version"])
"""


def test_concurrent_applies_and_counters_lose_nothing(storage, tmp_path, redis_url):
    """Two repos with different definitions apply into one registry at once, and count run ids and
    set watermarks while at it: both definitions are recorded as versions, every run id is
    handed out once, both watermarks are kept (compare-and-swap on S3, the same protocol on disk)."""
    shared = storage or f"registry: {tmp_path / 'shared-registry'}\n"
    repos = []
    for name, ttl in (("a", 2), ("b", 3)):
        root = write_repo(
            tmp_path / name,
            STATS_DEFS.replace("days=2", f"days={ttl}"),
            {"stats": _stats()},
            url=redis_url,
            project="shared",
            storage=shared,
        )
        repos.append(root)
    script = tmp_path / "apply.py"
    script.write_text(textwrap.dedent(_APPLY))
    runs = [subprocess.Popen([sys.executable, str(script), str(r), r.name], stdout=subprocess.PIPE) for r in repos]
    for run in runs:
        run.communicate(timeout=300)
        assert run.returncode == 0
    registry = FeatureStore(repos[0]).registry
    ttls = sorted(
        registry.version(v)["objects"]["feature_view"]["stats"]["spec"]["ttl_seconds"] for v in registry.versions()
    )
    assert ttls == [2 * 86400, 3 * 86400]  # both applies recorded, neither lost
    assert registry.current()["version"] == 2
    assert registry.next_run_id() == 41  # 2 × 20 before it, each handed out once
    assert set(registry.watermarks()) == {"a", "b"}


def test_locations_are_checked(tmp_path):
    assert Location.parse("data/x", tmp_path).path == tmp_path / "data" / "x"
    assert Location.parse("s3://bucket/prefix/", tmp_path).url == "s3://bucket/prefix"
    with pytest.raises(FeatureStoreError, match="names no bucket"):
        Location.parse("s3:///prefix", tmp_path)
    with pytest.raises(FeatureStoreError, match="only local paths and s3://"):
        Location.parse("gs://bucket/x", tmp_path)
    root = write_repo(tmp_path / "r", STATS_DEFS, storage="offline_store: {path: 'hdfs://x/y'}\n")
    with pytest.raises(FeatureStoreError, match="offline_store.path"):
        FeatureStore(root)


def test_the_registry_reads_an_existing_local_registry(tmp_path):
    """Registries written before object storage (the same keys, on disk) read as before."""
    registry = RegistryStore(tmp_path / "reg")
    registry.apply({"entity": {"a": {"hash": "1", "spec": {}}}})
    registry.set_watermark("v", online_synced=True)
    assert (tmp_path / "reg" / "history" / "v00001.json").exists()
    assert RegistryStore(tmp_path / "reg").watermark("v").online_synced


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_an_apply_that_died_after_its_history_entry_is_rolled_forward(backend, tmp_path, request):
    """An apply that wrote ``history/v2`` and died before moving ``registry.json`` is completed by
    the next writer: the next apply becomes v3, and one planned against v1 is refused, to plan again."""
    location = _place(backend, "registry", tmp_path, request)
    registry = RegistryStore(location)
    registry.apply({"entity": {"a": {"hash": "1", "spec": {}}}})
    died = dict(registry.current(), version=2, objects={"entity": {"b": {"hash": "2", "spec": {}}}})
    registry.objects.put("history/v00002.json", json.dumps(died).encode(), if_absent=True)
    assert registry.current()["version"] == 1  # the pointer was never moved
    with pytest.raises(ConflictError, match="plan again"):
        registry.apply({"entity": {"c": {"hash": "3", "spec": {}}}}, expected_version=1)
    assert registry.current()["objects"] == died["objects"]  # rolled forward on the way
    assert registry.apply({"entity": {"c": {"hash": "3", "spec": {}}}}, expected_version=2)["version"] == 3
    assert registry.versions() == [1, 2, 3] and registry.current()["version"] == 3


_REGISTER = """
import json
import shutil
import sys
import time
from pathlib import Path

from featurestore.storage import Location, explain
from featurestore.tracking.artifacts import ArtifactStore
from featurestore.training.model_registry import ModelRegistry

root, options, run, count = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
at = lambda *parts: Location.parse("/".join([root, *parts]), Path("."), options)
registry = ModelRegistry(at("models"), at("registry", "models.json"), artifacts=ArtifactStore(at("artifacts")))
for _ in range(count):
    version = registry.register("m", run)
    registry.promote("m", version, "production")
    print(version, flush=True)
"""


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_registrations_and_promotions_lose_nothing(backend, tmp_path, request, run):
    """Two processes register and promote four versions each into one model registry at once:
    eight versions, numbered 1-8 with none taken twice, every file verified against the ledger and
    kept in the artifact store under its hash, the production alias and its rollback target both
    versions that were promoted (the ledger and the aliases change by compare-and-swap)."""
    if backend == "s3":
        bucket, options = s3_bucket(request.getfixturevalue("s3_endpoint"))
        root = f"s3://{bucket}/data"
    else:
        root, options = str(tmp_path / "data"), {}
    script = tmp_path / "register.py"
    script.write_text(textwrap.dedent(_REGISTER))
    writers = [
        subprocess.Popen(
            [sys.executable, str(script), root, json.dumps(options), str(run), "4"], stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    printed = []
    for writer in writers:
        out, _ = writer.communicate(timeout=300)
        assert writer.returncode == 0
        printed.append([int(line) for line in out.split()])
    assert sorted(printed[0] + printed[1]) == list(range(1, 9))  # each number handed out once

    from featurestore.tracking.artifacts import ArtifactStore
    from featurestore.training.model_registry import ModelRegistry

    def at(*parts: str) -> Location:
        return Location.parse("/".join([root, *parts]), tmp_path, options)

    registry = ModelRegistry(at("models"), at("registry", "models.json"))
    artifacts = ArtifactStore(at("artifacts"))
    assert registry.versions("m") == list(range(1, 9)) and registry.names() == ["m"]
    for version, files in registry.hashes("m").items():
        registry.verify("m", version)
        assert registry.card("m", version)["version"] == version
        assert all(artifacts.verify(sha) for sha in files.values())
    aliases = registry.aliases("m")
    assert aliases["production"] in (printed[0][-1], printed[1][-1])  # the last promotion of one of them
    assert registry.rollback("m") != aliases["production"]


def test_exports_on_s3_reproduce_byte_for_byte_and_fetch_for_training(make_store, s3_endpoint, tmp_path, monkeypatch):
    """An export written to ``s3://`` (manifest last), reproduced from its manifest on S3 into S3 and
    onto disk with the same bytes, and fetched to a local cache for training, checked by hash; one
    replacing a dataset whose upload fails midway leaves no manifest naming other files."""
    import boto3

    from featurestore.retrieval.export import fetch_dataset

    store = make_store(STATS_DEFS, {"stats": _stats()}, storage=s3_storage(s3_endpoint))
    store.materialize(None, None)
    bucket = store.config.data.bucket_and_key[0]
    entities = pd.DataFrame(
        {"driver_id": [1, 2, 3, 99], "event_timestamp": [NOW - timedelta(hours=h) for h in range(4)]}
    )
    entities.to_parquet(tmp_path / "entities.parquet")
    cli = [sys.executable, "-m", "featurestore.cli", "export", "--repo", str(store.config.repo_path)]
    done = subprocess.run(
        [*cli, "-s", "svc", "-e", str(tmp_path / "entities.parquet"), "-o", f"s3://{bucket}/datasets/one"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    store.materialize(None, None)  # history moves on; the dataset still reproduces from its versions
    again = store.reproduce_training_dataset(f"s3://{bucket}/datasets/one/manifest.json", f"s3://{bucket}/datasets/two")
    local = store.reproduce_training_dataset(f"s3://{bucket}/datasets/one/manifest.json", tmp_path / "local")
    given = dict(store.config.storage_options)
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=given["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=given["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )

    def data(key: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    original = data("datasets/one/data-00000.parquet")
    assert (
        data("datasets/two/data-00000.parquet") == original == (tmp_path / "local" / "data-00000.parquet").read_bytes()
    )
    assert again["files"] == local["files"] and pq.read_table(pa.BufferReader(original)).num_rows == 4

    cached = fetch_dataset(store.location(f"s3://{bucket}/datasets/two"), tmp_path / "cache")
    assert (cached / "data-00000.parquet").read_bytes() == original
    assert fetch_dataset(store.location(f"s3://{bucket}/datasets/two"), tmp_path / "cache") == cached  # once
    s3.put_object(Bucket=bucket, Key="datasets/two/data-00000.parquet", Body=original[:-10])
    with pytest.raises(FeatureStoreError, match="does not match its manifest's hash"):
        fetch_dataset(store.location(f"s3://{bucket}/datasets/two"), tmp_path / "other-cache")

    # the upload of an export replacing datasets/one lost after its first file: the earlier
    # manifest stayed beside the new file (fetching it then failed on a hash); now it goes first
    from featurestore.storage import Location

    upload, uploaded = Location.upload, []

    def lost_after_one(self, local, name):
        uploaded.append(name)
        if len(uploaded) == 2:
            raise OSError("Connection reset by peer")
        upload(self, local, name)

    monkeypatch.setattr(Location, "upload", lost_after_one)
    with pytest.raises(OSError, match="Connection reset"):
        store.export_training_dataset(entities.head(2), "svc", f"s3://{bucket}/datasets/one")
    with pytest.raises(FeatureStoreError, match="no manifest at"):
        fetch_dataset(store.location(f"s3://{bucket}/datasets/one"), tmp_path / "cache-3")
    monkeypatch.setattr(Location, "upload", upload)
    store.export_training_dataset(entities.head(2), "svc", f"s3://{bucket}/datasets/one")
    fetched = fetch_dataset(store.location(f"s3://{bucket}/datasets/one"), tmp_path / "cache-4")
    assert pq.read_table(fetched / "data-00000.parquet").num_rows == 2
    with pytest.raises(FeatureStoreError, match="no manifest at s3://"):
        store.reproduce_training_dataset(f"s3://{bucket}/datasets/none/manifest.json", tmp_path / "x")


@pytest.fixture(scope="module")
def guarded_s3(tmp_path_factory):
    """A second S3 server that checks credentials: a bucket, a user who may do anything, and one
    with no permissions at all."""
    import boto3

    from .conftest import moto_server

    setup_calls = 6  # what the server answers before it checks credentials: the setup below
    with moto_server(tmp_path_factory.mktemp("guarded"), INITIAL_NO_AUTH_ACTION_COUNT=str(setup_calls)) as endpoint:
        anyone = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "x",
            "aws_secret_access_key": "y",
        }
        boto3.client("s3", **anyone).create_bucket(Bucket="guarded")
        iam = boto3.client("iam", **anyone)
        keys = {}
        for user in ("admin", "nobody"):
            iam.create_user(UserName=user)
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
        everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(everything))
        yield endpoint, {u: (k["AccessKeyId"], k["SecretAccessKey"]) for u, k in keys.items()}


_FAILURES = {
    "no bucket": "the bucket does not exist",
    "wrong credentials": "the credentials were refused",
    "no permission": "access denied",
    "unreachable": "object storage could not be reached",
}


@pytest.mark.parametrize(
    "where, case",
    [("registry", case) for case in _FAILURES]
    + [("history", "no bucket")]
    + [pytest.param("history", case, marks=pytest.mark.slow) for case in list(_FAILURES)[1:]],
)
def test_storage_failures_are_one_line_saying_what_to_do(where, case, guarded_s3, tmp_path, redis_url):
    """Each way object storage fails, met by the registry (boto3) or by the history (delta-rs,
    pyarrow), is one error line naming the cause and the fix, never a traceback."""
    endpoint, keys = guarded_s3
    key, secret = keys["nobody" if case == "no permission" else "admin"]
    if case == "wrong credentials":
        secret = "not-the-secret"
    if case == "unreachable":
        from .conftest import free_port

        endpoint = f"http://127.0.0.1:{free_port()}"
    bucket = "missing" if case == "no bucket" else "guarded"
    options = f"storage_options: {{AWS_ENDPOINT_URL: '{endpoint}', AWS_ACCESS_KEY_ID: {key}, AWS_SECRET_ACCESS_KEY: {secret}}}\n"
    place = (
        f"data_dir: s3://{bucket}/{tmp_path.name}\n"
        if where == "registry"
        else f"offline_store: {{path: s3://{bucket}/{tmp_path.name}}}\n"
    )
    root = write_repo(tmp_path / "repo", STATS_DEFS, {"stats": _stats()}, url=redis_url, storage=place + options)
    cli = [sys.executable, "-m", "featurestore.cli"]
    quick = {**os.environ, "AWS_MAX_ATTEMPTS": "2"}  # what is retried is not what is tested here
    done = subprocess.run([*cli, "apply", "--repo", str(root)], capture_output=True, text=True, env=quick)
    if where == "history":
        assert done.returncode == 0, done.stderr  # the registry is local: apply needs no bucket
        window = [(NOW - timedelta(days=30)).isoformat(), (NOW + timedelta(days=1)).isoformat()]
        done = subprocess.run(
            [*cli, "materialize", *window, "--repo", str(root)], capture_output=True, text=True, env=quick
        )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert _FAILURES[case] in lines[0]


def test_a_server_answers_503_saying_why_while_object_storage_is_down(tmp_path, redis_url):
    """The UI server over a repo on S3: the models list reads the bucket; with the endpoint down
    (every connection dropped) it answers 503 with the cause, not a 500, and keeps running. (The
    outage is a proxy's: a stopped S3 server frees its port, and a server another test started
    took it once and answered in its place.)"""
    import httpx

    from .conftest import free_port, moto_server
    from .s3_faults import FaultyProxy

    port = free_port()
    url = f"http://127.0.0.1:{port}/ui/api/models"
    with moto_server(tmp_path) as endpoint:
        bucket, options = s3_bucket(endpoint)
        outage = {"on": False}
        proxy = FaultyProxy(endpoint, lambda request: "drop" if outage["on"] else "forward")
        root = write_repo(
            tmp_path / "repo",
            STATS_DEFS,
            {"stats": _stats()},
            url=redis_url,
            storage=_through(proxy.url, bucket, options),
        )
        subprocess.run(
            [sys.executable, "-m", "featurestore", "apply", "--repo", str(root)], check=True, capture_output=True
        )
        command = [sys.executable, "-m", "featurestore", "ui", "--repo", str(root), "--port", str(port)]
        quick = {**os.environ, "AWS_MAX_ATTEMPTS": "2"}  # the standard setting: fewer retries before the 503
        ui = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=quick)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert httpx.get(url, timeout=5).status_code == 200
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and ui.poll() is None, "the UI server did not start"
                    time.sleep(0.1)
            outage["on"] = True
            down = httpx.get(url, timeout=120)
            assert down.status_code == 503, down.text
            assert "object storage could not be reached" in down.json()["detail"]
            assert ui.poll() is None
        finally:
            ui.terminate()
            ui.wait(10)
            proxy.close()


def _through(proxy_url: str, bucket: str, options: dict[str, str]) -> str:
    """featurestore.yaml lines putting a repo's state in ``bucket``, reached through a proxy."""
    return f"data_dir: s3://{bucket}/data\nstorage_options: {json.dumps({**options, 'AWS_ENDPOINT_URL': proxy_url})}\n"


@pytest.mark.slow
def test_throttling_and_dropped_connections_are_retried_and_lose_nothing(make_store, s3_endpoint, tmp_path):
    """Through a proxy answering every 5th request 503 SlowDown and dropping every 7th connection
    after forwarding it (the write landed, the client never heard): apply, materialize, push,
    point-in-time join and export all succeed, every row stored once, the same values as without
    faults."""
    from .s3_faults import FaultyProxy

    bucket, options = s3_bucket(s3_endpoint)
    proxy = FaultyProxy(
        s3_endpoint,
        lambda r: "slow_down" if r.number % 5 == 0 else "drop_after" if r.number % 7 == 0 else "forward",
    )
    entities = pd.DataFrame(
        {"driver_id": [1, 2, 3, 99], "event_timestamp": [NOW - timedelta(hours=h) for h in range(4)]}
    )
    results = []
    try:
        for name, storage in (("on-disk", ""), ("faulty", _through(proxy.url, bucket, options))):
            store = make_store(STATS_DEFS, {"stats": _stats()}, name=name, storage=storage)
            store.materialize(None, None)
            store.materialize(None, None)  # a second run over the same rows adds nothing
            joined = store.get_historical_features(entities, ["stats:rating", "stats:trips"]).to_df()
            out = tmp_path / "ds" if name == "on-disk" else f"s3://{bucket}/ds"
            manifest = store.export_training_dataset(entities, "svc", out)
            pushed = make_store(FEATURES, name=f"{name}-push", storage=storage.replace("/data", "/push"))
            pushed.push("payments", _frame(_payments(50, seed=3, now=NOW)), to="online_and_offline")
            pushed.flush()
            ids = _history_ids(pushed, "activity")
            assert len(ids) == len(set(ids)) == 50
            results.append((joined.fillna(-1).to_dict("list"), manifest["files"], sorted(_history_ids(store, "stats"))))
    finally:
        proxy.close()
    assert results[0] == results[1]
    assert len(set(results[1][2])) == len(results[1][2]) == 200
    assert proxy.count("slow_down") > 5 and proxy.count("drop_after") > 5  # the faults were met


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("landed-then-outage", marks=pytest.mark.slow),
        pytest.param("lost-then-outage", marks=pytest.mark.slow),
        "reply-lost",
    ],
)
def test_a_fault_at_the_commit_then_a_rerun_converges(fault, make_store, s3_endpoint, tmp_path):
    """The history's commit reaches the server but its reply is lost, and the endpoint goes away
    (or it never reaches the server, and the endpoint goes away): materialize fails with one clear
    error, and once the endpoint is back a re-run converges: every row exactly once, the table
    readable, the watermark moved. With the reply lost and no outage, delta-rs's retry finds its
    own commit in place and the run completes the first time."""
    from .s3_faults import FaultyProxy

    bucket, options = s3_bucket(s3_endpoint)
    outage = {"on": False, "over": False}

    def rule(request) -> str:
        if outage["on"]:
            return "drop"
        commit = request.method == "PUT" and "_delta_log/" in request.path and request.path.endswith(".json")
        if commit and not outage["over"]:  # the commit creating the history table with its rows
            outage["over"] = True
            outage["on"] = fault != "reply-lost"
            return "drop" if fault == "lost-then-outage" else "drop_after"
        return "forward"

    proxy = FaultyProxy(s3_endpoint, rule)
    try:
        storage = _through(proxy.url, bucket, options)
        root = write_repo(tmp_path / "repo", STATS_DEFS, {"stats": _stats()}, storage=storage)
        cli = [sys.executable, "-m", "featurestore.cli"]
        window = [(NOW - timedelta(days=30)).isoformat(), (NOW + timedelta(days=1)).isoformat()]
        assert subprocess.run([*cli, "apply", "--repo", str(root)], capture_output=True).returncode == 0
        first = subprocess.run(
            [*cli, "materialize", *window, "--repo", str(root)], capture_output=True, text=True, timeout=600
        )
        assert outage["over"]
        if fault != "reply-lost":
            assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr
            assert "object storage could not be reached" in first.stderr
            outage["on"] = False
            again = subprocess.run(
                [*cli, "materialize", *window, "--repo", str(root)], capture_output=True, text=True, timeout=600
            )
            assert again.returncode == 0, again.stderr
        else:
            assert first.returncode == 0, first.stderr
        store = FeatureStore(root)
        ids = _history_ids(store, "stats")
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 200
        assert store.registry.watermark("stats").end is not None
        store.close()
    finally:
        proxy.close()


def test_history_files_are_cached_locally_and_the_cache_is_bounded(make_store, s3_endpoint, tmp_path):
    """With the history on S3, the files a run writes are kept on local disk as they are uploaded,
    so the next join reads no data file from the bucket; a cold cache fetches each file once; the
    cache stays under its bound, least recently used out first."""
    import os

    from featurestore.offline.file_cache import FileCache

    from .s3_faults import FaultyProxy

    bucket, options = s3_bucket(s3_endpoint)
    proxy = FaultyProxy(s3_endpoint)
    try:
        store = make_store(STATS_DEFS, {"stats": _stats()}, storage=_through(proxy.url, bucket, options))
        store.materialize(None, None)
        entities = pd.DataFrame({"driver_id": [1, 2, 3], "event_timestamp": [NOW] * 3})

        def join_reads() -> tuple[pd.DataFrame, int]:
            proxy.take()
            joined = store.get_historical_features(entities, ["stats:rating"]).to_df()
            return joined, sum(1 for r in proxy.take() if r.method == "GET" and r.path.endswith(".parquet"))

        warm, reads = join_reads()
        assert reads == 0  # written through
        cache = store.offline_store.cache
        shutil.rmtree(cache.root)
        cold, reads = join_reads()
        files = len(store.offline_store.files(store.layout("stats").history_table)[1])
        assert reads == files > 1 and cold.equals(warm)
        assert join_reads()[1] == 0
    finally:
        proxy.close()

    small = FileCache(tmp_path / "small", max_bytes=1000)
    for i in range(10):
        (tmp_path / "f").write_bytes(bytes(300))
        small.keep(f"bucket/file-{i}.parquet", tmp_path / "f")
        os.utime(small._place(f"bucket/file-{i}.parquet"), (1000 + i, 1000 + i))  # used long ago, in order
    small.trim()
    kept = sorted(p for p in range(10) if small._place(f"bucket/file-{p}.parquet").exists())
    assert kept == [7, 8, 9]  # the newest, within 90 % of the bound


def _rows(ids: list[int]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(ids, pa.int64()),
            "event_timestamp": pa.array([1_700_000_000_000_000] * len(ids), pa.timestamp("us", tz="UTC")),
            "created_timestamp": pa.array([0] * len(ids), pa.timestamp("us", tz="UTC")),
            "_run_id": pa.array([1] * len(ids), pa.int64()),
            "_row_id": pa.array(ids, pa.int64()),
        }
    )


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_store_follows_its_tables_log_and_notices_a_table_made_again(backend, tmp_path, request):
    """A long-lived store brings its handle of a table up to date (reading only new commits)
    instead of reopening it: it sees other writers' commits, and a table dropped and made again
    under the same name is read as the new table, not as the old one with new commits on top."""
    location = _place(backend, "offline", tmp_path, request)
    mine, other = DeltaOfflineStore(location), DeltaOfflineStore(location)

    def ids(store: DeltaOfflineStore) -> list[int]:
        con = duckdb.connect()
        store.register(con, "t", "h", _rows([]).schema)
        return sorted(r[0] for r in con.execute("SELECT _row_id FROM h").fetchall())

    mine.append("t", _rows([1, 2, 3]))
    other.append("t", _rows([4]))
    other.append("t", _rows([5]))
    assert ids(mine) == [1, 2, 3, 4, 5] and mine.version("t") == 2
    other.drop("t")
    other.append("t", _rows([7]))
    other.append("t", _rows([8]))
    other.append("t", _rows([9]))
    assert ids(mine) == [7, 8, 9]  # version 2 of the new table, not the old one's 1-5 plus commits 1-2
    assert mine.append("t", _rows([9, 10])).num_rows == 1 and ids(other) == [7, 8, 9, 10]


def test_two_machines_push_into_one_push_log_and_history(make_store, s3_endpoint):
    """Two repos with their own local folders (two machines) and one ``data_dir`` on S3 push into
    one source at once: the push log holds every machine's rows once, a retried drain on either
    adds nothing (each buffer records its own progress in the log), and materializing on one
    machine computes from both machines' pushes. Drains compact the log past 4 files, keeping
    every buffer's recorded progress."""
    import threading

    storage = s3_storage(s3_endpoint) + "offline_store: {compact_after_files: 4}\n"
    machines = [make_store(FEATURES, name=f"machine-{m}", storage=storage) for m in range(2)]
    batches = [_frame(_payments(40, seed=m, first_id=1000 * m, now=NOW)) for m in range(2)]

    def push(m: int) -> None:
        for part in range(4):
            machines[m].push("payments", batches[m].slice(part * 10, 10), to="offline")
            machines[m].flush()

    threads = [threading.Thread(target=push, args=(m,)) for m in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from featurestore.sources import open_push_log

    assert machines[0].config.data_dir != machines[1].config.data_dir  # each machine's own local folder
    first = machines[0]
    first.push("payments", _frame(_payments(5, seed=9, first_id=2000, now=NOW)), to="offline")
    saved = first.config.data_dir.parent / "saved-buffer"
    shutil.copytree(first.push_buffer.root, saved)
    first.flush()
    shutil.rmtree(first.push_buffer.root)
    shutil.copytree(saved, first.push_buffer.root)  # as if the drain died after its commit
    first.flush()
    log = open_push_log(first.config.push_logs, "payments")
    logged = log.to_pyarrow_table()["payment_id"].to_pylist()
    assert sorted(logged) == list(range(40)) + list(range(1000, 1040)) + list(range(2000, 2005))
    assert len(log.file_uris()) <= 5  # 9 drains' files, compacted
    report = machines[1].materialize(None, None)
    ids = _history_ids(machines[1], "activity")
    assert len(ids) == len(set(ids)) == 85 and sum(v.new_offline_rows for v in report.views) == 0


@pytest.mark.parametrize("resumed_on", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_run_trained_on_one_machine_is_listed_and_resumed_on_another(resumed_on, s3_endpoint, tmp_path, redis_url):
    """Two repos sharing ``data_dir`` on S3, each with its own local folder: a run trained on the
    first is published when the command ends; the second lists and shows it, resumes it from its
    sharded checkpoint for a second epoch (on 1 rank, or 2: another world size than the first's),
    and the first then sees the resumed run's results."""
    from .test_distributed_training import make_dataset

    dataset = make_dataset(tmp_path / "dataset", rows=1500)
    storage = s3_storage(s3_endpoint)
    machines = [
        write_repo(tmp_path / f"machine-{m}", STATS_DEFS, {"stats": _stats()}, url=redis_url, storage=storage)
        for m in range(2)
    ]

    def cli(machine: int, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "featurestore.cli", *args, "--repo", str(machines[machine])],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    out = cli(0, "train", "--dataset", str(dataset), "--epochs", "1", "--device", "cpu")
    run_id = out.split()[1].rstrip(":")
    assert run_id in cli(1, "runs", "list")
    assert json.loads(cli(1, "runs", "show", run_id))["final"]["epochs"] == 1
    assert not (machines[1] / "data" / "runs" / run_id / "checkpoint.pt").exists()  # listing fetched no weights
    cli(
        1,
        "train",
        "--dataset",
        str(dataset),
        "--epochs",
        "2",
        "--device",
        "cpu",
        "--resume",
        run_id,
        "--nproc-per-node",
        str(resumed_on),
    )
    resumed = json.loads(cli(0, "runs", "show", run_id))
    assert resumed["final"]["epochs"] == 2
    from featurestore.tracking.metric_store import read_metrics

    epochs = read_metrics(machines[0] / "data" / "runs" / run_id, "epoch")["value"].to_pylist()
    assert set(epochs) == {0, 1}  # the first machine's epoch and the one the second resumed for


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_compaction_and_vacuum_keep_every_row(backend, tmp_path, request):
    """Many small commits compacted into few files, then the replaced files vacuumed: the same
    rows before and after, the compacted version readable, an older version's files gone."""
    location = _place(backend, "offline", tmp_path, request)
    store = DeltaOfflineStore(location)
    for start in range(0, 60, 5):
        store.append("t", _rows(list(range(start, start + 5))))

    def ids(version: int | None = None) -> list[int]:
        con = duckdb.connect()
        store.register(con, "t", "h", _rows([]).schema, version)
        return sorted(r[0] for r in con.execute("SELECT _row_id FROM h").fetchall())

    before = store.version("t")
    assert store.file_count("t") == 12 and ids() == list(range(60))
    assert store.compact("t")["numFilesRemoved"] == 12
    assert store.file_count("t") == 1 and ids() == list(range(60))
    assert store.vacuum("t", 0) == 12  # what only the versions before compaction used
    assert ids() == list(range(60))
    with pytest.raises(FeatureStoreError):
        ids(before)  # its files are gone: said, not read as empty


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_commit_that_landed_unheard_is_not_undone_by_its_retry(backend, tmp_path, request):
    """A commit whose reply was lost is tried again from the version it read: the retry finds its
    own files in the table and leaves them there (it deleted them as "never committed", and
    the table then named files that were gone)."""
    location = _place(backend, "offline", tmp_path, request)
    store = DeltaOfflineStore(location)
    store.append("t", _rows([1, 2]))
    read = store.version("t")
    rows = store.new_rows("t", _rows([3, 4, 5]), read)
    actions = store.write_files("t", rows)
    store.commit("t", actions, _rows([]).schema, read)  # landed...
    store.commit("t", actions, _rows([]).schema, read)  # ...but unheard: tried again
    con = duckdb.connect()
    DeltaOfflineStore(location).register(con, "t", "h", _rows([]).schema)
    assert sorted(r[0] for r in con.execute("SELECT _row_id FROM h").fetchall()) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_two_compactions_at_once_keep_every_row_once(backend, tmp_path, request):
    """Two stores (two machines' drains) compact one table at the same moment, while a third
    appends: every row once. deltalake's own optimize committed both merges (rows twice)."""
    import threading

    location = _place(backend, "offline", tmp_path, request)
    writer = DeltaOfflineStore(location)
    expected: list[int] = []
    for trial in range(4):
        for start in range(0, 40, 5):
            ids = list(range(trial * 1000 + start, trial * 1000 + start + 5))
            writer.append("t", _rows(ids))
            expected += ids
        stores = [DeltaOfflineStore(location) for _ in range(2)]
        ready = threading.Barrier(3)
        errors: list[BaseException] = []

        def run(work) -> None:
            ready.wait()
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        late = list(range(trial * 1000 + 500, trial * 1000 + 505))
        threads = [threading.Thread(target=run, args=(lambda s=s: s.compact("t"),)) for s in stores]
        threads.append(threading.Thread(target=run, args=(lambda: writer.append("t", _rows(late)),)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expected += late
        assert not errors, errors
        con = duckdb.connect()
        writer.register(con, "t", "h", _rows([]).schema)
        assert sorted(r[0] for r in con.execute("SELECT _row_id FROM h").fetchall()) == sorted(expected)
    assert writer.file_count("t") <= 2 * 4 + 1


@pytest.mark.slow
def test_throttling_past_the_retries_is_one_line(s3_endpoint, tmp_path, redis_url):
    """Every request answered 503 SlowDown: each client retries with backoff (about a minute),
    then the command fails with one line saying so and what to do."""
    from .s3_faults import FaultyProxy

    bucket, options = s3_bucket(s3_endpoint)
    proxy = FaultyProxy(s3_endpoint, lambda request: "slow_down")
    try:
        storage = _through(proxy.url, bucket, options)
        root = write_repo(tmp_path / "repo", STATS_DEFS, {"stats": _stats()}, url=redis_url, storage=storage)
        done = subprocess.run(
            [sys.executable, "-m", "featurestore.cli", "apply", "--repo", str(root)], capture_output=True, text=True
        )
    finally:
        proxy.close()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr
    assert "kept refusing requests (503 SlowDown)" in lines[0] and proxy.count("slow_down") > 1


@pytest.mark.slow
def test_object_requests_are_counted_as_the_server_sees_them(make_store, s3_endpoint, tmp_path, redis_url):
    """Through a proxy that sees every request: apply, materialize, a point-in-time join, an export
    and a drained push count exactly the requests boto3 and pyarrow sent, by kind, with their
    bytes; deltalake's own requests are counted as its operations. A CLI command ends with the
    line, and a server's /metrics counts them."""
    import collections
    import itertools

    import httpx

    from featurestore.object_requests import METER, summary

    from .conftest import free_port
    from .s3_faults import FaultyProxy

    bucket, options = s3_bucket(s3_endpoint)
    proxy = FaultyProxy(s3_endpoint)
    storage = _through(proxy.url, bucket, options)
    entities = pd.DataFrame(
        {"driver_id": [1, 2, 3, 99], "event_timestamp": [NOW - timedelta(hours=h) for h in range(4)]}
    )
    try:
        before = METER.snapshot()
        store = make_store(STATS_DEFS, {"stats": _stats()}, storage=storage)
        store.materialize(None, None)
        store.get_historical_features(entities, ["stats:rating"]).to_df()
        store.export_training_dataset(entities, "svc", f"s3://{bucket}/ds")
        pushed = make_store(FEATURES, name="push", storage=storage.replace("/data", "/push"))
        pushed.push("payments", _frame(_payments(30, seed=1, now=NOW)), to="online_and_offline")
        pushed.flush()
        counted = METER.since(before)
        seen = proxy.take()
        ours = [r for r in seen if r.client != "deltalake"]
        by_kind = collections.Counter(r.kind for r in ours)
        assert {k: n for k, n in counted.items() if k.isupper()} == dict(by_kind)
        # bytes as the objects hold them: pyarrow's uploads carry a checksum trailer on the wire
        assert counted["bytes received"] == sum(r.received for r in ours if r.kind == "GET")
        trailers = sum(r.sent for r in ours) - counted["bytes sent"]
        assert 0 <= trailers <= 64 * sum(1 for r in ours if r.client == "pyarrow" and r.kind == "PUT")
        assert any(r.client == "deltalake" for r in seen)  # the Delta log's requests: counted as operations
        assert counted["delta commit"] >= 2 and counted["delta snapshot"] >= 2
        assert by_kind["PUT"] and by_kind["GET"] and by_kind["HEAD"]

        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "featurestore",
                "materialize",
                "2000-01-01",
                "2100-01-01",
                "--repo",
                str(tmp_path / "repo"),
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("object storage: ") and "delta snapshot" in line and "GET" in line, done.stderr
        assert summary({}) is None

        port = free_port()
        command = [sys.executable, "-m", "featurestore", "serve", "--repo", str(tmp_path / "push"), "--port", str(port)]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and server.poll() is None, "the feature server did not start"
                    time.sleep(0.2)
            proxy.take()
            deadline = time.monotonic() + 60
            for seed in itertools.count():  # pushes drain in the background once the buffer is due
                rows = _frame(_payments(5, seed=seed, first_id=5 * seed, now=NOW)).to_pydict()
                # (JSON's own types; times as ISO text)
                df = {k: [v.isoformat() if isinstance(v, datetime) else v for v in vs] for k, vs in rows.items()}
                body = {"push_source_name": "payments", "df": df}
                pushed_ok = httpx.post(f"http://127.0.0.1:{port}/push", json={**body, "to": "offline"})
                assert pushed_ok.status_code == 200, pushed_ok.text
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                if 'featurestore_feature_server_object_requests_total{kind="delta commit"}' in metrics:
                    break
                assert time.monotonic() < deadline, metrics[-3000:]
                time.sleep(1)
            assert 'featurestore_feature_server_object_requests_total{kind="PUT"}' in metrics
            assert "featurestore_feature_server_object_bytes_total" in metrics
        finally:
            server.terminate()
            server.wait(10)
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("message", "advice"),
    [
        # a dropped connection whose retries happened to take 1.503… s once read as a 503
        (
            "Generic S3 error: Error performing PUT in 1.503877665s, after 10 retries, max_retries: 10, "
            "retry_timeout: 180s - HTTP error: error sending request",
            "could not be reached",
        ),
        ("Generic S3 error: Error performing GET, after 10 retries - Server returned 503", "kept refusing"),
        ("Generic S3 error: response error 503 Service Unavailable", "kept refusing"),
    ],
)
def test_a_storage_error_is_told_apart_by_its_words_not_by_digits_inside_a_duration(message, advice):
    explained = explain(OSError(message))
    assert explained is not None and advice in str(explained), explained
