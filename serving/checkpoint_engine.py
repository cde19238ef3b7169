"""The checkpoint engine's HTTP routes over one model registry (``featurestore.checkpoint_engine``
says how engines form a tree): behind the same API keys, scopes and body bound as the other
servers, every route needing the ``read`` scope (model weights are as private as features). A
source in broadcast mode also seats the inference servers that join its broadcasts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from featurestore.auth import Authenticator
from featurestore.broadcast_rounds import JOIN_SECONDS, Coordinator, Transport
from featurestore.checkpoint_engine import Publisher, Replica, state
from featurestore.config import RepoConfig
from featurestore.errors import FeatureStoreError
from featurestore.training.model_registry import MODEL_FILES, NAME_PATTERN, STAGES, ModelRegistry
from serving.fast_lane import FastLane
from serving.metrics import Metrics
from serving.responses import install_error_handlers

log = logging.getLogger("featurestore.checkpoint_engine")

DISCONNECT_CHECK_SECONDS = 0.25  # how often a held seat looks whether its member is still there
T = TypeVar("T")
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such model, version or file."}}


class JoinRequest(BaseModel):
    member: str = Field(..., pattern="^[A-Za-z0-9_.:-]{1,128}$", description="The member's id (one per process).")
    stage: str = Field("production", pattern="^(" + "|".join(STAGES) + ")$", description="The alias it serves.")
    wait: float = Field(JOIN_SECONDS, ge=0, le=JOIN_SECONDS, description="Seconds to hold the seat at most.")
    machine: str | None = Field(
        None, pattern="^[0-9a-f]{32}$", description="The member's machine id: on the source's, it reads shared memory."
    )


def create_app(
    registry: ModelRegistry,
    replica: Replica | None = None,
    config: RepoConfig | None = None,
    publisher: Publisher | None = None,
) -> FastAPI:
    """The routes every engine serves over its own registry; with ``replica``, the engine also keeps
    that registry in step with its source, on a thread; with ``publisher``, it broadcasts each
    promotion to the members that joined. ``config``: the repo's API keys and bounds."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        loops: list[tuple[Callable[[threading.Event], None], str]] = []
        if replica is not None:
            loops.append((replica.sync_forever, "checkpoint-sync"))
        if publisher is not None:
            loops.append((publisher.run_forever, "checkpoint-broadcast"))
        for target, name in loops:
            threading.Thread(target=target, args=(stop,), daemon=True, name=name).start()
        yield
        stop.set()

    app = FastAPI(
        title="featurestore checkpoint engine",
        version="0.1.0",
        lifespan=lifespan,
        description="Model versions for inference replicas: aliases, hashes, files; long-poll for changes.",
    )
    metrics = Metrics("featurestore_checkpoint_engine")
    install_error_handlers(app, metrics)
    name_path = Path(..., pattern=NAME_PATTERN, description="A registered model's name.")

    @app.get("/models/{name}", summary="Aliases and versions of a model; with `wait`, once they change")
    async def model_state(
        name: str = name_path, wait: str | None = Query(None, max_length=64), timeout: float = Query(25.0, ge=0, le=60)
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        current = state(registry, name)
        while wait is not None and current["revision"] == wait and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            current = state(registry, name)
        return current

    served = {"files": 0}

    @app.get(
        "/models/{name}/{version}/{file}",
        summary="One file of a registered version",
        responses=NOT_FOUND,
    )
    def model_file(
        name: str = name_path, version: int = Path(..., ge=1), file: str = Path(..., pattern="^[a-z.]+$")
    ) -> Response:
        if file not in MODEL_FILES or version not in registry.versions(name):
            return Response(status_code=404)
        try:
            data = registry.file(name, version, file)  # checked against the ledger: a corrupt copy is never sent
        except FeatureStoreError as exc:
            log.warning("not serving %s v%s/%s: %s", name, version, file, exc)
            return Response(status_code=404)
        served["files"] += 1
        return Response(data, media_type="application/octet-stream")

    @app.post(
        "/broadcast/join",
        summary="Wait (up to 20 s) for a seat in the next broadcast: where its group meets, or 204 if none came",
        responses={
            204: {"description": "No broadcast came; join again."},
            400: {"description": "The body is not JSON."},
            404: {"description": "This engine does not broadcast (start it with --broadcast)."},
        },
    )
    async def join(body: JoinRequest, request: Request) -> Any:
        coordinator = publisher.coordinator if publisher is not None else None
        if coordinator is None:
            return Response(status_code=404)
        seat = await _while_connected(request, coordinator.join(body.member, body.stage, body.wait, body.machine))
        return seat.to_json() if seat is not None else Response(status_code=204)

    @app.get(
        "/stats",
        summary="Files this engine has sent (a tree keeps the source's count at one copy per child), "
        "and its latest broadcasts (members reached, failed attempts, seconds)",
    )
    async def stats() -> dict[str, Any]:
        broadcasts = list(publisher.outcomes) if publisher is not None else []
        return {"files_served": served["files"], "broadcasts": broadcasts}

    keys = config.server.api_keys if config is not None else None
    bound = config.server.max_request_bytes if config is not None else 16 * 1024 * 1024
    return FastLane(app, {}, bound, Authenticator(keys), metrics)  # type: ignore[return-value]


async def _while_connected(request: Request, waiting: Awaitable[T]) -> T | None:
    """``waiting``'s result, or None once the client has hung up: a member that died gives up its
    seat at once, not when its wait runs out, and a stopping engine does not wait for it."""
    task = asyncio.ensure_future(waiting)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_CHECK_SECONDS)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


def app_factory() -> FastAPI:
    """Entry for ``featurestore checkpoint-engine``: repo, model, source and upstream as it handed them over."""
    from featurestore.feature_store import FeatureStore
    from featurestore.launch import ServerLaunch

    launch = ServerLaunch.received()
    store = FeatureStore(launch.repo_path)
    registry = store.model_registry()
    origin = None
    if launch.models_from:  # the source's data_dir: its models, and their ledger in its registry folder
        where = store.location(launch.models_from)
        origin = ModelRegistry(where.child("models"), where.child("registry", "models.json"))
    replica = (
        Replica(registry, launch.model, launch.source, launch.upstream, models_from=origin) if launch.source else None
    )
    publisher = None
    if launch.broadcast:
        coordinator = Coordinator(
            launch.broadcast_host,
            bucket_bytes=launch.bucket_mb << 20,
            transport=cast(Transport, launch.broadcast_transport),
        )
        publisher = Publisher(registry, launch.model, coordinator)
    return create_app(registry, replica, store.config, publisher)
