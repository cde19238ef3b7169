"""API keys with scopes, for both servers.

Keys are configured by their SHA-256 only (``server.auth.keys`` in featurestore.yaml, or the
``FEATURESTORE_API_KEYS`` environment variable holding the same list as JSON), so the config
file grants nothing to whoever reads it. Several keys may be live at once: rotate by adding
the new key, moving clients over, then removing the old one.

Scopes: ``read`` (lookups, /predict, health, metrics, docs), ``push`` (any push source) or
``push:<source>``, ``materialize``, ``track`` (writing runs through the MLflow-compatible API),
and ``admin`` (everything).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from featurestore.errors import FeatureStoreError

KEYS_ENV = "FEATURESTORE_API_KEYS"
SCOPES = ("read", "push", "materialize", "track", "admin")


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        """``scope`` is ``read``, ``materialize``, ``track``, ``push`` or ``push:<source>``."""
        if "admin" in self.scopes or scope in self.scopes:
            return True
        return scope.startswith("push:") and "push" in self.scopes


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "fsk_" + secrets.token_urlsafe(32)


def parse_keys(raw: Any, where: str) -> list[ApiKey]:
    """``[{name, sha256, scopes: [...]}, ...]`` -> keys, with errors naming the bad entry."""
    if not isinstance(raw, list):
        raise FeatureStoreError(f"{where} must be a list of {{name, sha256, scopes}} entries")
    keys = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not {"name", "sha256", "scopes"} <= set(entry):
            raise FeatureStoreError(f"{where}[{i}] needs name, sha256 and scopes (`featurestore api-key` prints one)")
        digest, scopes = str(entry["sha256"]).lower(), entry["scopes"]
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise FeatureStoreError(f"{where}[{i}] ({entry['name']}): sha256 must be 64 hex digits, the key's SHA-256")
        if not isinstance(scopes, list) or not all(
            isinstance(s, str) and (s in SCOPES or s.startswith("push:")) for s in scopes
        ):
            raise FeatureStoreError(
                f"{where}[{i}] ({entry['name']}): scopes are a list of {list(SCOPES)} or 'push:<source>'"
            )
        keys.append(ApiKey(str(entry["name"]), digest, frozenset(scopes)))
    return keys


def keys_from_env(configured: list[ApiKey] | None) -> list[ApiKey] | None:
    """The environment's keys when set (secrets stay out of the repo), else the configured ones."""
    raw = os.environ.get(KEYS_ENV)
    if not raw:
        return configured
    try:
        return parse_keys(json.loads(raw), KEYS_ENV)
    except json.JSONDecodeError as exc:
        raise FeatureStoreError(f"{KEYS_ENV} is not JSON: {exc}") from None


COOKIE = "featurestore_key"


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            from urllib.parse import unquote

            return unquote(value).strip() or None
    return None


class Authenticator:
    """Who is calling, and may they? ``keys=None`` means authentication is off."""

    def __init__(self, keys: Iterable[ApiKey] | None):
        self.keys = list(keys) if keys is not None else None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def identify(self, headers: Iterable[tuple[bytes, bytes]], cookie: bool = False) -> ApiKey | None:
        """The key a request presents (``Authorization: Bearer``, ``X-API-Key``, or with ``cookie``
        the ``featurestore_key`` cookie a browser sends: servers allow it on GET only, so a
        page elsewhere cannot make a browser write anything)."""
        presented = None
        for name, value in headers:
            if name == b"x-api-key":
                presented = value.decode("latin-1").strip()
            elif name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].decode("latin-1").strip()
            elif cookie and name == b"cookie" and presented is None:
                presented = _cookie(value.decode("latin-1"), COOKIE)
        if not presented:
            return None
        digest = hash_key(presented)
        found = None
        for key in self.keys or ():
            if hmac.compare_digest(key.sha256, digest):  # constant time, every key compared
                found = key
        return found
