"""The feature server: Feast-compatible online lookups, push, materialization, health, metrics.

``POST /get-online-features`` accepts and answers Feast's JSON shape, so a Feast client
switches by changing the URL. The hot path parses JSON with orjson, builds keys from
definitions held in memory and makes one pipelined Redis round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from datetime import datetime
from functools import partial
from itertools import repeat
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import pyarrow as pa
import redis
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StringConstraints

from featurestore import FeatureStore
from featurestore.auth import Authenticator
from featurestore.catalog import online_behind
from featurestore.definitions import PushSource
from featurestore.drift import read_drift
from featurestore.errors import FeatureStoreError, ForbiddenError, OnlineStoreUnavailable, RequestError
from featurestore.feature_logging import FeatureLogger, FollowedLog, log_path, vector_entry, vector_schema
from featurestore.launch import ServerLaunch
from featurestore.materialization.engine import MaterializationReport
from featurestore.retrieval.online import OnlineQuery
from featurestore.timestamps import parse_timestamp
from serving.auth import caller, header
from serving.fast_lane import FastLane
from serving.jobs import JobRunner
from serving.metrics import Metrics
from serving.reload import RegistryWatcher
from serving.responses import (
    JsonHandler,
    dumps,
    install_error_handlers,
    json_handler,
    json_response,
    request_time,
    respond,
)


def _iso_time(value: Any) -> Any:
    """A time in a request model: ISO 8601 text with a time of day (or a datetime), as the schema says;
    a number is refused here (pydantic would read it as epoch seconds, which the schema does not say)."""
    if isinstance(value, datetime) or (isinstance(value, str) and len(value.strip()) > 10):
        return value
    raise ValueError("an ISO 8601 date and time, e.g. 2024-05-01T10:00:00Z")


IsoTime = Annotated[datetime, BeforeValidator(_iso_time)]
FeatureRef = Annotated[str, StringConstraints(pattern=r"^[^:]+:[^:]+$")]  # view:feature

# exactly one of the two names what to look up (an empty list or name counts as absent, as Feast's clients send them)
_ONE_OF_FEATURES_OR_SERVICE: list[Any] = [
    {
        "required": ["features"],
        "properties": {
            "features": {"type": "array", "minItems": 1},
            "feature_service": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 0}]},
        },
    },
    {
        "required": ["feature_service"],
        "properties": {
            "feature_service": {"type": "string", "minLength": 1},
            "features": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
        },
    },
]


class GetOnlineFeaturesRequest(BaseModel):
    """Feast's request body."""

    features: list[FeatureRef] | None = Field(None, description="'view:feature' references (or use feature_service).")
    feature_service: str | None = Field(None, description="A feature service name (or use features).")
    entities: dict[str, list[Any]] = Field(
        ..., description="Join key -> list of values; request-time inputs also go here."
    )
    full_feature_names: StrictBool = Field(False, description="Name features 'view__feature'.")
    include_feature_view_version_metadata: StrictBool = Field(
        False, description="Feast's flag: add metadata.feature_view_metadata, each view read with its history version."
    )
    at: IsoTime | None = Field(
        None, description="Evaluate windows and ttls at this time (ISO 8601; default now): for replays."
    )

    model_config = {
        "json_schema_extra": {
            "anyOf": _ONE_OF_FEATURES_OR_SERVICE,
            "examples": [
                {
                    "features": ["card_activity:txn_count_1h", "card_profile:credit_limit"],
                    "entities": {"card_id": [1, 2]},
                }
            ],
        }
    }


class OnlineFeaturesResponse(BaseModel):
    metadata: dict[str, list[str]] = Field(..., examples=[{"feature_names": ["card_id", "txn_count_1h"]}])
    results: list[dict[str, list[Any]]] = Field(
        ...,
        examples=[
            [
                {"values": [1], "statuses": ["PRESENT"], "event_timestamps": [None]},
                {"values": [3], "statuses": ["PRESENT"], "event_timestamps": ["2024-05-01T10:00:00Z"]},
            ]
        ],
    )


class PushRequest(BaseModel):
    push_source_name: str = Field(..., examples=["transactions"])
    df: dict[str, list[Any]] = Field(..., description="Column name -> values; timestamps as ISO 8601 strings.")
    to: Literal["online", "offline", "online_and_offline"] = Field(
        "online", description="Feast's default: online only."
    )
    idempotency_key: str | None = Field(
        None,
        description="Same key on every retry of one push: its rows are kept once "
        "(the `Idempotency-Key` header works too). 409 if reused for other rows.",
    )


class WriteToOnlineStoreRequest(BaseModel):
    feature_view_name: str = Field(..., examples=["driver_stats"])
    df: dict[str, list[Any]] = Field(
        ..., description="The view's join keys, event timestamp and features: column -> values."
    )
    allow_registry_cache: bool = Field(
        True, description="Accepted for Feast's clients; the served registry is always the applied one."
    )
    transform_on_write: bool = Field(
        True, description="Accepted for Feast's clients; rows are taken as the view's rows."
    )


class MaterializeRequest(BaseModel):
    start_ts: IsoTime | None = Field(None, description="Window start (inclusive); omit for all history.")
    end_ts: IsoTime | None = Field(
        None,
        description="Window end (exclusive); default now. A window that ends before it "
        "starts holds nothing: the job writes nothing.",
    )
    feature_views: list[str] | None = None
    disable_event_timestamp: StrictBool = Field(
        False, description="Feast's flag: every row, whatever its event time (the window is ignored)."
    )
    full_feature_names: StrictBool = Field(False, description="Accepted for Feast's clients; nothing to name here.")


class MaterializeIncrementalRequest(BaseModel):
    end_ts: IsoTime | None = None
    feature_views: list[str] | None = None


JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The job finished: its state and report (`Prefer: respond-async` not sent)."},
    202: {"description": "`Prefer: respond-async`: the job, queued; follow it at `/jobs/{id}`."},
}

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "The body is not JSON of the documented shape, or the work it asked for failed on this input."
    },
    404: {"description": "Unknown feature, view, service or push source."},
    409: {
        "description": "Conflicts with an earlier request (an idempotency key reused for other rows, a job already "
        "running), or a lookup `at` a past time needs events Redis no longer keeps (`online_store.event_retention`)."
    },
    422: {"description": "Malformed request: missing or mistyped keys, empty or oversized request."},
    503: {"description": "The online store (Redis) is unreachable; retry later."},
}


def create_app(repo: str | Path | None = None, log_features: bool = False, ui: bool = False) -> FastAPI:
    """The feature server; with ``log_features``, lookups by feature service are logged (Delta, off the
    request path); with ``ui``, the web UI is served under ``/ui``."""
    watcher = RegistryWatcher(Path(repo) if repo else ServerLaunch.received().repo_path)
    metrics = Metrics("featurestore_feature_server")
    jobs = JobRunner(watcher.current.config.data_dir / "jobs")
    lookups = Lookups(watcher, metrics, log_features)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(watcher.run())
        gc.freeze()  # startup objects live forever: keep them out of GC scans (fewer latency spikes)
        yield
        task.cancel()
        jobs.shutdown()
        lookups.close()
        watcher.current.close()

    app = FastAPI(
        title="featurestore feature server",
        description="Online feature lookups (Feast-compatible), push, materialization. Statuses are true: "
        "PRESENT, NOT_FOUND, NULL_VALUE, OUTSIDE_MAX_AGE (ttl is enforced online).",
        version="0.1.0",
        lifespan=lifespan,
    )
    feast_errors = watcher.current.config.server.error_format == "feast"
    install_error_handlers(app, metrics, feast_errors)
    lookup = json_handler(metrics, "get-online-features", lookups.answer, feast_errors)
    push = json_handler(metrics, "push", partial(_push, watcher), feast_errors)
    _lookup_and_push_routes(app, watcher, lookup, push)
    _job_routes(app, watcher, jobs)
    _health_routes(app, watcher, metrics)
    if ui:
        from serving.ui import mount

        mount(app, lambda: watcher.current, metrics)
    config = watcher.current.config
    return FastLane(
        app,
        {"/get-online-features": lookup, "/push": push},
        config.server.max_request_bytes,
        Authenticator(config.server.api_keys),
        metrics,
    )  # type: ignore[return-value]


class Lookups:
    """``/get-online-features``: a lookup under the current definitions, logged per feature service
    when asked (one bounded Delta logger per service)."""

    def __init__(self, watcher: RegistryWatcher, metrics: Metrics, log_features: bool):
        self.watcher, self.metrics, self.log_features = watcher, metrics, log_features
        self.loggers: dict[str, FollowedLog] = {}

    async def answer(self, raw_body: bytes, scope: dict) -> bytes:
        body = _parse_lookup(raw_body)
        store = self.watcher.current
        query = OnlineQuery.prepare(
            store.definitions,
            store.config.project,
            body["entities"],
            body.get("features"),
            body.get("feature_service"),
            bool(body.get("full_feature_names", False)),
            store.config.online.max_request_entities,
            now=request_time(body),
            unfilled=store.unfilled_views,
        )
        response = await store.online_reader.read_async(query)
        if body.get("include_feature_view_version_metadata"):
            response.feature_view_metadata = query.view_versions()
        service = body.get("feature_service")
        if self.log_features and service and not body.get("full_feature_names"):
            self._logger(service).log(vector_entry(query, response))
        return response.to_rest_json(dumps)

    def _logger(self, service: str) -> FeatureLogger:
        """The service's log, its columns those of the definitions served now (an apply may change them)."""
        store = self.watcher.current
        if service not in self.loggers:
            self.loggers[service] = FollowedLog(
                log_path(store.config.data_dir, f"service:{service}"),
                count=self.metrics.feature_log_counts(f"service:{service}"),
            )
        return self.loggers[service].logger(store, lambda: vector_schema(store, service))

    def close(self) -> None:
        for logger in self.loggers.values():
            logger.close()


async def _push(watcher: RegistryWatcher, raw_body: bytes, scope: dict) -> dict[str, Any]:
    """``/push``: rows of a push source, with the caller's ``push`` or ``push:<source>`` scope."""
    body = _parse_push(raw_body)
    name = body["push_source_name"]
    key = caller(scope)
    if key is not None and not key.allows(f"push:{name}"):
        raise ForbiddenError(f"API key {key.name!r} may not push to {name!r} (needs push or push:{name})")
    store = watcher.current
    source = store.definitions.push_source(name)
    frame = _frame(body["df"], [f.name for f in source.schema if f.dtype.name == "UnixTimestamp"])
    idempotency_key = body.get("idempotency_key") or header(scope, b"idempotency-key")
    # Redis and the buffer's fsync block: off the event loop, which keeps serving lookups
    rows = await asyncio.to_thread(store.push, name, frame, body.get("to", "online"), idempotency_key)
    return {"pushed_rows": rows}


def _lookup_and_push_routes(app: FastAPI, watcher: RegistryWatcher, lookup: JsonHandler, push: JsonHandler) -> None:
    """The routes the fast lane serves (declared here for routing and OpenAPI), and Feast's online write."""

    @app.post(
        "/get-online-features",
        response_model=OnlineFeaturesResponse,
        responses=ERRORS,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": GetOnlineFeaturesRequest.model_json_schema()}},
            }
        },
        summary="Latest feature values for entities, column-major (Feast's shape)",
    )
    async def get_online_features(request: Request) -> Response:
        return await respond(lookup, request)

    @app.post(
        "/push",
        responses=ERRORS,
        summary="Write rows of a push source to the online and/or offline store",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": PushRequest.model_json_schema()}},
            }
        },
    )
    async def push_route(request: Request) -> Response:
        return await respond(push, request)

    @app.post(
        "/write-to-online-store",
        responses=ERRORS,
        summary="Write a feature view's rows straight to the online store (Feast's route; history is not written)",
    )
    def write_to_online_store(body: WriteToOnlineStoreRequest, request: Request) -> dict[str, Any]:
        store = watcher.current
        view = store.definitions.view(body.feature_view_name)
        source = view.source
        key = caller(request)  # a push:<source> key writes only views of that source; other views need push
        needed = f"push:{source.name}" if isinstance(source, PushSource) else "push"
        if key is not None and not key.allows(needed):
            raise ForbiddenError(f"API key {key.name!r} may not write view {view.name!r} (needs push or {needed})")
        times = [source.timestamp_field, *([source.created_timestamp_field] if source.created_timestamp_field else [])]
        return {"written_rows": store.write_to_online_store(view.name, _frame(body.df, times))}


def _job_routes(app: FastAPI, watcher: RegistryWatcher, jobs: JobRunner) -> None:
    """Materialization as background jobs, and the jobs' states."""

    def run_job(request: Request, kind: str, views: list[str] | None, run: Callable[[Any], Any]) -> Response:
        """A background job: with ``Prefer: respond-async`` 202 at once, else its outcome once it finished
        (as Feast's server answers: its clients expect the data online when the call returns)."""
        store = watcher.current
        for name in views or []:
            store.definitions.view(name)  # 404 now, not a failed job later
        work = lambda: {"views": [vars(v) for v in run(watcher.current).views]}  # noqa: E731
        if "respond-async" in (request.headers.get("prefer") or "").lower():
            return json_response(jobs.describe(jobs.submit(kind, views or [], work)), 202)
        job = jobs.wait(kind, views or [], work)
        if job.status != "succeeded":
            return json_response(
                {"detail": f"job {job.id} failed: {job.error}", "job": jobs.describe(job)}, job.error_status or 500
            )
        return json_response(jobs.describe(job))

    @app.post(
        "/materialize",
        responses={**JOB_RESPONSES, **ERRORS},
        summary="Materialize views over an event-time window into both stores (a background job; waits for it "
        "unless `Prefer: respond-async`)",
    )
    def materialize(body: MaterializeRequest, request: Request) -> Response:
        start, end = (None, None) if body.disable_event_timestamp else (body.start_ts, body.end_ts)

        def work(store: Any) -> Any:
            if start is not None and end is not None and start >= end:  # nothing in it (Feast's server answers so too)
                return MaterializationReport([])
            return store.materialize(start, end, body.feature_views)

        return run_job(request, "materialize", body.feature_views, work)

    @app.post(
        "/materialize-incremental",
        responses={**JOB_RESPONSES, **ERRORS},
        summary="Materialize everything not yet written, late rows included (a background job; waits for it "
        "unless `Prefer: respond-async`)",
    )
    def materialize_incremental(body: MaterializeIncrementalRequest, request: Request) -> Response:
        return run_job(
            request,
            "materialize-incremental",
            body.feature_views,
            lambda store: store.materialize_incremental(body.end_ts, body.feature_views),
        )

    @app.get(
        "/jobs/{job_id}",
        responses=ERRORS,
        summary="A background job's state: queued, running, succeeded (with its report) or failed",
    )
    def job_status(job_id: str) -> Response:
        return json_response(jobs.describe(jobs.get(job_id)))

    @app.get("/jobs", summary="Recent background jobs, oldest first")
    def job_list() -> Response:
        return json_response({"jobs": [jobs.describe(j) for j in jobs.list()]})


def _health_routes(app: FastAPI, watcher: RegistryWatcher, metrics: Metrics) -> None:
    @app.get("/health", responses={503: ERRORS[503]}, summary="Liveness and Redis reachability")
    async def health() -> Response:
        try:
            await watcher.current.online_store.ping_async()
        except OnlineStoreUnavailable as exc:
            metrics.redis_errors.inc()
            return json_response({"status": "unavailable", "detail": str(exc)}, 503)
        try:
            version = watcher.current.registry.current()["version"]
        except FeatureStoreError as exc:  # a damaged registry file: still serving what was loaded
            return json_response({"status": "degraded", "detail": str(exc)}, 503)
        return json_response({"status": "ok", "registry_version": version})

    @app.get(
        "/metrics",
        summary="Prometheus metrics: requests, latency, Redis errors (all workers), per-view freshness",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def prometheus() -> Response:
        try:
            newest = await watcher.current.online_store.newest_async()
        except (OnlineStoreUnavailable, redis.RedisError, OSError):
            metrics.redis_errors.inc()
            newest = None  # the request metrics still answer during an outage
        current = watcher.current
        drift = await asyncio.to_thread(read_drift, current.config.data_dir)
        return metrics.response(newest, drift, await asyncio.to_thread(_online_behind, current))


def _online_behind(store: FeatureStore) -> dict[str, bool] | None:
    """Whether each materialized view's online store lacks rows of its history (``catalog.online_behind``)."""
    layouts = {name: store.layout(name).storage_id for name, v in store.definitions.feature_views.items() if v.online}
    try:
        return online_behind(store.registry, store.online_store, layouts)
    except (FeatureStoreError, redis.RedisError, OSError):
        return None  # (the registry or Redis out of reach: the other metrics still answer)


def _frame(df: dict[str, list[Any]], timestamp_columns: list[str]) -> pa.Table:
    """A pushed ``df`` as an Arrow table (the store casts it to the declared types); timestamps as
    ISO 8601 text (naive means UTC) or epoch numbers (seconds, milliseconds, µs or ns by their
    size: ``featurestore.timestamps``), as Feast's clients send."""
    lengths = {len(values) for values in df.values()}
    if len(lengths) > 1:
        raise RequestError(f"'df' must map columns to lists of equal length, not lengths {sorted(lengths)}")
    columns = {}
    for name, values in df.items():
        try:
            columns[name] = _timestamps(name, values) if name in timestamp_columns else pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise RequestError(f"column {name!r} mixes values of different types: {exc}") from exc
        except OverflowError as exc:  # (an integer past 64 bits: JSON has no bound)
            raise RequestError(f"column {name!r} holds an integer too large for 64 bits: {exc}") from exc
    return pa.table(columns)


def _timestamps(name: str, values: list[Any]) -> pa.Array:
    try:
        parsed = [None if v is None else parse_timestamp(v) for v in values]
    except (ValueError, TypeError, OverflowError) as exc:
        raise RequestError(
            f"column {name!r} takes ISO 8601 strings (e.g. '2024-05-01T10:00:00Z') or epoch numbers "
            f"(seconds, milliseconds, µs or ns): {exc}"
        ) from exc
    return pa.array(parsed, pa.timestamp("us", tz="UTC"))


def _parse_push(raw: bytes) -> dict[str, Any]:
    """A ``PushRequest`` body, checked by hand: the route is served by the fast lane."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("push_source_name"), str):
        raise RequestError("request body must be a JSON object with 'push_source_name' (a string) and 'df'")
    df = body.get("df")
    if not isinstance(df, dict) or not all(isinstance(v, list) for v in df.values()):
        raise RequestError("'df' must be an object mapping each column to a list of values")
    if body.get("to", "online") not in ("online", "offline", "online_and_offline"):
        raise RequestError(f"'to' must be 'online', 'offline' or 'online_and_offline', not {body['to']!r}")
    if body.get("idempotency_key") is not None and not isinstance(body["idempotency_key"], str):
        raise RequestError("'idempotency_key' must be a string")
    return body  # other fields (Feast's clients send allow_registry_cache, transform_on_write) are ignored


def _parse_lookup(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object with 'entities' and 'features' or 'feature_service'")
    if not isinstance(body.get("entities"), dict):
        raise RequestError("'entities' must be an object mapping each join key to a list of values")
    features = body.get("features")
    if features is not None and (not isinstance(features, list) or not all(map(isinstance, features, repeat(str)))):
        raise RequestError("'features' must be a list of 'view:feature' strings")
    if body.get("feature_service") is not None and not isinstance(body["feature_service"], str):
        raise RequestError("'feature_service' must be a string")
    if body.get("feature_service") == "":  # (Feast's clients send it empty beside a list of features)
        del body["feature_service"]
    for flag in ("full_feature_names", "include_feature_view_version_metadata"):
        if not isinstance(body.get(flag, False), bool):
            raise RequestError(f"{flag!r} must be true or false")
    if body.get("at") is not None and not isinstance(body["at"], str):
        raise RequestError("'at' must be an ISO 8601 time such as '2024-05-01T10:00:00Z'")
    return body


def app_factory() -> FastAPI:
    """Entry for ``uvicorn --factory``: what ``featurestore serve`` handed over (``ServerLaunch``)."""
    launch = ServerLaunch.received()
    return create_app(launch.repo_path, log_features=launch.log_features, ui=launch.ui)
