"""The README's first command, end to end at a small size: `featurestore demo`."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_runs_end_to_end_and_proves_consistency(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FEATURESTORE_DATA_DIR")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "demo",
            "--data-dir",
            str(tmp_path),
            "--cards",
            "300",
            "--days",
            "10",
            "--replay-days",
            "0.5",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "replayed payments: offline" in out and "online" in out and "p99" in out
    assert "difference +0.000" in out or "difference -0.000" in out  # served features = point-in-time features
    assert "all features                 100.000%" in out
    assert "training and serving saw the same values" in out
    assert "web UI: " in out and "http://127.0.0.1:8765/ui/" in out
    assert list((tmp_path / "consistency").glob("*.jsonl"))  # the check the UI charts was recorded
    leftover = subprocess.run(["pgrep", "-f", f"{tmp_path}/redis"], capture_output=True, text=True).stdout
    assert leftover == "", "the embedded redis-server was left running"
