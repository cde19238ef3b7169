"""Delta tables opened once and followed: a long-lived process brings its handle of a table up to
date by reading only the commits made since (opening a table anew reads every commit since the
last checkpoint: on object storage, a request each).

Handles are per thread (a handle changes as it follows its table, so threads never share one).
A table dropped and made again under the same name has a new id in its first commit; a handle
of the old table is then opened anew, never followed onto the new table's commits.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from featurestore.object_requests import FileSystem, count_delta
from featurestore.storage import Location


class Tables:
    """The Delta tables under one location, each at its latest version or at a given one."""

    def __init__(self, location: Location):
        self.location = location
        self.options = location.delta_options()
        self._latest = threading.local()  # per thread: table URI -> its handle at the latest version
        self._fs: FileSystem | None = None

    def open(self, uri: str, version: int | None = None, fresh: bool = False) -> DeltaTable | None:
        """The table at ``uri`` (under this location) at ``version`` (default: its latest); None
        when there is no table there. ``fresh``: opened anew, not followed (what a commit builds on)."""
        if self.location.is_local and not (Path(uri) / "_delta_log").exists():
            return None
        handles = self._latest.__dict__
        if fresh:
            handles.pop(uri, None)
        elif version is not None and uri in handles and handles[uri].version() == version:
            return handles[uri]  # just brought up to date by this thread (read a version, then use it)
        if not fresh and version is None and uri in handles and self._created_as(uri) == handles[uri].metadata().id:
            handles[uri].update_incremental()
            self._counted()
            return handles[uri]
        try:
            table = DeltaTable(uri, version=version, storage_options=self.options)
        except TableNotFoundError:
            return None
        finally:
            self._counted()
        if version is None:
            handles[uri] = table
        return table

    def _counted(self) -> None:
        count_delta("delta snapshot", self.location.is_local)

    def _created_as(self, uri: str) -> str | None:
        """The id the table's first commit gave it (None: no first commit, or unreadable now)."""
        if self._fs is None:
            self._fs = self.location.filesystem()[0]
        fs = self._fs
        path = uri.split("://", 1)[1] if "://" in uri else uri
        try:
            with fs.open_input_stream(f"{path}/_delta_log/{0:020}.json") as first:
                for line in first.read().splitlines():
                    if b'"metaData"' in line:
                        return json.loads(line)["metaData"]["id"]
        except OSError:
            pass
        return None
