"""A newcomer's first hour, end to end through the CLI (issue #12): init → plan → apply →
materialize → serve → a lookup over HTTP → export → the generated training script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from .conftest import free_port


def test_init_to_served_lookup_to_export_and_training(tmp_path, redis_url):
    env = {**os.environ, "REDIS_URL": redis_url}
    repo = tmp_path / "my_repo"

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "featurestore", *args],
            cwd=repo if repo.exists() else tmp_path,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    cli("init", str(repo), "--project", f"newcomer{os.getpid()}")
    assert {p.name for p in repo.iterdir()} >= {
        "featurestore.yaml",
        "features.py",
        "README.md",
        ".gitignore",
        "train.py",
        "sources",
    }
    assert "+ feature view driver_stats" in cli("plan")
    cli("apply")
    assert "driver_stats: 20 rows computed" in cli("materialize-incremental")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "featurestore", "serve", "--port", str(port)],
        cwd=repo,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                body = httpx.post(
                    f"http://127.0.0.1:{port}/get-online-features",  # the README's curl
                    json={"features": ["driver_stats:conv_rate"], "entities": {"driver_id": [1001, 1002]}},
                ).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert body["results"][1]["values"] == [0.9, 0.9] and body["results"][1]["statuses"] == ["PRESENT", "PRESENT"]
    finally:
        server.terminate()
        startup = server.communicate(timeout=30)[1]
    assert "featurestore: serving" in startup
    cli("export", "--service", "driver_activity", "--entities", "sources/labels.parquet", "--out", "datasets/v1")
    assert json.loads((repo / "datasets" / "v1" / "manifest.json").read_text())["row_count"] == 20
    out = subprocess.run([sys.executable, "train.py"], cwd=repo, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "registered as drivers v1" in out.stdout, out.stderr


USER_CODE = """
from datetime import datetime, timezone

from featurestore import FeatureStore


def main() -> None:
    store = FeatureStore(".")
    store.apply()
    store.materialize_incremental()
    online = store.get_online_features([{"driver_id": 1001}], features=["driver_stats:conv_rate"])
    values: dict[str, list[object]] = online.to_dict()
    rows = {"driver_id": [1001], "event_timestamp": [datetime.now(timezone.utc)]}
    table = store.get_historical_features(rows, features=["driver_stats:conv_rate"]).to_arrow()
    print(values, table.num_rows, store.plan().describe())
"""


@pytest.mark.slow
def test_a_users_repo_passes_mypy_strict(tmp_path):
    """Issue #12: the package shipped no py.typed, so a user's type checker saw none of its API."""
    from pathlib import Path

    from featurestore.scaffold import scaffold

    scaffold(tmp_path / "repo", "typed")
    (tmp_path / "repo" / "use.py").write_text(USER_CODE)
    # installed as a user installs it (not editable), so mypy treats it as PEP 561 says: typed only with py.typed
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(Path(__file__).resolve().parents[1]),
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "env")], check=True)
    subprocess.run(
        [
            str(tmp_path / "env" / "bin" / "pip"),
            "install",
            "-q",
            "--no-deps",
            *map(str, (tmp_path / "wheel").glob("*.whl")),
        ],
        check=True,
        capture_output=True,
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--python-executable",
            str(tmp_path / "env" / "bin" / "python"),
            "features.py",
            "train.py",
            "use.py",
        ],
        cwd=tmp_path / "repo",
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout


def test_every_help_keeps_its_words_at_80_columns():
    """At 80 columns (a default terminal) typer's rich option tables cut option names and their
    help (``--shard-group-s…``, ``featurestore.yam…``): every ``--help`` must show each option
    whole, cut nothing and fit the width."""
    import typer.main
    from typer.testing import CliRunner

    from featurestore.cli import app

    def commands(command, path: list[str]):  # (typer's groups are not click's)
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from commands(sub, [*path, name])

    found = list(commands(typer.main.get_command(app), []))
    assert len(found) > 25
    for path, command in found:
        out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert out.exit_code == 0, out.output
        assert "…" not in out.output, f"{path}: {out.output}"
        assert max(map(len, out.output.splitlines())) <= 80, path
        options = [name for param in command.params for name in (*param.opts, *param.secondary_opts)]
        assert all(name in out.output for name in options if name.startswith("-")), path


def test_the_cli_reads_well(tmp_path, redis_url):
    """Small things an independent first hour found: ``--help`` showed a ``<bool>`` type beside
    every flag (``--help`` too) and one flat list of commands with no examples; ``list`` left out
    on-demand views; ``runs list`` cut run ids at 80 columns; servers defaulted to the demo's
    ``--model fraud``; the "not applied" error named a push source twice."""
    from .conftest import write_repo
    from .test_on_demand import DEFS

    env = {**os.environ, "REDIS_URL": redis_url, "COLUMNS": "80"}
    repo = write_repo(tmp_path / "repo", DEFS)

    def cli(*args: str, code: int = 0) -> str:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "featurestore",
                *args,
                *(["-r", str(repo)] if args[0] not in ("--help",) and "--help" not in args else []),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == code, out.stdout + out.stderr
        return out.stdout + out.stderr

    top = cli("--help")
    assert "<bool>" not in top and "Examples:" in top
    assert all(panel in top for panel in ("Definitions", "Data", "Serving", "Training and models"))
    assert "<bool>" not in cli("apply", "--help") and "--force" in cli("apply", "--help")
    cli("apply")
    listing = cli("list")
    assert "on-demand view" in listing and "payment_vs_usual" in listing
    for command in (("serve-model",), ("checkpoint-engine",)):
        assert "Missing option '--model'" in cli(*command, code=2)
    assert "--model NAME" in cli("check-consistency", code=1)
    # a missing path is one error line saying what to do (both were tracebacks), a port out of range a usage error
    for args, said in (
        (("train", "-d", str(tmp_path / "none")), "no exported dataset at"),
        (("check-consistency", "--model", "nobody"), "serve some predictions first"),
    ):
        out = cli(*args, code=1)
        assert said in out and "Traceback" not in out and out.count("error:") == 1, out
    assert "65535" in cli("serve", "--port", "99999", code=2)
    (repo / "features.py").write_text(
        (repo / "features.py")
        .read_text()
        .replace('Field("country", String),\n', 'Field("country", String), Field("x", Int64),\n', 1)
    )
    unapplied = cli("materialize-incremental", code=1)
    assert unapplied.count("push source 'events'") == 1, unapplied


def test_runs_list_shows_whole_run_ids(tmp_path):
    from featurestore.tracking.runs import Run

    run = Run(tmp_path / "data" / "runs" / "20261201-235959-abcdef")  # the trainer's id shape
    run.log_params({"config": {"epochs": 1}, "code_version": "x"})
    run.finish({"val_auc": 0.5})
    (tmp_path / "featurestore.yaml").write_text("project: runs_only\nmodules: []\n")
    out = subprocess.run(
        [sys.executable, "-m", "featurestore", "runs", "list", "-r", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
        timeout=120,
    )
    assert out.returncode == 0 and run.id in out.stdout, out.stdout + out.stderr


def test_training_warns_nothing_on_one_process(tmp_path):
    import warnings

    from featurestore.training.trainer import TrainConfig, train

    from .test_distributed_training import make_dataset

    dataset = make_dataset(tmp_path / "ds", rows=400)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(TrainConfig(dataset=str(dataset), epochs=1, device="cpu"), tmp_path / "runs", progress=False)
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]


def test_nanosecond_entity_times_come_back_utc(make_store):
    import pandas as pd
    import pyarrow as pa

    from .test_feature_server import DEFS

    store = make_store(DEFS)
    for times in (
        pd.to_datetime(["2024-01-01 10:00:00.000000700"]),
        pd.to_datetime(["2024-01-01 10:00:00.000000700"]).tz_localize("Europe/Paris"),
    ):
        out = store.get_historical_features(
            pd.DataFrame({"card_id": [1], "event_timestamp": times}), features=["spend:amount"]
        ).to_arrow()
        assert out.schema.field("event_timestamp").type == pa.timestamp("ns", tz="UTC")
        assert out["event_timestamp"].cast(pa.int64()).to_pylist() == [
            times.tz_localize(None).asi8[0] if times.tz is None else times.tz_convert("UTC").asi8[0]
        ]
