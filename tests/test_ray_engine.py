"""The Ray engine (issue #14) on a real Ray cluster started by the test: a head and a worker
process, one CPU each. Point-in-time joins and exports equal the local engine's, row for row
and byte for byte, on the fraud definitions (latest-value and windowed views, two entity kinds)
with unknown entities, null keys, equal timestamps and rows before any history.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from featurestore import FeatureStore
from featurestore.config import RepoConfig
from featurestore.demo.generate import generate, label_rows

from .conftest import DEFINITIONS, demo_repo, free_port

if importlib.util.find_spec("ray") is None:  # the test extra installs it
    pytest.skip("ray is not installed: pip install 'featurestore[ray]'", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    """`ray start` a head and one worker node (separate processes), then attach this process."""
    port = free_port()
    # token authentication, as a shared cluster should run: head, worker and this driver share the token
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    old = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)
    import ray  # here, not at the top: ray reads RAY_AUTH_MODE when first imported

    env = dict(os.environ)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # (not under pytest's temp folder: Ray's sockets go in session_<time>_<pid>/sockets/ below it, and a
    # Unix socket's path has 107 bytes at most, which a worker's folder under xdist went past)
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    head = subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert head.returncode == 0, head.stderr[-2000:]
    try:
        worker = subprocess.run(
            [ray_bin, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1"], capture_output=True, text=True, env=env
        )
        assert worker.returncode == 0, worker.stderr[-2000:]
        address = f"127.0.0.1:{port}"
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield address
    finally:
        ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, env=env)
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, cluster):
    root = tmp_path_factory.mktemp("raypit")
    with demo_repo(root) as repo, FeatureStore(repo) as local:
        data = generate(n_cards=150, days=6, seed=11)
        local.apply()
        local.push("card_profiles", data.profiles, to="online_and_offline")
        local.push("transactions", data.transactions.drop_columns(["label"]), to="online_and_offline")
        local.flush()
        with FeatureStore(repo, RepoConfig.load(repo).with_engine("ray", cluster)) as distributed:
            assert distributed.config.offline.engine == "ray"
            yield {"local": local, "ray": distributed, "data": data, "root": root, "address": cluster, "repo": repo}


def _entity_rows(data, n: int, seed: int) -> pa.Table:
    """Random rows: known and unknown cards and merchants, null keys, repeated rows and times
    on event times exactly (window edges), before any history."""
    rng = np.random.default_rng(seed)
    events = data.transactions
    picks = rng.integers(0, events.num_rows, n)
    times = pc.take(events["event_timestamp"], pa.array(picks)).to_pylist()
    cards = pc.take(events["card_id"], pa.array(picks)).to_pylist()
    merchants = pc.take(events["merchant_id"], pa.array(picks)).to_pylist()
    for i in range(0, n, 7):
        cards[i] = 10_000 + i  # unknown card
    for i in range(3, n, 11):
        merchants[i] = None  # null key
    for i in range(5, n, 13):
        times[i] = times[i].replace(year=2000)  # before any history
    for i in range(1, n, 17):
        cards[i], merchants[i], times[i] = cards[i - 1], merchants[i - 1], times[i - 1]  # a repeated row
    return pa.table(
        {
            "card_id": pa.array(cards, pa.int64()),
            "merchant_id": pa.array(merchants, pa.int64()),
            "event_timestamp": pa.array(times, pa.timestamp("us", tz="UTC")),
            "amount": pa.array(rng.uniform(1, 500, n)),
        }
    )


@pytest.mark.parametrize("as_of", ["event", pytest.param("created", marks=pytest.mark.slow)])
def test_point_in_time_join_equals_the_local_engine(stores, as_of):
    rows = _entity_rows(stores["data"], 3000, seed=1 if as_of == "event" else 2)
    local = stores["local"].get_historical_features(rows, feature_service="fraud_model_v1", as_of=as_of).to_arrow()
    distributed = stores["ray"].get_historical_features(rows, feature_service="fraud_model_v1", as_of=as_of).to_arrow()
    assert distributed.schema == local.schema
    assert distributed.equals(local)
    assert pc.sum(pc.is_valid(local["txn_count_24h"])).as_py() > 0  # the join found history, not only nulls
    # a projection across views in mixed order keeps the request's column order
    features = ["merchant_risk:merchant_txn_count_24h", "card_profile:credit_limit", "card_activity:amount_sum_24h"]
    assert (
        stores["ray"]
        .get_historical_features(rows, features=features)
        .to_arrow()
        .equals(stores["local"].get_historical_features(rows, features=features).to_arrow())
    )


def test_export_on_ray_is_byte_identical_and_reproduces(stores):
    labels = label_rows(stores["data"].transactions)
    root = stores["root"]
    local = stores["local"].export_training_dataset(labels, "fraud_model_v1", root / "export-local")
    distributed = stores["ray"].export_training_dataset(labels, "fraud_model_v1", root / "export-ray")
    assert distributed["files"] == local["files"] and distributed["manifest_hash"] == local["manifest_hash"]
    data = (root / "export-ray" / distributed["files"][0]["path"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == local["files"][0]["sha256"]
    stores["ray"].reproduce_training_dataset(root / "export-local" / "manifest.json", root / "again")
    # the command line picks the engine by flag (a new driver process joining the cluster)
    labels_file = root / "labels.parquet"
    pq.write_table(labels, labels_file)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore",
            "export",
            "--service",
            "fraud_model_v1",
            "--entities",
            str(labels_file),
            "--out",
            str(root / "export-cli"),
            "--engine",
            "ray",
            "--ray-address",
            stores["address"],
            "--repo",
            str(stores["repo"]),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((root / "export-cli" / "manifest.json").read_text())["files"] == local["files"]


def test_bad_input_gets_the_local_engines_errors(stores):
    from featurestore.errors import RequestError

    bad = pa.table(
        {"card_id": ["a"], "merchant_id": [1], "event_timestamp": pa.array([0], pa.timestamp("us", tz="UTC"))}
    )
    with pytest.raises(RequestError, match="card_id"):
        stores["ray"].get_historical_features(bad, feature_service="fraud_model_v1")


def _history(store: FeatureStore, view: str) -> pa.Table:
    from deltalake import DeltaTable

    table = DeltaTable(str(store.offline_store.table_path(store.layout(view).history_table))).to_pyarrow_table()
    return table.sort_by("_row_id")


@pytest.fixture
def same_push_log(tmp_path, stores, monkeypatch):
    """Two repos (two projects on one Redis) over copies of one push log, registry and run counter:
    ``materialize(name, engine)`` runs one and returns its report, histories and online values."""
    data = stores["data"]
    repos = {}
    for name in ("local", "ray"):
        repo = tmp_path / name
        shutil.copytree(DEFINITIONS, repo, ignore=shutil.ignore_patterns("data"))
        (repo / "featurestore.yaml").write_text(
            (repo / "featurestore.yaml").read_text().replace("project: fraud", f"project: fraud_{name}")
        )
        repos[name] = repo
    monkeypatch.setenv("FEATURESTORE_DATA_DIR", str(tmp_path / "data-local"))
    with FeatureStore(repos["local"]) as store:
        store.apply()
        store.push("card_profiles", data.profiles, to="offline")
        store.push("transactions", data.transactions.drop_columns(["label"]), to="offline")
        store.flush()
    shutil.copytree(tmp_path / "data-local", tmp_path / "data-ray")

    def use(name: str, engine: str) -> FeatureStore:
        monkeypatch.setenv("FEATURESTORE_DATA_DIR", str(tmp_path / f"data-{name}"))
        return FeatureStore(repos[name], RepoConfig.load(repos[name]).with_engine(engine))

    def state(store: FeatureStore) -> tuple[dict, dict]:
        cards = sorted(set(data.transactions["card_id"].to_pylist()))[:100] + [10**9]
        online = store.get_online_features(
            {"card_id": cards, "merchant_id": [c % 50 for c in cards]},
            feature_service="fraud_model_v1",
            at=data.transactions["event_timestamp"][-1].as_py(),
        )
        return {v: _history(store, v) for v in store.definitions.feature_views}, online.to_dict()

    return {"use": use, "state": state, "repos": repos, "data_dirs": {n: tmp_path / f"data-{n}" for n in repos}}


def test_materialize_on_ray_equals_the_local_engine(same_push_log):
    """The same push log materialized by each engine: equal history tables, equal online values;
    a re-run on Ray adds nothing."""
    results = {}
    for name in ("local", "ray"):
        with same_push_log["use"](name, name) as store:
            assert type(store.materializer().distributed).__name__ == ("RayEngine" if name == "ray" else "NoneType")
            report = store.materialize_incremental()
            results[name] = (report, *same_push_log["state"](store))
            if name == "ray":
                assert sum(v.new_offline_rows for v in store.materialize_incremental().views) == 0  # converged
                assert all(_history(store, v).equals(t) for v, t in results["ray"][1].items())
    (local_report, local_history, local_online), (ray_report, ray_history, ray_online) = (
        results["local"],
        results["ray"],
    )
    assert [(v.view, v.computed_rows, v.new_offline_rows) for v in ray_report.views] == [
        (v.view, v.computed_rows, v.new_offline_rows) for v in local_report.views
    ]
    for view, table in local_history.items():
        assert ray_history[view].equals(table), view
    assert ray_online == local_online


@pytest.mark.parametrize("kills", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_ray_driver_killed_mid_run_leaves_consistent_stores_and_a_rerun_converges(same_push_log, stores, kills):
    """`featurestore materialize-incremental --engine ray` SIGKILLed at random moments (connecting,
    computing, committing, writing Redis), then run to the end: history holds every row once and
    both stores equal the local engine's."""
    with same_push_log["use"]("local", "local") as store:
        store.materialize_incremental()
        expected_history, expected_online = same_push_log["state"](store)
    command = [
        sys.executable,
        "-m",
        "featurestore",
        "materialize-incremental",
        "--engine",
        "ray",
        "--ray-address",
        stores["address"],
        "--repo",
        str(same_push_log["repos"]["ray"]),
    ]
    env = {**os.environ, "FEATURESTORE_DATA_DIR": str(same_push_log["data_dirs"]["ray"])}
    rng = np.random.default_rng(kills)
    for _ in range(kills):
        driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            driver.wait(timeout=float(rng.uniform(2, 12)))
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    with same_push_log["use"]("ray", "ray") as store:
        history, online = same_push_log["state"](store)
    for view, table in expected_history.items():  # run ids differ (killed runs took some): every other column equal
        got = history[view]
        assert pc.count_distinct(got["_row_id"]).as_py() == got.num_rows, view  # every row once
        assert got.drop_columns(["_run_id"]).equals(table.drop_columns(["_run_id"])), view
    assert online == expected_online


def test_a_column_added_later_joins_as_on_the_local_engine(make_store, cluster, monkeypatch):
    """History files written before a view gained a column lack it: the Ray split reads them as null."""
    from datetime import datetime, timedelta

    from .test_schema_changes import DEFS, STATS, _change

    now = datetime.now(UTC).replace(microsecond=0)
    monkeypatch.delenv(
        "FEATURESTORE_DATA_DIR", raising=False
    )  # the module's demo repo sets it: this repo keeps its own
    store = make_store(DEFS, {"stats": STATS})
    store.materialize(None, None)
    changed = _change(
        store, 'schema=[Field("rating", Int64)]', 'schema=[Field("rating", Int64), Field("trips", Int64)]'
    )
    newer = STATS.set_column(
        1, "event_timestamp", pa.array([now - timedelta(minutes=30)] * 2, pa.timestamp("us", tz="UTC"))
    )
    pq.write_table(
        newer.set_column(3, "trips", pa.array([7, 8], pa.int64())), changed.config.repo_path / "data" / "stats.parquet"
    )
    changed.materialize(None, None)
    rows = pa.table(
        {
            "driver_id": pa.array([1, 2, 1, 3], pa.int64()),
            "event_timestamp": pa.array(
                [now - timedelta(minutes=45), now - timedelta(minutes=45), now, now], pa.timestamp("us", tz="UTC")
            ),
        }
    )
    local = changed.get_historical_features(rows, features=["stats:rating", "stats:trips"]).to_arrow()
    distributed = (
        FeatureStore(changed.config.repo_path, changed.config.with_engine("ray", cluster))
        .get_historical_features(rows, features=["stats:rating", "stats:trips"])
        .to_arrow()
    )
    assert local["trips"].to_pylist() == [None, None, 7, None]  # older rows null, the newer one as written
    assert distributed.equals(local)


@pytest.mark.parametrize("parts", [1, 2, 5, 9])
def test_splitting_files_and_tables_agrees_with_a_row_by_row_reference(tmp_path, parts):
    """Both ways ``read_split`` splits (a filtered scan per part up to 4 parts, one scan and a
    gather past it) and ``hash_split`` put each row in the part DuckDB's hash of its declared-type
    keys names, keep file order within a part, and read a column absent from a file as null."""
    import duckdb

    from featurestore.ray_cluster import hash_split, read_split

    rng = np.random.default_rng(parts)
    files, tables = [], []
    for i in range(3):
        n = 500
        columns = {
            "k": pa.array([None if v == 0 else f"e{v}" for v in rng.integers(0, 40, n)]),
            "j": pa.array(rng.integers(-3, 3, n), pa.int32()),
            "seq": pa.array(np.arange(i * n, (i + 1) * n)),
        }
        if i != 1:  # a file written before the column existed
            columns["late"] = pa.array(rng.random(n))
        tables.append(pa.table(columns))
        pq.write_table(tables[-1], tmp_path / f"{i}.parquet")
        files.append(str(tmp_path / f"{i}.parquet"))
    everything = pa.concat_tables(tables, promote_options="default")
    key_types = {"k": "VARCHAR", "j": "BIGINT"}
    con = duckdb.connect()
    con.register("rows", everything)
    part_of = [
        p
        for (p,) in con.sql(
            f"SELECT hash(TRY_CAST(k AS VARCHAR), TRY_CAST(j AS BIGINT)) % {parts} FROM rows"
        ).fetchall()
    ]
    expected = [[row for row, p in zip(everything.to_pylist(), part_of) if p == q] for q in range(parts)]
    from_files = read_split(files, key_types, parts)
    from_table = hash_split(everything, key_types, parts)
    assert [t.to_pylist() for t in from_files] == expected
    assert [t.to_pylist() for t in from_table] == expected
    assert sum(len(rows) for rows in expected) == everything.num_rows and any(r["late"] is None for r in expected[0])


_S3_DRIVER = """
import json, shutil, sys
import pyarrow as pa
from featurestore import FeatureStore
from featurestore.config import RepoConfig

repo, address, entities = sys.argv[1], sys.argv[2], sys.argv[3]
config = RepoConfig.load(repo).with_engine("ray", address)
store = FeatureStore(repo, config)
store.apply()
shutil.rmtree(config.data_dir)  # nothing below may need this machine's own folder: the data is on S3
report = store.materialize(None, None)
again = store.materialize(None, None)
joined = store.get_historical_features(pa.parquet.read_table(entities), ["stats:rating", "stats:trips"]).to_arrow()
print(json.dumps({
    "new": [v.new_offline_rows for v in report.views], "again": [v.new_offline_rows for v in again.views],
    "joined": joined.to_pydict(),
}, default=str))
"""


def test_ray_with_the_history_on_s3_needs_no_shared_folder(make_store, cluster, s3_endpoint, tmp_path, monkeypatch):
    """A driver in its own working directory, its local data folder deleted before any work, the
    history and registry on S3: the Ray tasks (in the cluster's processes, another working
    directory) read and write S3 themselves, the driver commits; the same history and join as the
    local engine on local disk, and a re-run adds nothing."""
    from datetime import datetime, timedelta

    import pyarrow.parquet as pq

    from .conftest import s3_storage, write_repo
    from .test_object_storage import STATS_DEFS, _history_ids, _stats

    monkeypatch.delenv("FEATURESTORE_DATA_DIR", raising=False)
    local = make_store(STATS_DEFS, {"stats": _stats()})
    local.materialize(None, None)
    now = datetime.now(UTC).replace(microsecond=0)
    entities = pa.table(
        {
            "driver_id": pa.array([1, 2, 3, 99, 1], pa.int64()),
            "event_timestamp": pa.array(
                [now - timedelta(hours=h) for h in (0, 5, 20, 1, 30)], pa.timestamp("us", tz="UTC")
            ),
        }
    )
    pq.write_table(entities, tmp_path / "entities.parquet")
    expected = local.get_historical_features(entities, ["stats:rating", "stats:trips"]).to_arrow()

    storage = s3_storage(s3_endpoint) + f"local_dir: {tmp_path / 'driver-local'}\n"
    root = write_repo(
        tmp_path / "s3-repo",
        STATS_DEFS,
        {"stats": _stats()},
        url=local.config.online.url,
        project="s3ray",
        storage=storage,
    )
    driver = tmp_path / "driver.py"
    driver.write_text(_S3_DRIVER)
    (tmp_path / "driver-cwd").mkdir()
    done = subprocess.run(
        [sys.executable, str(driver), str(root), cluster, str(tmp_path / "entities.parquet")],
        cwd=tmp_path / "driver-cwd",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["new"] == [200] and result["again"] == [0]
    assert result["joined"] == json.loads(json.dumps(expected.to_pydict(), default=str))
    made = {p.relative_to(tmp_path / "driver-local").parts[:2] for p in (tmp_path / "driver-local").rglob("*.*")}
    assert made <= {("cache", "history")}  # afterwards it holds at most the cache of history files
    on_s3 = FeatureStore(root)
    assert sorted(_history_ids(on_s3, "stats")) == sorted(_history_ids(local, "stats"))
    on_s3.close()
