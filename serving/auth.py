"""Who may call which route: API-key scopes per route, the caller of a request, the sign-in page."""

from __future__ import annotations

from fastapi import Request

from featurestore.auth import ApiKey, Authenticator
from serving.responses import dumps

ROUTE_SCOPES = {
    "/push": "push",
    "/write-to-online-store": "push",
    "/materialize": "materialize",
    "/materialize-incremental": "materialize",
    "/jobs": "materialize",
}  # every other route needs "read"


TRACKING = "/api/2.0/mlflow"  # MLflow's tracking and artifact routes: writing runs needs "track"


def route_scope(path: str, method: str = "GET") -> str:
    """The scope a request needs: by its path's first segment (``/jobs/abc`` as ``/jobs``); on
    MLflow's routes, ``track`` to write (searches are POSTs that only read)."""
    if path.startswith(TRACKING):
        return "read" if method in ("GET", "HEAD") or path.endswith("/search") else "track"
    return ROUTE_SCOPES.get(path) or ROUTE_SCOPES.get("/" + path.split("/")[1], "read")


def caller(request: Request | dict) -> ApiKey | None:
    """The API key a request (or ASGI scope) was authenticated with (None when authentication is off)."""
    scope = request if isinstance(request, dict) else request.scope
    return scope.get("state", {}).get("api_key")


def refusal(auth: Authenticator, scope: dict) -> tuple[int, bytes, bytes] | None:
    """Why a request may not go on, as ``(status, body, content type)``, or None once its key is
    known and has the route's scope (then kept in the scope's state: ``caller``). Off: None."""
    if not auth.enabled:
        return None
    safe = scope.get("method") in ("GET", "HEAD")
    key = auth.identify(scope.get("headers", ()), cookie=safe)
    if key is None:
        if safe and "text/html" in (header(scope, b"accept") or ""):  # a browser: a form asking for the key
            return 401, LOGIN_PAGE, b"text/html; charset=utf-8"
        missing = "missing or unknown API key; send `Authorization: Bearer <key>`"
        return 401, _refused(scope, "UNAUTHENTICATED", missing), JSON
    needed = route_scope(scope.get("path", ""), scope.get("method", "GET"))
    if not (key.allows(needed) or (needed == "push" and any(s.startswith("push:") for s in key.scopes))):
        lacks = f"API key {key.name!r} lacks the {needed!r} scope this route needs"
        return 403, _refused(scope, "PERMISSION_DENIED", lacks), JSON
    scope.setdefault("state", {})["api_key"] = key
    return None


JSON = b"application/json"


def _refused(scope: dict, code: str, message: str) -> bytes:
    """A refusal's body; on MLflow's routes in MLflow's words, so its client names the error."""
    if scope.get("path", "").startswith(TRACKING):
        return dumps({"error_code": code, "message": message})
    return dumps({"detail": message})


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
