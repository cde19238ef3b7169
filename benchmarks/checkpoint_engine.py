"""Checkpoint engine: time from promotion to the last of 4 replicas serving a >= 100 MB model.

A source engine and 4 replica engines (real processes, each with its own registry folder;
a tree: r1, r2 fetch from the source, r3 from r1, r4 from r2) on this machine. The reference
is copying the version's files to each replica's folder in turn (shutil, no checks). The
engine's time includes HTTP transfer, SHA-256 checks and loading the model before promoting.

    python benchmarks/checkpoint_engine.py [--embedding-rows 1700000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from featurestore.training.model import TabularMLP
from featurestore.training.model_registry import MODEL_FILES, ModelRegistry
from featurestore.training.preprocessing import Preprocessor


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_run(folder: Path, rows: int) -> Path:
    """A run folder the registry takes: a model with one large embedding table."""
    model = TabularMLP(1, [rows], [32], 16)
    pre = Preprocessor(["x"], ["c"], [0.0], [1.0], {"c": ["a"]})
    folder.mkdir(parents=True)
    torch.save(
        {"model": model.state_dict(), "model_config": model.config, "preprocessor": pre.to_dict()},
        folder / "checkpoint.pt",
    )
    (folder / "params.json").write_text(
        json.dumps(
            {
                "config": {"task": "classification", "request_inputs": []},
                "feature_service": "svc",
                "features": [],
                "definition_hashes": {},
                "dataset_manifest_hash": "",
                "code_version": "",
            }
        )
    )
    (folder / "final.json").write_text("{}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embedding-rows", type=int, default=1_700_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    run = fake_run(root / "run", args.embedding_rows)

    def repo(name: str) -> Path:
        (root / name).mkdir()
        (root / name / "featurestore.yaml").write_text(f"project: bench_{name}\nmodules: []\n")
        return root / name

    def registry(path: Path) -> ModelRegistry:
        return ModelRegistry(path / "data" / "models", path / "data" / "registry" / "models.json")

    source_repo = repo("source")
    engines, urls = [], {}
    try:
        for name, upstream in [("source", None), ("r1", None), ("r2", None), ("r3", "r1"), ("r4", "r2")]:
            path = source_repo if name == "source" else repo(name)
            port = _port()
            urls[name] = f"http://127.0.0.1:{port}"
            extra = (
                []
                if name == "source"
                else ["--source", urls["source"], *(["--upstream", urls[upstream]] if upstream else [])]
            )
            engines.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "featurestore.cli",
                        "checkpoint-engine",
                        "--model",
                        "m",
                        "--repo",
                        str(path),
                        "--port",
                        str(port),
                        *extra,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(6)
        source = registry(source_repo)
        version = source.register("m", run)
        size = sum((source.root / "m" / str(version) / f).stat().st_size for f in MODEL_FILES)
        replicas = [registry(root / f"r{i}") for i in range(1, 5)]
        started = time.perf_counter()
        source.promote("m", version, "production")
        while not all(
            r.aliases("m").get("production") == version for r in replicas if (r.root / "m").exists()
        ) or not all((r.root / "m").exists() for r in replicas):
            time.sleep(0.01)
        engine_s = time.perf_counter() - started

        started = time.perf_counter()
        for i in range(4):  # the reference: copy the version's folder to each replica in turn
            shutil.copytree(source.root / "m" / str(version), root / "copies" / str(i))
        copy_s = time.perf_counter() - started
        print(
            f"model of {size / 1e6:.0f} MB to 4 replicas: checkpoint engine {engine_s:.2f} s (HTTP tree, SHA-256, load-checked "
            f"promotion); copying to each in turn {copy_s:.2f} s (same disk, no checks); ratio {engine_s / copy_s:.1f}x"
        )
    finally:
        for e in engines:
            e.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
