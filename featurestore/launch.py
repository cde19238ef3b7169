"""What the CLI hands a server process: one frozen, serialized record.

uvicorn starts each worker from an import string (``serving.feature_server:app_factory``), so
nothing but the environment reaches it: the record travels as one JSON variable, written by
the CLI and read once by the app factory, instead of one variable per option."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

LAUNCH_ENV = "FEATURESTORE_LAUNCH"
REPO_ENV = "FEATURESTORE_REPO"  # the repo served when a server is started by hand


@dataclass(frozen=True)
class ServerLaunch:
    repo: str = "."
    log_features: bool = False  # feature server: log lookups by service
    ui: bool = False  # feature server: also serve the web UI under /ui
    model: str = "fraud"  # inference server and checkpoint engine: the model served
    stage: str = "production"  # inference server: the alias (stage) served
    device: str = "cpu"  # inference server: where the model scores
    source: str | None = (
        None  # checkpoint engine: the engine this replica follows; inference server: whose broadcasts it takes
    )
    upstream: str | None = None  # checkpoint engine: the relay it fetches from (default: its source)
    models_from: str | None = None  # checkpoint engine: the source's data_dir on object storage, fetched from first
    broadcast: bool = False  # checkpoint engine (source): broadcast each promotion to the seated replicas
    broadcast_host: str = "127.0.0.1"  # both sides: this machine's address the broadcast group reaches it on
    bucket_mb: int = 64  # checkpoint engine (source): broadcast bucket size
    broadcast_transport: str = "auto"  # checkpoint engine (source): auto, shared or network

    def export(self) -> None:
        """Hand this record to the server processes this one starts."""
        os.environ[LAUNCH_ENV] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def received(cls) -> ServerLaunch:
        """The record the CLI handed over; run by hand (``uvicorn --factory``), the defaults, with
        the repo from ``FEATURESTORE_REPO`` (else the working directory)."""
        raw = os.environ.get(LAUNCH_ENV)
        if not raw:
            return cls(repo=os.environ.get(REPO_ENV, "."))
        return cls(**json.loads(raw))

    @property
    def repo_path(self) -> Path:
        return Path(self.repo).resolve()
