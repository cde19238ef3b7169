"""The checkpoint engine: moves registered model versions from training to every inference replica.

One engine runs beside the trainer (the **source**: it serves the repo's model registry) and
one beside each inference replica (serving that replica's own registry; no shared filesystem).
Every engine answers the same HTTP routes (``serving.checkpoint_engine``, behind the servers' API keys):

    GET /models/{name}                     aliases, each version's file hashes, a revision
    GET /models/{name}?wait=REV&timeout=S  the same, once the revision differs from REV (long poll)
    GET /models/{name}/{version}/{file}    one file of a version (model.pt, preprocessing.json, card.json)

A replica engine long-polls the source: a promotion is an announcement that reaches it at
once, and each answer (or reconnect, or timeout) is also a full reconciliation, so a lost
announcement or a replica that was down cannot stay behind. A missing version is fetched from
its **upstream** (another replica: engines form a tree, so the source sends each version once
per child, not once per replica) when that one already has it, else from the source after a
grace period. With ``models_from`` (an object store holding the source's model registry, as
``checkpoint-engine --models-from`` names it), a replica fetches a version there before it asks
the source, so the trainer's engine serves no copies at all. Every file is checked against the
source's SHA-256 before it is installed (a corrupt or partial transfer is refused and fetched
again). The version is then promoted in
the replica's registry, which loads it first (a version that does not load is never served);
its inference server notices the alias change and swaps models between requests.

In **broadcast mode** (``checkpoint-engine --broadcast`` on the source, ``serve-model --source``
on each replica) a promotion travels in memory instead: the source's ``Publisher`` loads the
version once and broadcasts its tensors (``featurestore.broadcast_rounds``) to every inference
server seated for it, which flips to them between requests and then installs the version in its
own registry from the same bytes (checked against the source's hashes), so the registry stays
the truth and a restart serves what was flipped to. The file path above stays the way a replica
that missed a broadcast catches up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import httpx

from featurestore.errors import FeatureStoreError, NotFoundError
from featurestore.training.model_registry import MODEL_FILES, STAGES, ModelRegistry

if TYPE_CHECKING:
    import torch

    from featurestore.broadcast_rounds import Coordinator

log = logging.getLogger("featurestore.checkpoint_engine")
UPSTREAM_GRACE_SECONDS = 10.0  # how long a replica waits for its upstream to have a version before asking the source


def state(registry: ModelRegistry, name: str) -> dict[str, Any]:
    """What an engine has of model ``name``: aliases, versions' hashes, and a revision naming both."""
    body = {
        "aliases": registry.aliases(name),
        "versions": {str(v): h for v, h in registry.hashes(name).items() if v in registry.versions(name)},
    }
    body["revision"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return body


KEY_ENV = "FEATURESTORE_API_KEY"  # the key a replica presents to its source and upstream (their `read` scope)


def key_headers(api_key: str | None = None) -> dict[str, str]:
    """The headers presenting ``api_key`` (default: ``FEATURESTORE_API_KEY``); none without a key."""
    key = api_key if api_key is not None else os.environ.get(KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


_HEX64 = re.compile(r"[0-9a-f]{64}")


def checked_state(body: Any, source: str) -> dict[str, Any]:
    """A peer's answer, validated like user input: stages it may name, versions as positive
    integers, a SHA-256 for every model file (a name or version from a peer becomes a path here)."""

    def bad(what: str) -> FeatureStoreError:
        return FeatureStoreError(f"the checkpoint engine at {source} answered {what}; refusing its state")

    if (
        not isinstance(body, dict)
        or not isinstance(body.get("aliases"), dict)
        or not isinstance(body.get("versions"), dict)
    ):
        raise bad("no aliases and versions")
    for stage, version in body["aliases"].items():
        if stage not in STAGES or type(version) is not int or version < 1:
            raise bad(f"an alias {stage!r} -> {version!r} (stages are {list(STAGES)}, versions positive integers)")
    for version, hashes in body["versions"].items():
        if not (isinstance(version, str) and version.isdigit() and version == str(int(version)) and int(version) >= 1):
            raise bad(f"a version named {version!r}")
        if not isinstance(hashes, dict) or any(
            not isinstance(hashes.get(f), str) or not _HEX64.fullmatch(hashes[f]) for f in MODEL_FILES
        ):
            raise bad(f"version {version} without a SHA-256 for each of {list(MODEL_FILES)}")
    missing = [v for v in body["aliases"].values() if str(v) not in body["versions"]]
    if missing or not isinstance(body.get("revision"), str):
        raise bad(f"aliases to versions it does not list ({missing})" if missing else "no revision")
    return body


class Replica:
    """Keeps a replica's registry in step with the source's (run ``sync_forever`` beside its server)."""

    def __init__(
        self,
        registry: ModelRegistry,
        name: str,
        source: str,
        upstream: str | None = None,
        client: httpx.Client | None = None,
        api_key: str | None = None,
        models_from: ModelRegistry | None = None,
    ):
        self.registry, self.name, self.models_from = registry, name, models_from
        self.source, self.upstream = source.rstrip("/"), upstream.rstrip("/") if upstream else None
        self.http = client or httpx.Client(timeout=httpx.Timeout(10.0, read=70.0), headers=key_headers(api_key))
        self.fetched_from: dict[int, str] = {}  # version -> where its files came from (for tests and logs)

    def sync_once(self, wait: str | None = None, timeout: float = 25.0) -> str:
        """Bring this registry level with the source (after the revision changes from ``wait``); returns
        the source's revision."""
        params: dict[str, Any] = {"wait": wait, "timeout": timeout} if wait else {}
        wanted = checked_state(
            self.http.get(f"{self.source}/models/{self.name}", params=params).raise_for_status().json(), self.source
        )
        for stage, version in sorted(wanted["aliases"].items()):
            if version not in self.registry.versions(self.name):
                self._fetch(version, wanted["versions"][str(version)])
            if self.registry.aliases(self.name).get(stage) != version:
                self.registry.promote(self.name, version, stage)  # loads it first
                log.info("%s: %s is now v%s", self.name, stage, version)
        return wanted["revision"]

    def _fetch(self, version: int, hashes: dict[str, str]) -> None:
        for origin in self._origins(version):
            try:
                if isinstance(
                    origin, ModelRegistry
                ):  # checked against that registry's ledger, then the source's hashes
                    files = origin.verify(self.name, version)
                else:
                    files = {
                        f: self.http.get(f"{origin}/models/{self.name}/{version}/{f}").raise_for_status().content
                        for f in MODEL_FILES
                    }
                self.registry.install(self.name, version, files, hashes)  # refuses a file whose hash differs
                self.fetched_from[version] = str(origin.root if isinstance(origin, ModelRegistry) else origin)
                log.info("%s v%s fetched from %s", self.name, version, self.fetched_from[version])
                return
            except (httpx.HTTPError, FeatureStoreError, NotFoundError) as exc:
                log.warning(
                    "%s v%s from %s refused or failed (%s); trying the next source", self.name, version, origin, exc
                )
        raise FeatureStoreError(f"{self.name} v{version} could not be fetched intact; retrying")

    def _origins(self, version: int) -> list[str | ModelRegistry]:
        """The upstream once it has the version, then the object store, then the source. Without an
        object store a replica waits a grace period for its upstream before asking the source."""
        stored: list[str | ModelRegistry] = [self.models_from] if self.models_from is not None else []
        if self.upstream is None:
            return [*stored, self.source]
        deadline = time.monotonic() + (0 if stored else UPSTREAM_GRACE_SECONDS)
        while True:
            try:
                if str(version) in self.http.get(f"{self.upstream}/models/{self.name}").json()["versions"]:
                    return [self.upstream, *stored, self.source]
            except (httpx.HTTPError, ValueError, KeyError):
                break  # upstream down: go on
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return [*stored, self.source]

    def sync_forever(self, stop: Any = None) -> None:
        """Long-poll and reconcile until ``stop`` (a threading.Event) is set; errors back off and retry."""
        revision, delay = None, 0.5
        while stop is None or not stop.is_set():
            try:
                revision = self.sync_once(wait=revision)
                delay = 0.5
            except (httpx.HTTPError, FeatureStoreError, NotFoundError, OSError) as exc:
                log.warning("sync with %s failed (%s); retrying in %.1f s", self.source, exc, delay)
                revision = None  # reconcile fully on reconnect
                time.sleep(delay)
                delay = min(delay * 2, 10.0)


def version_payload(registry: ModelRegistry, name: str, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A registered version as a broadcast carries it: its tensors, and as ``meta`` the rest of its
    files and their hashes (so a receiver rebuilds and checks exactly what was registered)."""
    import io

    import torch

    files = registry.verify(name, version)
    saved = torch.load(io.BytesIO(files["model.pt"]), weights_only=True)
    meta = {
        "model": name,
        "version": version,
        "config": saved["config"],
        "hashes": registry.hashes(name)[version],
        **{f: files[f].decode() for f in MODEL_FILES if f != "model.pt"},
    }
    return saved["state_dict"], meta


def version_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, bytes]:
    """The registry files of a broadcast version, rebuilt from its tensors and meta (``install``
    then checks them against the source's hashes)."""
    import io

    import torch

    from featurestore.training.model import saved_weights

    weights = io.BytesIO()
    torch.save(saved_weights(tensors, meta["config"]), weights)
    return {"model.pt": weights.getvalue(), **{f: meta[f].encode() for f in MODEL_FILES if f != "model.pt"}}


class Publisher:
    """The source's side of broadcast mode: every promotion of ``name`` (any stage, rollbacks
    too) is broadcast to the members seated for that stage. Versions aliased before it started
    reached replicas already, or reach them through the files."""

    def __init__(self, registry: ModelRegistry, name: str, coordinator: Coordinator):
        self.registry, self.name, self.coordinator = registry, name, coordinator
        self.sent: dict[str, int] = dict(registry.aliases(name))  # stage -> version last broadcast
        self.outcomes: deque[dict[str, Any]] = deque(maxlen=100)  # the latest broadcasts, for /stats

    def publish_once(self) -> None:
        from featurestore.weight_broadcast import BroadcastFailed

        for stage, version in sorted(self.registry.aliases(self.name).items()):
            if self.sent.get(stage) == version:
                continue
            state, meta = version_payload(self.registry, self.name, version)
            record: dict[str, Any] = {"stage": stage, "version": version}
            try:
                record.update(asdict(self.coordinator.broadcast(self.name, stage, version, state, meta)), ok=True)
            except BroadcastFailed as exc:
                log.warning("%s; they catch up from the files", exc)
                record.update(ok=False, error=str(exc))
            self.outcomes.append(record)
            self.sent[stage] = version

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            try:
                self.publish_once()
            except Exception as exc:  # noqa: BLE001 - a version that cannot be read is retried next tick
                log.warning("broadcast of %s skipped (%s); retrying", self.name, exc)
