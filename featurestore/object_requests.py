"""The object-storage requests this process made, by the kind S3 bills (GET, HEAD, PUT, POST,
LIST, DELETE), and the bytes they moved: what a command cost, logged when it ends and served in
``/metrics``.

Each client is counted where it makes its requests:

- boto3 (registry, model registry, runs' small objects): its ``before-send`` hook, once per HTTP
  request, retries included;
- pyarrow (history files, exports, runs, push-log reads): ``counted(fs)``, a file system that
  counts the requests pyarrow's S3 client makes for each call (a file's info is a HEAD, a LIST
  when not found; an opened file a HEAD, then a ranged GET per read; a written file one PUT, or a
  multipart upload when past one part);
- deltalake (the Delta log): its client does not expose its requests, so its *operations* are
  counted instead, as ``delta snapshot`` (a table opened or brought up to date: a LIST and a GET
  per new commit) and ``delta commit`` (a conditional PUT, more when it must retry).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.fs as pafs

KINDS = ("GET", "HEAD", "PUT", "POST", "LIST", "DELETE", "delta snapshot", "delta commit")
# pyarrow's S3 client uploads a file past this size in parts (arrow/filesystem/s3fs.cc, kPartUploadSize)
PART_BYTES = 10 * 1024 * 1024


class Meter:
    """Request counts and bytes, for the whole process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, kind: str, n: int = 1, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._counts[kind] += n
            if sent:
                self._counts["bytes sent"] += sent
            if received:
                self._counts["bytes received"] += received

    def snapshot(self) -> dict[str, int]:
        """Every count so far (kinds, ``bytes sent``, ``bytes received``)."""
        with self._lock:
            return dict(self._counts)

    def since(self, before: Mapping[str, int]) -> dict[str, int]:
        """What was counted after ``before`` (a ``snapshot()``), zero counts left out."""
        now = self.snapshot()
        return {k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0)}


METER = Meter()


def count_delta(kind: str, local: bool) -> None:
    """Count a Delta log operation (``delta snapshot`` or ``delta commit``) on object storage."""
    if not local:
        METER.add(kind)


def summary(counts: Mapping[str, int]) -> str | None:
    """One line for a log ("object storage: 3 GET (1.2 MB) · 2 PUT (40.0 MB) · 1 delta commit"),
    None when nothing was requested."""
    parts = [f"{counts[k]} {k}" for k in KINDS if counts.get(k)]
    if not parts:
        return None
    moved = [f"{counts[k] / 1e6:.1f} MB {k.split()[1]}" for k in ("bytes received", "bytes sent") if counts.get(k)]
    return "object storage: " + " · ".join(parts) + (f" ({', '.join(moved)})" if moved else "")


def count_boto3(client: Any) -> None:
    """Count every HTTP request ``client`` sends (retries included) and the bytes of each."""

    def sent(request: Any, **_: Any) -> None:
        size = int(request.headers.get("Content-Length") or 0)
        query = request.url.split("?", 1)[1] if "?" in request.url else ""
        listing = request.method == "GET" and "list-type=" in query
        METER.add("LIST" if listing else request.method, sent=size)

    def received(http_response: Any = None, **_: Any) -> None:
        if http_response is not None:
            METER.add("GET", 0, received=int(http_response.headers.get("content-length") or 0))

    client.meta.events.register("before-send.s3", sent)
    client.meta.events.register("after-call.s3.GetObject", received)


def counted(fs: pafs.FileSystem) -> FileSystem:
    """``fs`` with its requests counted (a local file system is returned as it is)."""
    return CountedFileSystem(fs) if isinstance(fs, pafs.S3FileSystem) else fs


class CountedFileSystem:
    """pyarrow's S3 file system, the calls this project makes counted as the requests pyarrow
    sends for them. A plain wrapper, not a ``pyarrow.fs.PyFileSystem``: pyarrow's upload threads
    calling back into Python could abort the interpreter at exit. Folders are emulated with
    empty ``dir/`` marker objects, which pyarrow checks and puts back around changes; deleting a
    folder lists it and deletes its keys in batches (counted for folders of under 1,000 keys)."""

    def __init__(self, native: pafs.S3FileSystem):
        self.native = native  # what pyarrow's own readers take (``filesystem=``); uncounted

    def get_file_info(self, paths: Any) -> Any:
        infos = self.native.get_file_info(paths)
        if isinstance(paths, pafs.FileSelector):
            METER.add("LIST", max(1, -(-len(infos) // 1000)))  # a page per 1,000 keys
            return infos
        many = infos if isinstance(infos, list) else [infos]
        METER.add("HEAD", len(many))
        missing = sum(1 for info in many if info.type == pafs.FileType.NotFound)
        if missing:  # not a key: pyarrow then lists the prefix, to see whether it is a folder
            METER.add("LIST", missing)
        return infos

    def delete_file(self, path: str) -> None:
        self.native.delete_file(path)
        for kind in ("HEAD", "DELETE", "PUT"):
            METER.add(kind)

    def delete_dir(self, path: str) -> None:
        self.native.delete_dir(path)
        for kind in ("HEAD", "LIST", "POST", "DELETE", "PUT"):
            METER.add(kind)

    def open_input_stream(self, path: str) -> _Reading:
        METER.add("HEAD")
        return _Reading(self.native.open_input_stream(path))

    def open_input_file(self, path: str) -> _Reading:
        METER.add("HEAD")
        return _Reading(self.native.open_input_file(path))

    def open_output_stream(self, path: str) -> _Writing:
        return _Writing(self.native.open_output_stream(path))


FileSystem: TypeAlias = pafs.FileSystem | CountedFileSystem  # what ``Location.filesystem()`` hands out


class _Reading:
    """A file being read, each read a ranged GET (a Python file: pyarrow's readers take it)."""

    def __init__(self, native: pa.NativeFile):
        self.native = native
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self.native.read() if n is None or n < 0 else self.native.read(n)
        if data:
            METER.add("GET", received=len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.native.seek(offset, whence)

    def tell(self) -> int:
        return self.native.tell()

    def size(self) -> int:
        return self.native.size()

    def seekable(self) -> bool:
        return self.native.seekable()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.native.close()

    def __enter__(self) -> _Reading:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Writing:
    """A file being written: one PUT at close, or a multipart upload (a POST to start, a PUT per
    part, a POST to finish) past one part."""

    def __init__(self, native: pa.NativeFile):
        self.native = native
        self.written = 0
        self.closed = False

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.native.write(data)
        self.written += size
        return size

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self.native.flush()

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.native.close()
        if self.written < PART_BYTES:
            METER.add("PUT", sent=self.written)
        else:
            METER.add("POST", 2)
            METER.add("PUT", -(-self.written // PART_BYTES), sent=self.written)

    def __enter__(self) -> _Writing:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
