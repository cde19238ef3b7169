"""What both servers share: error → status mapping, JSON encoding, metrics, registry refresh."""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from featurestore import FeatureStore
from featurestore.auth import ApiKey, Authenticator
from featurestore.errors import (
    ConflictError,
    FeatureStoreError,
    ForbiddenError,
    NotFoundError,
    OnlineStoreUnavailable,
    RequestError,
)

log = logging.getLogger("featurestore.server")


def _default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_UTC_Z  # datetimes as 2024-05-01T10:00:00Z


def dumps(body: Any) -> bytes:
    return orjson.dumps(body, default=_default, option=JSON_OPTIONS)


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
    if isinstance(exc, OnlineStoreUnavailable):
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


class Metrics:
    """Prometheus metrics for one app (its own registry, so tests can build many apps).

    With several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set, as ``featurestore serve
    --workers N`` does) every worker writes its samples to that folder and a scrape of any worker
    reports the sum over all of them."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{prefix}_requests_total",
            "Requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{prefix}_request_seconds",
            "Request latency by endpoint.",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        self.redis_errors = Counter(
            f"{prefix}_redis_errors_total", "Online store (Redis) errors.", registry=self.registry
        )
        self.feature_log = Counter(
            f"{prefix}_feature_log_total",
            "Feature log: rows logged or dropped (past the buffer's bound "
            "while flushes fail), and failed flushes, per log.",
            ["log", "outcome"],
            registry=self.registry,
        )
        self._children: dict[tuple[str, int], tuple] = {}
        self._pending: dict[tuple[str, int], list[float]] = {}  # request durations not yet in Prometheus
        self._flush_scheduled = False

    def feature_log_counts(self, name: str):
        """The ``count`` callback of a ``FeatureLogger`` named ``name``: its outcomes as metrics."""
        return lambda outcome, n: self.feature_log.labels(name, outcome.replace(" ", "_")).inc(n)

    def observe(self, endpoint: str, status: int, started: float) -> None:
        """Count a request. Kept in a plain dict and handed to Prometheus in bulk within
        ``FLUSH_SECONDS`` (and at each scrape): a Counter and a Histogram update per request
        cost ~5 µs of a lookup's ~80."""
        durations = self._pending.setdefault((endpoint, status), [])
        durations.append(time.perf_counter() - started)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)
            except RuntimeError:  # no event loop: at once
                self.flush()
        elif len(durations) >= MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        """Hand the requests counted since the last flush to Prometheus."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for key, durations in pending.items():
            endpoint, status = key
            children = self._children.get(key)
            if children is None:  # label lookups take a lock; do them once per (endpoint, status)
                children = self._children[key] = (
                    self.requests.labels(endpoint, str(status)),
                    self.latency.labels(endpoint),
                )
            children[0].inc(len(durations))
            _observe_all(children[1], durations)

    def response(self, newest_events: dict[str, int] | None = None) -> Response:
        """The metrics text; ``newest_events`` (view -> newest event time online, µs) adds per-view freshness."""
        self.flush()
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        body = generate_latest(registry)
        if newest_events:
            now = time.time()
            freshness = GaugeMetricFamily(
                f"{self.prefix}_view_freshness_seconds",
                "Age of the newest event written online, per view.",
                labels=["view"],
            )
            for view, us in sorted(newest_events.items()):
                freshness.add_metric([view], max(0.0, now - us / 1e6))
            extra = CollectorRegistry()
            extra.register(_Fixed([freshness]))
            body += generate_latest(extra)
        return Response(body, media_type="text/plain; version=0.0.4")


FLUSH_SECONDS = 1.0  # how far request metrics may lag (a scrape also flushes its own worker's)
MAX_PENDING = 10_000  # requests of one (endpoint, status) counted before a flush, whatever the time


def _observe_all(histogram: Histogram, durations: list[float]) -> None:
    """``histogram.observe(d)`` for each duration, as one update per bucket: bucket counts by
    bisection, then prometheus_client's value objects (its ``_sum`` and ``_buckets``, which a
    worker writes to its multiprocess files) incremented once each."""
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    for d in durations:
        counts[bisect.bisect_left(bounds, d)] += 1  # the first bound >= d, as observe() picks it
    histogram._sum.inc(sum(durations))
    for bucket, count in zip(histogram._buckets, counts):
        if count:
            bucket.inc(count)


class _Fixed:
    """A collector of metric families computed at scrape time."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


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

    return run


async def respond(handler: JsonHandler, request: Request) -> Response:
    """The FastAPI route for a handler the FastLane serves (same code, reached through routing)."""
    status, payload = await handler(await request.body(), cast(dict, request.scope))
    return Response(payload, status_code=status, media_type="application/json")


def install_error_handlers(app: FastAPI, metrics: Metrics, feast_errors: bool = False) -> None:
    @app.exception_handler(FeatureStoreError)
    async def _feature_store_error(request: Request, exc: FeatureStoreError) -> Response:
        if isinstance(exc, OnlineStoreUnavailable):
            metrics.redis_errors.inc()
        return Response(error_body(exc, feast_errors), status_code=error_status(exc), media_type="application/json")


class RegistryWatcher:
    """Reloads the repo's definitions when ``apply`` writes a new registry version.

    Requests read ``current`` (already loaded); a background task polls the registry file
    (one ``stat`` a second) and swaps in a fully loaded store, so no request parses anything.
    """

    def __init__(self, repo: Path, interval: float = 1.0):
        self.repo = repo
        self.interval = interval
        self.current = self._load()
        self._mtime = self._stat()

    def _load(self) -> FeatureStore:
        store = FeatureStore(self.repo)
        store.require_applied()  # parse and validate now, not on a request; serve applied definitions only
        return store

    def _stat(self) -> float:
        with contextlib.suppress(FileNotFoundError):
            return os.stat(self.current.registry.file).st_mtime
        return 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            mtime = self._stat()
            if mtime != self._mtime:
                self._mtime = mtime
                try:
                    fresh = await asyncio.to_thread(self._load)
                except Exception as exc:  # any failure: keep serving the last good definitions, keep watching
                    log.warning("registry reload failed, still serving the previous definitions: %s", exc)
                    continue
                fresh._online = self.current._online  # keep the warm connection pool
                self.current = fresh


ROUTE_SCOPES = {
    "/push": "push",
    "/write-to-online-store": "push",
    "/materialize": "materialize",
    "/materialize-incremental": "materialize",
    "/jobs": "materialize",
}  # every other route needs "read"


def route_scope(path: str) -> str:
    """The scope a path needs: by its first segment (``/jobs/abc`` as ``/jobs``)."""
    return ROUTE_SCOPES.get(path) or ROUTE_SCOPES.get("/" + path.split("/")[1], "read")


def caller(request: Request | dict) -> ApiKey | None:
    """The API key a request (or ASGI scope) was authenticated with (None when authentication is off)."""
    scope = request if isinstance(request, dict) else request.scope
    return scope.get("state", {}).get("api_key")


def header(scope: dict, name: bytes) -> str | None:
    """A request header's value (``name`` in lower case)."""
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


# What a browser gets instead of a page when authentication is on and it sent no valid key: a
# form that keeps the key in a same-site cookie, which servers accept on GET requests only.
LOGIN_PAGE = b"""<!doctype html><html><head><meta charset="utf-8"><title>featurestore: sign in</title></head>
<body style="font-family:system-ui;max-width:28em;margin:4em auto"><h2>featurestore</h2>
<p>This server needs an API key with the <code>read</code> scope.</p>
<form id="login"><input id="key" type="password" placeholder="API key" autocomplete="off" style="width:100%;padding:.4em">
<button style="margin-top:.6em">Sign in</button></form>
<script>document.getElementById("login").onsubmit = function (e) { e.preventDefault();
document.cookie = "featurestore_key=" + encodeURIComponent(document.getElementById("key").value) + "; path=/; SameSite=Strict";
location.reload(); };</script></body></html>"""


class FastLane:
    """Serve a few hot POST routes as plain ASGI, before FastAPI's routing and middleware.

    The FastAPI app still declares those routes (OpenAPI docs, same handler); everything
    else, lifespan included, goes to it. ``handlers`` map a path to ``async (body) -> (status, bytes)``.
    Every request body, on every route, is read here first: bounded by ``max_body_bytes`` (413
    past it, whether declared or chunked), and by ``BODY_CHUNK_SECONDS`` between chunks (408).
    """

    def __init__(
        self,
        app: FastAPI,
        handlers: dict[str, Callable],
        max_body_bytes: int = 16 * 1024 * 1024,
        auth: Authenticator | None = None,
        metrics: Metrics | None = None,
    ):
        self.app = app
        self.handlers = handlers
        self.max_body_bytes = max_body_bytes
        self.auth = auth or Authenticator(None)
        self.metrics = metrics
        # metric labels: known routes by path, anything else as "other" (bounded label values)
        self.routes = {getattr(r, "path", "") for r in app.routes} | set(handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        try:
            status = await self._serve(scope, receive, send)
        finally:  # every route, every status, the fast lanes included
            if self.metrics is not None:
                path = scope.get("path", "")
                self.metrics.observe(path if path in self.routes else "other", status, started)

    async def _serve(self, scope, receive, send) -> int:
        """Answer the request; return the status sent."""
        if self.auth.enabled:  # every route, the fast ones included, before anything else runs
            safe = scope.get("method") in ("GET", "HEAD")
            key = self.auth.identify(scope.get("headers", ()), cookie=safe)
            if key is None:
                if safe and "text/html" in (header(scope, b"accept") or ""):  # a browser: a form asking for the key
                    return await _reply(send, 401, LOGIN_PAGE, b"text/html; charset=utf-8")
                return await _reply(
                    send, 401, dumps({"detail": "missing or unknown API key; send `Authorization: Bearer <key>`"})
                )
            needed = route_scope(scope.get("path", ""))
            if not (key.allows(needed) or (needed == "push" and any(s.startswith("push:") for s in key.scopes))):
                return await _reply(
                    send, 403, dumps({"detail": f"API key {key.name!r} lacks the {needed!r} scope this route needs"})
                )
            scope.setdefault("state", {})["api_key"] = key
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _reply(send, 413, self._too_large())
        handler = self.handlers.get(scope.get("path")) if scope.get("method") == "POST" else None
        if handler is None and scope.get("method") not in BODY_METHODS:
            return await self._delegate(scope, receive, send)
        # every body is read here, bounded in size (chunked ones too) and in time between chunks
        body = await self._read_body(receive)
        if isinstance(body, int):
            return await _reply(send, body, self._too_large() if body == 413 else self._too_slow())
        if handler is None:
            return await self._delegate(scope, _replay(body), send)
        status, payload = await handler(body, scope)
        return await _reply(send, status, payload)

    async def _read_body(self, receive) -> bytes | int:
        """The request body, or the status to answer instead: 413 past ``max_body_bytes``, 408 when
        the client sends nothing for ``BODY_CHUNK_SECONDS`` (a slow client holds no server forever).
        Chunks are joined once, in linear time."""
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_CHUNK_SECONDS)
            except TimeoutError:
                return 408
            if message.get("type") == "http.disconnect":
                return 400
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return 413
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _delegate(self, scope, receive, send) -> int:
        """Let the FastAPI app answer; return the status it sent (500 if it raised first)."""
        sent = [500]

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                sent[0] = message["status"]
            await send(message)

        await self.app(scope, receive, send_and_note)
        return sent[0]

    def _too_slow(self) -> bytes:
        return dumps({"detail": f"the request body stalled for {BODY_CHUNK_SECONDS:g} s; send it at once"})

    def _too_large(self) -> bytes:
        return dumps(
            {
                "detail": f"request body over {self.max_body_bytes} bytes; split the request "
                f"(server.max_request_bytes sets the limit)"
            }
        )


BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
BODY_CHUNK_SECONDS = 30.0  # the longest a request body may pause between chunks


def _replay(body: bytes):
    """An ASGI ``receive`` that hands the app the body already read, then waits for the disconnect."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # (a real receive blocks until the client goes)
        return {"type": "http.disconnect"}

    return receive


async def _reply(send, status: int, payload: bytes, content_type: bytes = b"application/json") -> int:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", b"%d" % len(payload))],
        }
    )
    await send({"type": "http.response.body", "body": payload})
    return status
