"""User mistakes get one clear error line naming the fix: never a traceback (issue #10)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pandas as pd
import pyarrow as pa
import pytest

from featurestore import FeatureStore
from featurestore.errors import FeatureStoreError, OnlineStoreUnavailable, RequestError

from .conftest import free_port, write_repo
from .test_registry import GOOD, STATS


@pytest.fixture
def repo(tmp_path, redis_url, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", GOOD, {"stats": STATS}, url=redis_url)
    store = FeatureStore(root)
    store.apply()
    store.materialize(None, None)
    store.close()
    return root


def _cli(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "featurestore.cli", *args, "--repo", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["materialize", "yesterday", "today"], "'yesterday' is not an ISO 8601 time"),
        (["materialize", "2024-03-02", "2024-03-01"], "the window is empty"),
        (["materialize-incremental", "soon"], "'soon' is not an ISO 8601 time"),
        (
            ["export", "--service", "svc", "--entities", "missing.parquet", "--out", "out"],
            "entity file missing.parquet does not exist",
        ),
        (
            ["export", "--from-manifest", "missing.json", "--out", "out"],
            "missing.json; pass the manifest.json an export wrote",
        ),
    ],
)
def test_cli_mistakes_print_one_error_line(repo, args, message):
    result = _cli(repo, *args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_export_reads_csv_entities(repo, tmp_path):
    labels = tmp_path / "labels.csv"
    labels.write_text("driver_id,event_timestamp\n1,2024-01-02T00:00:00Z\n2,2024-01-01T12:00:00Z\n")
    result = _cli(repo, "export", "--service", "svc", "--entities", str(labels), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert pd.read_parquet(tmp_path / "out" / "data-00000.parquet")["conv_rate"].tolist() == [0.5, 0.7]


def test_a_file_system_error_is_one_line_naming_the_path(repo, tmp_path):
    """An export whose --out names a file, not a folder, was a FileExistsError traceback: every
    file-system error naming a path is one line (the disk full, a read-only file system...)."""
    labels = tmp_path / "labels.csv"
    labels.write_text("driver_id,event_timestamp\n1,2024-01-02T00:00:00Z\n")
    (tmp_path / "taken").write_text("a file")
    result = _cli(repo, "export", "--service", "svc", "--entities", str(labels), "--out", str(tmp_path / "taken"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"error: File exists: {tmp_path / 'taken'}" in result.stderr.replace("\n", ""), result.stderr


def test_api_entity_inputs_that_are_not_data_are_request_errors(repo):
    store = FeatureStore(repo)
    for bad in ["labels.csv", "missing.parquet", "SELEC 1"]:
        with pytest.raises(RequestError):
            store.get_historical_features(bad, features=["driver_stats:conv_rate"])
    assert store.materialize("2024-01-01", "2024-01-02").views  # ISO strings are times
    store.close()


@pytest.mark.parametrize(
    "yaml, message",
    [
        (
            "project: p\nonline_stor: {url: 'redis://x'}\n",
            "unknown setting `online_stor`; did you mean `online_store`?",
        ),
        (
            "project: p\nonline_store: {max_request_entities: lots}\n",
            "max_request_entities: 'lots' is not a whole number",
        ),
        (
            "project: p\nonline_store: {urll: x}\n",
            "unknown setting `online_store.urll`; did you mean `online_store.url`?",
        ),
        ("project: p\nmodules: 3\n", "`modules` must list Python files"),
        ("project: 'shop{eu}'\n", "project 'shop{eu}': a project name may not hold braces"),
    ],
)
def test_config_mistakes_name_the_key(tmp_path, yaml, message):
    (tmp_path / "featurestore.yaml").write_text(yaml)
    with pytest.raises(FeatureStoreError, match=message.replace("(", r"\(").replace("?", r"\?").replace("`", "`")):
        FeatureStore(tmp_path)


def test_a_url_that_is_no_redis_url_is_one_error_naming_where_it_came_from(tmp_path, monkeypatch):
    """``online_store.url: http://...`` (or such a REDIS_URL) was a traceback from redis-py's URL
    parser at the first write; an unreachable cluster a traceback from its client. Each is now
    one error saying what to write, the URL's password hidden."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    (tmp_path / "featurestore.yaml").write_text("project: p\nonline_store: {url: 'http://u:secret@x:1'}\n")
    with pytest.raises(FeatureStoreError, match=r"online_store.url: 'http://u:\*\*\*@x:1' is not a Redis URL"):
        FeatureStore(tmp_path)
    monkeypatch.setenv("REDIS_URL", "localhost:6379")
    with pytest.raises(FeatureStoreError, match="REDIS_URL: 'localhost:6379' is not a Redis URL; write redis://"):
        FeatureStore(tmp_path)
    monkeypatch.setenv("REDIS_URL", f"redis+cluster://127.0.0.1:{free_port()}")
    with pytest.raises(OnlineStoreUnavailable, match="Redis Cluster at .* is unreachable"):
        FeatureStore(tmp_path).online_store.ping()


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis://127.0.0.1:6379?sokcet_timeout=1", "unexpected keyword argument 'sokcet_timeout'"),
        ("redis://127.0.0.1:99999", "Port out of range"),
        ("redis://[::1", "Invalid IPv6 URL"),
        ("redis://:secret@127.0.0.1:x", "Port could not be cast"),
        ("rediss://127.0.0.1:6379?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag"),
        ("redis+cluster://127.0.0.1:6379,bad", "'bad' in 'redis+cluster://127.0.0.1:6379,bad' is not host:port"),
        (
            "redis+cluster://127.0.0.1:6379?ssl_ca_certs=/ca.pem",
            "sets TLS settings without TLS; write rediss+cluster://",
        ),
        ("rediss+cluster://:secret@127.0.0.1:6379?ssl_ca_cert=/ca.pem", "['ssl_ca_cert'] in its query"),
        ("rediss+cluster://127.0.0.1:6379?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag"),
    ],
)
def test_a_redis_url_with_a_typo_is_one_error_line_not_a_traceback(tmp_path, monkeypatch, url, says):
    """A URL redis-py cannot read (a misspelt setting in its query, a port out of range) was a
    traceback from redis-py (a TypeError, a ValueError) at the store's first command; a cluster's
    a traceback from the URL's parser. Now the configuration's error, the password hidden."""
    monkeypatch.setenv("REDIS_URL", url)
    (tmp_path / "featurestore.yaml").write_text("project: p\n")
    with pytest.raises(FeatureStoreError) as caught:
        FeatureStore(tmp_path)
    assert str(caught.value).startswith(f"REDIS_URL: {url.replace('secret', '***')!r} does not read as a Redis URL")
    assert says in str(caught.value) and "secret" not in str(caught.value)
    if "cluster" in url:  # (the command line: one error line)
        done = subprocess.run(
            [sys.executable, "-m", "featurestore.cli", "list", "--repo", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr and says in done.stderr, done.stderr


def test_a_redis_that_requires_a_password_says_so_and_how_to_give_it(tmp_path, monkeypatch):
    """A Redis with ``requirepass``: reached with the password in the URL (percent-encoded); without
    it or with a wrong one, the error says Redis refused it and where a password goes (it said
    "unreachable", with redis-py's words about HELLO), never the password."""
    import subprocess

    import redis

    from featurestore.online.embedded import redis_server_binary
    from featurestore.online.local_cluster import wait_until

    monkeypatch.delenv("REDIS_URL", raising=False)
    port, secret = free_port(), "s3cret/pa:ss@"
    server = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", secret],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: redis.Redis(port=port, password=secret).ping())
        (tmp_path / "featurestore.yaml").write_text(
            f"project: p\nonline_store: {{url: 'redis://:s3cret%2Fpa%3Ass%40@127.0.0.1:{port}'}}\n"
        )
        assert FeatureStore(tmp_path).online_store.ping()
        for userinfo, refused in (("", "a connection without a password"), (":wrong-one@", "the password in its URL")):
            (tmp_path / "featurestore.yaml").write_text(
                f"project: p\nonline_store: {{url: 'redis://{userinfo}127.0.0.1:{port}'}}\n"
            )
            with pytest.raises(OnlineStoreUnavailable) as caught:
                FeatureStore(tmp_path).online_store.ping()
            assert f"refused {refused}" in str(caught.value) and "redis://[user]:password@" in str(caught.value)
            assert "wrong-one" not in str(caught.value)
    finally:
        server.kill()
        server.wait()


def test_a_redis_user_its_acl_limits_says_what_to_grant_and_that_grant_suffices(tmp_path, redis_url, monkeypatch):
    """A Redis user (ACL) without scripts, or without the store's keys: a traceback from redis-py
    (NOPERM) at the first command, and a 500 on the servers' lookups. Now the store's error, naming
    what to grant (``redis_store.ACL_NEEDED``); and a user granted just that runs every path."""
    import asyncio
    import subprocess

    import redis

    from featurestore.online.embedded import redis_server_binary
    from featurestore.online.local_cluster import wait_until
    from featurestore.online.redis_store import ACL_NEEDED
    from featurestore.retrieval.online import OnlineQuery, OnlineReader

    from .conftest import assert_every_path_serves
    from .test_redis_cluster import FEATURES, NOW, _payments, _stats

    monkeypatch.delenv("REDIS_URL", raising=False)
    port = free_port()
    server = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""], stdout=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: redis.Redis(port=port).ping())
        admin = redis.Redis(port=port)
        admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", *ACL_NEEDED.split())
        admin.execute_command("ACL", "SETUSER", "no-scripts", "on", ">pw", "~*", "&*", "+@all", "-@scripting")
        admin.execute_command("ACL", "SETUSER", "other-keys", "on", ">pw", "~other:*", "&*", "+@all")
        plain = FeatureStore(write_repo(tmp_path / "plain", FEATURES, {"stats": _stats(60)}, url=redis_url))
        granted = FeatureStore(
            write_repo(tmp_path / "app", FEATURES, {"stats": _stats(60)}, url=f"redis://app:pw@127.0.0.1:{port}")
        )
        for store in (plain, granted):
            store.apply()
            store.materialize(None, NOW)
            store.push("payments", _payments(200, seed=3))
        cards = list(range(-2, 70))
        refs = ["stats:score", "activity:count_1h"]
        expected = plain.get_online_features({"card_id": cards}, features=refs, at=NOW).to_dict()
        assert_every_path_serves(granted, {"card_id": cards}, refs, NOW, expected)
        plain.close()
        granted.close()
        config = tmp_path / "app" / "featurestore.yaml"
        for user in ("no-scripts", "other-keys"):  # (writes run scripts; lookups read the store's keys)
            config.write_text(config.read_text().replace("//app:", f"//{user}:").replace("//no-scripts:", f"//{user}:"))
            with FeatureStore(tmp_path / "app") as store:
                with pytest.raises(OnlineStoreUnavailable) as refused:
                    if user == "no-scripts":
                        store.push("payments", _payments(5, seed=4), to="online")
                    else:
                        store.get_online_features({"card_id": cards}, features=refs, at=NOW)
                if user == "other-keys":  # (the servers' lookups: a 503 saying so, not a 500)
                    entities, project = {"card_id": cards}, store.config.project
                    plan = OnlineQuery.prepare(store.definitions, project, entities, refs, None, False, now=NOW)
                    with pytest.raises(OnlineStoreUnavailable, match="grant it"):
                        asyncio.run(OnlineReader(store.online_store).read_async(plan))
            assert "refuses the URL's user a command or key" in str(refused.value), refused.value
            assert ACL_NEEDED in str(refused.value) and ":pw@" not in str(refused.value)
            done = _cli(tmp_path / "app", "materialize-incremental", "--rebuild-online")  # (writes: scripts)
            assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
            assert "grant it" in done.stderr
    finally:
        server.kill()
        server.wait()


def test_modules_as_a_string_is_one_module(tmp_path):
    (tmp_path / "featurestore.yaml").write_text("project: p\nmodules: features.py\n")
    assert FeatureStore(tmp_path).config.modules == ("features.py",)


def test_fractional_ttl_keeps_a_row_exactly_ttl_old(make_store):
    base = datetime(2024, 1, 1, tzinfo=UTC)
    table = STATS.set_column(1, "event_timestamp", pa.array([base, base], pa.timestamp("us", tz="UTC")))
    store = make_store(GOOD.replace("ttl=timedelta(days=1)", "ttl=timedelta(milliseconds=1001)"), {"stats": table})
    store.apply()
    store.materialize(None, None)
    at = base + pd.Timedelta(milliseconds=1001)  # exactly ttl old: kept (bounds are inclusive)
    rows = store.get_historical_features(
        pd.DataFrame({"driver_id": [1], "event_timestamp": [at]}), features=["driver_stats:conv_rate"]
    )
    assert rows.to_df()["conv_rate"].tolist() == [0.5]


def test_serving_features_needs_no_torch_and_training_says_which_extra(tmp_path):
    """Issue #12: torch and matplotlib were hard dependencies, so a host that only serves features installed torch."""
    import subprocess
    import sys

    blocked = "import sys; sys.modules['torch'] = None; sys.modules['matplotlib'] = None; "
    serve = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked + "import featurestore.cli, serving.feature_server; "
            "from featurestore import FeatureStore; print('ok')",
        ],
        capture_output=True,
        text=True,
    )
    assert serve.stdout.strip() == "ok", serve.stderr
    train = subprocess.run(
        [
            sys.executable,
            "-c",
            blocked + "import sys; from featurestore.cli import main; "
            "sys.argv = ['featurestore', 'train', '--dataset', '.']; main()",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert (
        train.returncode == 1
        and "pip install 'featurestore[train]'" in train.stderr
        and "Traceback" not in train.stderr
    )


MISSHAPEN = """
from featurestore import Entity, FeatureView, Field, FileSource, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp
src = PushSource(name="src", schema=[Field("user", Int64), Field("x", Float64), Field("event_timestamp", UnixTimestamp)])
user = Entity(name="user", join_keys=["user"], value_type=Int64)
"""


@pytest.mark.parametrize(
    "line, message",
    [
        (
            'v = FeatureView(name="v", entities=["user"], source=src, schema=[Field("x", Float64)])',
            "entities lists 'user' (str); pass the Entity object itself",
        ),
        (
            'v = FeatureView(name="v", entities=[Entity(name=123, join_keys=["user"])], source=src, schema=[Field("x", Float64)])',
            "name must be a non-empty string, got 123 (int)",
        ),
        (
            'v = FeatureView(name="v", entities=[user], source=src, schema=[("x", Float64)])',
            "schema lists ('x', Float64) (tuple); write Field(name, dtype)",
        ),
        (
            'f = FileSource(path="x.parquet")',
            "features.py:6: TypeError: FileSource.__init__() missing 1 required positional argument: 'timestamp_field'",
        ),
        (
            'v = FeatureView(name="v", entities=[user], source="src", schema=[Field("x", Float64)])',
            "source must be a FileSource",
        ),
    ],
)
def test_definition_mistakes_are_one_line_without_a_traceback(tmp_path, line, message):
    root = write_repo(tmp_path / "repo", MISSHAPEN + line + "\n")
    result = _cli(root, "plan")
    assert result.returncode == 1, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 2, (
        result.stderr
    )  # "error: 1 problem", then the problem


def test_a_source_column_retyped_after_apply_is_named(tmp_path):
    import pyarrow.parquet as pq

    features = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import Float64
user = Entity(name="user", join_keys=["user"])
v = FeatureView(name="v", entities=[user], source=FileSource(path="data/src.parquet", timestamp_field="ts"), schema=[Field("x", Float64)])
"""
    ts = [datetime(2024, 1, 1, tzinfo=UTC)] * 2
    root = write_repo(tmp_path / "repo", features, {"src": pa.table({"user": [1, 2], "x": [1.0, 2.0], "ts": ts})})
    assert _cli(root, "apply").returncode == 0
    pq.write_table(pa.table({"user": ["1", "2"], "x": [1.0, 2.0], "ts": ts}), root / "data" / "src.parquet")
    result = _cli(root, "materialize-incremental")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "type of join key 'user' (Int64 -> String)" in result.stderr, result.stderr
