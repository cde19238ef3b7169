"""The online store's Lua scripts: package data (``online/scripts/*.lua``), read once per process.

Each script is called by its SHA-1 (EVALSHA); a Redis that lost its scripts (a restart, a
promoted replica) is sent their text again and the calls, all idempotent, are retried.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Script:
    """A Lua script's text and SHA-1, as EVALSHA needs them."""

    name: str
    code: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.code.encode()).hexdigest()


@functools.cache
def scripts() -> dict[str, Script]:
    """``{name: script}`` for every ``scripts/<name>.lua``."""
    folder = resources.files("featurestore.online") / "scripts"
    return {
        entry.name.removesuffix(".lua"): Script(entry.name.removesuffix(".lua"), entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".lua")
    }
