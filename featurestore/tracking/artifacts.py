"""Content-addressed artifacts: a file's SHA-256 is its name, so anyone holding it can verify it.

``<data_dir>/artifacts/<sha256>``, written once, never changed; a second ``put`` of the same
content is free. Files whose owner never rewrites them (a registered model version) may be
hard-linked instead of copied; anything else is copied, since rewriting a linked file in place
would change the artifact too.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from featurestore.errors import NotFoundError, RequestError
from featurestore.retrieval.export import sha256_file

_HEX = re.compile(r"^[0-9a-f]{64}$")


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def put(self, path: Path, link: bool = False) -> str:
        """Store ``path`` under its hash (``link``: hard-link an immutable file); returns the hash."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".incoming.{uuid.uuid4().hex}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            if not link:
                raise OSError
            os.link(path, tmp)
        except OSError:  # a copy: asked for, or another file system
            shutil.copyfile(path, tmp)
        sha = sha256_file(tmp)  # of the bytes kept, whatever happens to ``path`` meanwhile
        os.replace(tmp, self.root / sha)
        return sha

    def path(self, sha: str) -> Path:
        if not _HEX.match(sha):
            raise RequestError(f"an artifact is named by its SHA-256 (64 lower-case hex digits), not {sha[:80]!r}")
        target = self.root / sha
        if not target.exists():
            raise NotFoundError(f"no artifact {sha}")
        return target

    def verify(self, sha: str) -> bool:
        """Whether the stored bytes still hash to their name."""
        return sha256_file(self.path(sha)) == sha
