"""JSON bodies and errors: how the servers encode answers and map exceptions to statuses."""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from featurestore.errors import (
    ConflictError,
    FeatureStoreError,
    ForbiddenError,
    NotFoundError,
    OnlineStoreUnavailable,
    RequestError,
    StorageUnavailable,
)
from featurestore.storage import explain

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from serving.metrics import Metrics


def _default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_UTC_Z  # datetimes as 2024-05-01T10:00:00Z


def dumps(body: Any) -> bytes:
    try:
        return orjson.dumps(body, default=_default, option=JSON_OPTIONS)
    except TypeError as exc:  # (orjson writes integers of 64 bits; JSON, and so a request, carries any)
        if "64-bit" not in str(exc):
            raise
        return orjson.dumps(_wide_integers_as_written(body), default=_default, option=JSON_OPTIONS)


def _wide_integers_as_written(value: Any) -> Any:
    """``value`` with each integer past 64 bits as its JSON text (a join key sent so is echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < 1 << 64:
        return orjson.Fragment(b"%d" % value)
    if isinstance(value, dict):
        return {k: _wide_integers_as_written(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wide_integers_as_written(v) for v in value]
    return value


def json_response(body: Any, status: int = 200) -> Response:
    return Response(dumps(body), status_code=status, media_type="application/json")


def error_status(exc: Exception) -> int:
    if isinstance(exc, ForbiddenError):
        return 403
    if isinstance(exc, NotFoundError):
        return 404
    if isinstance(exc, ConflictError):
        return 409
    if isinstance(exc, RequestError):
        return 422
    if isinstance(exc, (OnlineStoreUnavailable, StorageUnavailable)):
        return 503
    return 400


def request_time(body: Any) -> datetime | None:
    """The time a lookup is evaluated at: the body's optional ``at`` (ISO 8601, for replays); None: now."""
    at = body.get("at") if isinstance(body, dict) else None
    if at is None:
        return None
    try:  # (a date alone is no date-time: the schema says date-time)
        parsed = datetime.fromisoformat(at) if isinstance(at, str) and len(at.strip()) > 10 else None
    except ValueError:
        parsed = None
    if parsed is None:
        raise RequestError(f"'at' must be an ISO 8601 time such as '2024-05-01T10:00:00Z', not {at!r}")
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


JsonHandler = Callable[[bytes, dict], Awaitable[tuple[int, bytes]]]  # (body, ASGI scope) -> (status, JSON)


# Feast's clients turn a body naming one of its error classes into that exception (feast.errors)
_FEAST_ERRORS = (
    (ForbiddenError, "FeastPermissionError"),
    (NotFoundError, "FeastObjectNotFoundException"),
    (FeatureStoreError, "FeastError"),
)


def error_body(exc: FeatureStoreError, feast: bool = False) -> bytes:
    """``{"detail": message}``, or with ``server: {errors: feast}`` Feast's error detail: a JSON
    string of ``{"module", "class", "message"}``, which Feast's SDK raises as a typed error."""
    if not feast:
        return dumps({"detail": str(exc)})
    name = next(n for cls, n in _FEAST_ERRORS if isinstance(exc, cls))
    return dumps(orjson.dumps({"module": "feast.errors", "class": name, "message": str(exc)}).decode())


def json_handler(
    metrics: Metrics, endpoint: str, handle: Callable[[bytes, dict], Awaitable[Any]], feast_errors: bool = False
) -> JsonHandler:
    """Wrap ``handle(body, scope) -> JSON-able (or JSON bytes)`` as ``(body, scope) -> (status, JSON bytes)``: errors
    become 403/404/409/422/503 with a message, Redis errors go to the metrics (latency: ``FastLane``)."""

    async def run(body: bytes, scope: dict) -> tuple[int, bytes]:
        try:
            result = await handle(body, scope)
            return 200, result if isinstance(result, bytes) else dumps(result)
        except FeatureStoreError as exc:
            if isinstance(exc, OnlineStoreUnavailable):
                metrics.redis_errors.inc()
            return error_status(exc), error_body(exc, feast_errors)
        except Exception as exc:
            explained = unavailable(exc)
            if explained is None:
                raise
            return 503, error_body(explained, feast_errors)

    return run


def unavailable(exc: Exception) -> FeatureStoreError | None:
    """``exc`` as a 503's error where storage failed (object storage, a local disk refusing a
    write: ``storage.explain``), said in the log too; None for anything else (a 500: a bug)."""
    explained = explain(exc)
    if explained is not None:
        log.warning("answered 503: %s", explained)
    return explained


async def respond(handler: JsonHandler, request: Request) -> Response:
    """The FastAPI route for a handler the FastLane serves (same code, reached through routing)."""
    status, payload = await handler(await request.body(), cast(dict, request.scope))
    return Response(payload, status_code=status, media_type="application/json")


def document_errors(app: FastAPI) -> None:
    """``app``'s OpenAPI document with its 422s as they are answered: FastAPI's list of validation
    errors, or this project's one message (``{"detail": "..."}``: a ``RequestError``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            refused = build().get("components", {}).get("schemas", {}).get("HTTPValidationError")
            if refused is not None:
                listed = refused["properties"]["detail"]
                refused["properties"]["detail"] = {"anyOf": [listed, {"type": "string"}], "title": "Detail"}
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI, metrics: Metrics, feast_errors: bool = False) -> None:
    @app.exception_handler(FeatureStoreError)
    async def _feature_store_error(request: Request, exc: FeatureStoreError) -> Response:
        if isinstance(exc, OnlineStoreUnavailable):
            metrics.redis_errors.inc()
        return Response(error_body(exc, feast_errors), status_code=error_status(exc), media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own answer, written by orjson: it echoes the input, and a body's 1e400 or NaN
        # (which JSON parsers read as infinities) made its json.dumps raise: a 500
        return json_response({"detail": jsonable_encoder(exc.errors())}, 422)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        explained = unavailable(exc)  # storage failing (history reads, the registry, a full disk): 503 saying why
        if explained is not None:
            return Response(error_body(explained, feast_errors), status_code=503, media_type="application/json")
        return json_response({"detail": "internal error; the server's log has the details"}, 500)
