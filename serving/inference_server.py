"""The inference server: online features (one Redis round trip) → saved preprocessing → model.

Loads the model version behind a stage alias, refuses one trained on definitions that have
since changed, swaps to a newly promoted version between requests when the registry
announces it (Redis pub/sub), and logs every served feature vector off the request path. With
``source`` (a checkpoint engine in broadcast mode) it also takes each promotion's weights in
memory and flips to them in place (``ModelHolder.take``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import sys
import threading
import uuid
from collections.abc import Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, Field

from featurestore import FeatureStore
from featurestore.auth import Authenticator
from featurestore.broadcast_rounds import JOIN_SECONDS, Member
from featurestore.checkpoint_engine import key_headers, version_files
from featurestore.errors import FeatureStoreError, OnlineStoreUnavailable, RequestError
from featurestore.feature_logging import FollowedLog, log_path, vector_entry, vector_schema
from featurestore.launch import ServerLaunch
from featurestore.retrieval.online import PRESENT, OnlineQuery, json_number
from featurestore.shared_tensors import machine_id
from featurestore.training.model_registry import MODELS_CHANNEL, LoadedModel, ModelRegistry, stale_views
from featurestore.weight_broadcast import stream_bytes
from serving.fast_lane import FastLane
from serving.metrics import Metrics
from serving.reload import RegistryWatcher
from serving.responses import install_error_handlers, json_handler, json_response, request_time, respond

log = logging.getLogger("featurestore.server")


class PredictRequest(BaseModel):
    instances: list[dict[str, Any]] = Field(
        ..., description="Entity keys and request-time inputs, one object per prediction."
    )
    at: datetime | None = Field(
        None, description="Evaluate windows and ttls at this time (ISO 8601; default now): for replays."
    )
    model_config = {
        "json_schema_extra": {"examples": [{"instances": [{"card_id": 17, "merchant_id": 4, "amount": 129.9}]}]}
    }


_KEY_SCHEMAS = {  # a join key's JSON values by declared type (as the lookup coerces them: "17" for an Int64 too)
    "Int64": {
        "anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^-?[1-9][0-9]*$|^0$"}]
    },  # (beyond Int64: NOT_FOUND)
    "Int32": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^-?[1-9][0-9]*$|^0$"}]},
    "String": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "Float32": {"type": "number"},
    "Float64": {"type": "number"},
    "Bool": {"type": "boolean"},
    "UnixTimestamp": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "integer"}]},
}


_VALUE_SCHEMAS = {
    "Int64": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "Int32": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
    "Float32": {"type": "number"},
    "Float64": {"type": "number"},
    "String": {"type": "string"},
    "Bool": {"type": "boolean"},
}


def _input_schema(loaded: LoadedModel, name: str) -> dict[str, Any]:
    """A request input: a number the model's float32 input holds once scaled."""
    limits = loaded.preprocessor.input_range(name)
    return {"type": "number"} if limits is None else {"type": "number", "minimum": limits[0], "maximum": limits[1]}


def predict_schema(store: FeatureStore, loaded: LoadedModel) -> dict[str, Any]:
    """``/predict``'s body for the served model: instances with its entity keys and request inputs
    (what it looks up and scores), each required; or one such instance alone."""
    defs = store.definitions
    refs = store.get_feature_service(loaded.card["feature_service"]).feature_refs()
    views = list(dict.fromkeys(r.split(":")[0] for r in refs))
    stored = [
        v
        for name in views
        for v in (
            [r.split(":")[0] for r in defs.on_demand_feature_views[name].input_refs]
            if name in defs.on_demand_feature_views
            else [name]
        )
    ]
    keys = {k: _KEY_SCHEMAS.get(t.name, {}) for view in dict.fromkeys(stored) for k, t in defs.key_types[view].items()}
    fields = {
        f.name: _VALUE_SCHEMAS.get(f.dtype.name, {})
        for name in views
        if name in defs.on_demand_feature_views
        for f in defs.on_demand_feature_views[name].request_fields
    }
    inputs = {**fields, **{name: _input_schema(loaded, name) for name in loaded.card["request_inputs"]}}
    instance = {"type": "object", "properties": {**keys, **inputs}, "required": [*keys, *inputs]}
    return {
        "anyOf": [
            {
                **PredictRequest.model_json_schema(),
                "properties": {
                    "instances": {
                        "type": "array",
                        "items": instance,
                        "minItems": 1,
                        "description": PredictRequest.model_fields["instances"].description,
                    },
                    "at": PredictRequest.model_json_schema()["properties"]["at"],
                },
                "required": ["instances"],
            },
            {**instance, "not": {"required": ["instances"]}, "description": "One instance alone."},
        ]
    }


def model_registry(store: FeatureStore) -> ModelRegistry:
    return store.model_registry()


def load_checked(store: FeatureStore, name: str, ref: str | int, device: str = "cpu") -> LoadedModel:
    """Load a model version (onto ``device``); refuse it if its feature definitions changed since training."""
    loaded = model_registry(store).load(name, ref, device=device)
    check_fresh(store, name, loaded.version, loaded.card)
    return loaded


def check_fresh(store: FeatureStore, name: str, version: int, card: dict[str, Any]) -> None:
    """Refuse a version whose feature definitions changed since its training data was exported."""
    service = store.get_feature_service(card["feature_service"])
    views = list(dict.fromkeys(r.split(":")[0] for r in service.feature_refs()))
    stale = stale_views(card, store.definition_hashes(views))
    if stale:
        raise FeatureStoreError(
            f"model {name} v{version} was trained on older definitions of {stale}; "
            "retrain on a fresh export (or restore those definitions) before serving it"
        )


class ModelHolder:
    """The serving model; replaced by one attribute assignment, so a request sees old or new, whole.

    ``follow_promotions`` and ``reconcile`` run beside the server and swap in the version the
    registry's alias names (each replica does the same); ``take`` flips to a broadcast version."""

    def __init__(self, watcher: RegistryWatcher, model_name: str, stage: str, device: str):
        self.watcher, self.model_name, self.stage, self.device = watcher, model_name, stage, device
        self.loaded = load_checked(watcher.current, model_name, stage, device)
        self.followed = self.loaded.version  # the alias's version when last followed
        self._switching = threading.Lock()  # a broadcast's flip and install, or a catch-up: one at a time

    def catch_up(self) -> None:
        """Load the version the alias names now, if it moved (promotions made while starting, or
        by the file path); a version flipped to by broadcast is not undone before its alias moves."""
        with self._switching:
            latest = model_registry(self.watcher.current).resolve(self.model_name, self.stage)
            if latest != self.followed:
                if latest != self.loaded.version:
                    self.loaded = load_checked(self.watcher.current, self.model_name, latest, self.device)
                self.followed = latest

    def take(self, version: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Flip to a version received by broadcast: its tensors become the model's parameters (no
        copy, no disk), then it is installed in this replica's registry from the same bytes,
        checked against the source's hashes, and the alias moves, so a restart serves it too."""
        from featurestore.training.distributed import pick_device
        from featurestore.training.model import from_saved
        from featurestore.training.preprocessing import Preprocessor

        if meta.get("model") != self.model_name:
            raise FeatureStoreError(f"a broadcast of {meta.get('model')!r} reached the server of {self.model_name!r}")
        store = self.watcher.current
        card = json.loads(meta["card.json"])
        check_fresh(store, self.model_name, version, card)
        model = from_saved(meta["config"], tensors).to(pick_device(self.device))
        pre = Preprocessor.from_dict(json.loads(meta["preprocessing.json"]))
        with self._switching:
            self.loaded = LoadedModel(self.model_name, version, model, pre, card)
            registry = model_registry(store)
            registry.install(self.model_name, version, version_files(tensors, meta), meta["hashes"])
            registry.promote(self.model_name, version, self.stage, loads=True)
            self.followed = version
        log.info("%s v%s: serving, taken by broadcast", self.model_name, version)

    def broadcasts(self, source: str, host: str) -> Member:
        """This server's seat in ``source``'s broadcasts (with the key in ``FEATURESTORE_API_KEY``)."""
        import httpx

        client = httpx.Client(timeout=httpx.Timeout(10.0, read=JOIN_SECONDS + 10), headers=key_headers())
        body = {"member": f"{self.model_name}-{uuid.uuid4().hex[:12]}", "stage": self.stage, "machine": machine_id()}

        def join() -> dict[str, Any] | None:
            answer = client.post(f"{source.rstrip('/')}/broadcast/join", json=body).raise_for_status()
            return None if answer.status_code == 204 else answer.json()

        return Member(join, self.take, host, stream_bytes(self.loaded.model.state_dict()))

    async def follow_promotions(self) -> None:
        """Swap in a newly promoted version between requests, when a registry announces a promotion
        of this model and stage (this replica's own alias decides which version)."""
        while True:
            try:
                async for message in self.watcher.current.online_store.subscribe(MODELS_CHANNEL):
                    name, version, promoted_stage = message.split(":")
                    if name == self.model_name and promoted_stage == self.stage and int(version) != self.loaded.version:
                        try:
                            await asyncio.to_thread(self.catch_up)
                        except FeatureStoreError as exc:
                            print(f"not switching to {name} v{version}: {exc}", file=sys.stderr)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis went away: resubscribe when it is back
                await asyncio.sleep(1.0)

    async def reconcile(self) -> None:
        """Follow the registry's alias itself too, so a lost announcement (Redis down) or a version
        installed by the checkpoint engine is picked up within a second."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.catch_up)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving the current version, try again next tick
                print(f"not switching {self.model_name} {self.stage}: {exc}", file=sys.stderr)


def create_app(
    repo: str | Path | None = None,
    model_name: str = "fraud",
    stage: str = "production",
    log_features: bool = True,
    device: str = "cpu",
    source: str | None = None,
    broadcast_host: str = "127.0.0.1",
) -> FastAPI:
    # one request scores a handful of rows: intra-op threads only add hand-offs (and spin on shared cores)
    torch.set_num_threads(1)
    watcher = RegistryWatcher(Path(repo) if repo else ServerLaunch.received().repo_path)
    store = watcher.current
    holder = ModelHolder(watcher, model_name, stage, device)
    metrics = Metrics("featurestore_inference_server")
    logger = (
        FollowedLog(log_path(store.config.data_dir, model_name), count=metrics.feature_log_counts(model_name))
        if log_features
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(t) for t in (watcher.run(), holder.follow_promotions(), holder.reconcile())]
        holder.catch_up()
        stop = threading.Event()
        if source:
            member = holder.broadcasts(source, broadcast_host)
            threading.Thread(target=member.run_forever, args=(stop,), daemon=True, name="broadcast").start()
        gc.freeze()  # startup objects live forever: keep them out of GC scans (fewer latency spikes)
        yield
        stop.set()
        for task in tasks:
            task.cancel()
        if logger:
            logger.close()
        watcher.current.close()

    app = FastAPI(
        title="featurestore inference server",
        description=f"Scores with model '{model_name}' ({stage}) from online features; statuses and event times per feature.",
        version="0.1.0",
        lifespan=lifespan,
    )
    feast_errors = watcher.current.config.server.error_format == "feast"
    install_error_handlers(app, metrics, feast_errors)
    predict_body = json_handler(metrics, "predict", partial(_predict, watcher, holder, logger), feast_errors)

    @app.post(
        "/predict",
        summary="Score one or more instances",
        responses={
            404: {"description": "Unknown model or feature."},
            409: {"description": "`at` is further back than the events Redis keeps (`online_store.event_retention`)."},
            422: {"description": "Missing or mistyped keys or inputs."},
            503: {"description": "Redis unreachable."},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": predict_schema(store, holder.loaded)}},
            }
        },
    )
    async def predict(request: Request) -> Response:
        return await respond(predict_body, request)

    @app.get("/health", summary="Liveness, model version and Redis reachability")
    async def health() -> Response:
        body = {"model": holder.loaded.name, "version": holder.loaded.version}
        try:
            await watcher.current.online_store.ping_async()
        except OnlineStoreUnavailable as exc:
            return json_response({**body, "status": "unavailable", "detail": str(exc)}, 503)
        return json_response({**body, "status": "ok"})

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def prometheus() -> Response:
        return metrics.response()

    config = watcher.current.config
    return FastLane(
        app, {"/predict": predict_body}, config.server.max_request_bytes, Authenticator(config.server.api_keys), metrics
    )  # type: ignore[return-value]


def _instances(raw_body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The body and its instances: ``{"instances": [...]}`` or one instance alone."""
    try:
        body = orjson.loads(raw_body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    instances = body.get("instances") if isinstance(body, dict) else None
    if isinstance(body, dict) and "instances" not in body:
        instances = [body]  # a single instance
    if not isinstance(instances, list) or not instances or not all(isinstance(i, dict) for i in instances):
        raise RequestError("send {'instances': [{key: value, ...}, ...]} with at least one instance")
    return body, instances


async def _predict(
    watcher: RegistryWatcher, holder: ModelHolder, logger: FollowedLog | None, raw_body: bytes, scope: dict
) -> dict[str, Any]:
    """``/predict``: the instances' online features, scored by the model serving now."""
    body, instances = _instances(raw_body)
    loaded, current = holder.loaded, watcher.current
    columns: dict[str, Sequence[Any]] = {k: [i.get(k) for i in instances] for k in instances[0]}
    inputs: dict[str, list[float]] = {}
    for name in loaded.card["request_inputs"]:
        values = columns.get(name)
        if values is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise RequestError(f"every instance needs a numeric request input {name!r}")
        inputs[name] = [float(v) for v in values]
        if (limits := loaded.preprocessor.input_range(name)) is not None:
            low, high = limits
            if bad := [v for v in inputs[name] if not low <= v <= high]:
                raise RequestError(
                    f"request input {name!r} = {bad[0]:g} is outside the range the model takes ({low:g} to {high:g})"
                )
    query = OnlineQuery.prepare(
        current.definitions,
        current.config.project,
        columns,
        None,
        loaded.card["feature_service"],
        False,
        current.config.online.max_request_entities,
        now=request_time(body),
        unfilled=current.unfilled_views,
    )
    response = await current.online_reader.read_async(query)
    n = len(instances)
    keys = len(query.key_names)
    model_columns = dict(zip(response.feature_names[keys:], response.values[keys:]))
    keys_used = {k: columns.get(k, [None] * n) for k in loaded.preprocessor.hashed}  # entity-key embeddings
    scores = loaded.predict({**model_columns, **inputs, **keys_used})
    if logger:  # (its columns those of the definitions and the model serving now)
        logged = partial(
            vector_schema, current, loaded.card["feature_service"], loaded.card["request_inputs"], with_model=True
        )
        logger.logger((current, loaded.version), logged).log(
            vector_entry(
                query,
                response,
                model_name=[loaded.name] * n,
                model_version=[loaded.version] * n,
                score=scores.tolist(),
                **inputs,
            )
        )
    feature_names = response.feature_names[keys:]
    predictions = []
    for row in range(n):
        predictions.append(
            {
                "score": json_number(float(scores[row])),
                "features": {
                    name: {
                        "value": json_number(response.values[keys + j][row]),
                        "status": response.statuses[keys + j][row],
                        "event_timestamp": response.event_timestamps[keys + j][row],
                    }
                    for j, name in enumerate(feature_names)
                },
                "missing_features": [
                    name for j, name in enumerate(feature_names) if response.statuses[keys + j][row] != PRESENT
                ],
            }
        )
    return {"model": {"name": loaded.name, "version": loaded.version}, "predictions": predictions}


def app_factory() -> FastAPI:
    """Entry for ``uvicorn --factory``: what ``featurestore serve-model`` handed over (``ServerLaunch``)."""
    launch = ServerLaunch.received()
    return create_app(
        launch.repo_path,
        launch.model,
        launch.stage,
        device=launch.device,
        source=launch.source,
        broadcast_host=launch.broadcast_host,
    )
