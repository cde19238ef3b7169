"""Content-addressed artifacts: a file's SHA-256 is its name, so anyone holding it can verify it.

``<data_dir>/artifacts/<sha256>`` (a folder or an ``s3://`` prefix), written once, never changed:
on object storage a put-if-absent, so writers on many machines need no coordination, and a
second ``put`` of the same content costs one refused request. On local disk, files whose owner
never rewrites them may be hard-linked instead of copied; anything else is copied, since
rewriting a linked file in place would change the artifact too.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path

from featurestore.errors import NotFoundError, RequestError
from featurestore.retrieval.export import sha256_file
from featurestore.storage import Location

_HEX = re.compile(r"[0-9a-f]{64}")


class ArtifactStore:
    def __init__(self, root: Path | Location):
        self.location = Location.of(root)
        self.objects = self.location.objects()

    @property
    def root(self) -> Path:
        return self.location.path

    def put(self, path: Path, link: bool = False) -> str:
        """Store ``path`` under its hash (``link``: hard-link an immutable local file); returns the hash."""
        if not self.location.is_local:
            return self.put_bytes(Path(path).read_bytes())
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".incoming.{uuid.uuid4().hex}.tmp"
        try:
            if not link:
                raise OSError
            os.link(path, tmp)
        except OSError:  # a copy: asked for, or another file system
            shutil.copyfile(path, tmp)
        sha = sha256_file(tmp)  # of the bytes kept, whatever happens to ``path`` meanwhile
        os.replace(tmp, self.root / sha)
        return sha

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self.objects.put(sha, data, if_absent=True)  # refused: the same bytes are already there
        return sha

    def _checked(self, sha: str) -> str:
        if not _HEX.fullmatch(sha):
            raise RequestError(f"an artifact is named by its SHA-256 (64 lower-case hex digits), not {sha[:80]!r}")
        if self.objects.stamp(sha) is None:
            raise NotFoundError(f"no artifact {sha}")
        return sha

    def path(self, sha: str) -> Path:
        """The artifact's local file (local stores only; see ``read``)."""
        return self.root / self._checked(sha)

    def read(self, sha: str) -> bytes:
        found = self.objects.get(self._checked(sha))
        if found is None:
            raise NotFoundError(f"no artifact {sha}")
        return found[0]

    def verify(self, sha: str) -> bool:
        """Whether the stored bytes still hash to their name."""
        if self.location.is_local:
            return sha256_file(self.path(sha)) == sha
        return hashlib.sha256(self.read(sha)).hexdigest() == sha
