"""The servers' ASGI front: authentication on every route, bounded bodies, hot routes served
without FastAPI's routing, and request metrics for every status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from featurestore.auth import Authenticator
from serving.auth import refusal
from serving.metrics import Metrics
from serving.responses import dumps


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
        refused = refusal(self.auth, scope)  # every route, the fast ones included, before anything else runs
        if refused is not None:
            return await _reply(send, *refused)
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
            return await self._delegate(scope, _replay(body, receive), send)
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


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that hands the app the body already read, then the client's own
    messages (its disconnect: a route that waits can see its client go)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


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
