"""Where durable state lives: a local folder or an S3-compatible prefix, and the two ways it is used.

``Location`` names a place (``/abs/path`` or ``s3://bucket/prefix``) with the options to reach it:
credentials and endpoint from the standard AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``), a profile
(``AWS_PROFILE``, read through boto3's credential chain), and ``storage_options`` from
``featurestore.yaml`` over both. Delta tables are opened with ``delta_options()`` (delta-rs commits
with S3 conditional puts: no lock service), Parquet files are read and written through
``filesystem()`` (pyarrow's S3 client; DuckDB is handed Arrow, it needs no S3 extension).

``Objects`` is the other use: small JSON ledgers (the registry, watermarks, run ids) updated by
compare-and-swap, ``put(key, data, if_match=etag)`` / ``put(key, data, if_absent=True)``, which S3
answers with ``412 Precondition Failed`` when another writer got there first. ``LocalObjects``
does the same on a folder (under one advisory lock), so the registry has one write protocol.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from featurestore.errors import FeatureStoreError, NotFoundError, StorageUnavailable
from featurestore.files import atomic_write, file_lock

if TYPE_CHECKING:
    from featurestore.object_requests import FileSystem

S3 = "s3://"
_AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ALLOW_HTTP",
)


@dataclass(frozen=True)
class Location:
    """A local folder (an absolute path) or ``s3://bucket/prefix``, with its storage options."""

    url: str
    options: tuple[tuple[str, str], ...] = ()  # storage options given in featurestore.yaml (frozen)

    @classmethod
    def parse(cls, value: str | Path, base: Path, options: Mapping[str, Any] | None = None) -> Location:
        """``value`` as written in featurestore.yaml: relative local paths are under ``base``."""
        text = str(value)
        if text.startswith(S3):
            if not text[len(S3) :].split("/")[0]:
                raise FeatureStoreError(f"{text!r} names no bucket; write s3://bucket/prefix")
            return cls(text.rstrip("/"), tuple(sorted((str(k), str(v)) for k, v in (options or {}).items())))
        if "://" in text:
            raise FeatureStoreError(f"{text!r}: only local paths and s3://bucket/prefix are supported")
        path = Path(text)
        return cls(str(path if path.is_absolute() else base / path))

    @property
    def is_local(self) -> bool:
        return not self.url.startswith(S3)

    @property
    def path(self) -> Path:
        """The local folder (a location on S3 has none)."""
        if not self.is_local:
            raise FeatureStoreError(f"{self.url} is on object storage, not a local folder")
        return Path(self.url)

    @property
    def bucket_and_key(self) -> tuple[str, str]:
        bucket, _, key = self.url[len(S3) :].partition("/")
        return bucket, key

    @classmethod
    def of(cls, where: str | Path | Location) -> Location:
        """``where`` as a Location: a Location as is, a local path made absolute, an ``s3://`` URL."""
        if isinstance(where, Location):
            return where
        return cls.parse(where, Path.cwd())

    def split(self) -> tuple[Location, str]:
        """The folder holding this location, and its last name (``s3://b/p/models.json`` → ``s3://b/p``, ``models.json``)."""
        folder, _, name = self.url.rpartition("/")
        return Location(folder, self.options), name

    def child(self, *parts: str) -> Location:
        return Location("/".join([self.url, *parts]), self.options)

    def __str__(self) -> str:
        return self.url

    def settings(self) -> dict[str, str]:
        """The S3 settings in force: the AWS variables, a profile's credentials, then the file's options."""
        found = {k: os.environ[k] for k in _AWS_VARIABLES if os.environ.get(k)}
        if "AWS_REGION" not in found and "AWS_DEFAULT_REGION" in found:
            found["AWS_REGION"] = found["AWS_DEFAULT_REGION"]
        found.pop("AWS_DEFAULT_REGION", None)
        given = {k.upper() if k.lower().startswith("aws_") else k: v for k, v in self.options}
        if "AWS_ACCESS_KEY_ID" not in found and "AWS_ACCESS_KEY_ID" not in given:
            found.update(_profile_credentials(given.get("AWS_PROFILE") or os.environ.get("AWS_PROFILE")))
        found.update(given)
        found.pop("AWS_PROFILE", None)
        found.setdefault("AWS_REGION", "us-east-1")
        if found.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            found.setdefault("AWS_ALLOW_HTTP", "true")
        return found

    def delta_options(self) -> dict[str, str] | None:
        """``storage_options`` for deltalake: None on local disk."""
        if self.is_local:
            return None
        # commits are conditional puts (If-None-Match on the next log entry): two writers on two
        # machines cannot both write version N+1, the loser re-reads and retries
        return {**self.settings(), "conditional_put": "etag"}

    def filesystem(self) -> tuple[FileSystem, str]:
        """A pyarrow file system and this location's path in it (one S3 client per set of
        settings, shared: uploads and reads in a loop reuse its connections)."""
        import pyarrow.fs as pafs

        if self.is_local:
            return pafs.LocalFileSystem(), self.url
        settings = {**self.settings(), "AWS_MAX_ATTEMPTS": str(_attempts(5))}
        return _s3_filesystem(tuple(sorted(settings.items()))), self.url[len(S3) :]

    def upload(self, local: Path, name: str) -> None:
        """Copy a local file to ``name`` under this location (streamed: S3 multipart for big files)."""
        import pyarrow.fs as pafs

        fs, path = self.filesystem()
        if self.is_local:
            Path(path, name).parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(str(local), f"{path}/{name}", destination_filesystem=fs)
            return
        with open(local, "rb") as source, fs.open_output_stream(f"{path}/{name}") as out:
            shutil.copyfileobj(source, out, COPY_CHUNK)

    def download(self, name: str, local: Path) -> None:
        """Copy ``name`` under this location to a local file; NotFoundError when there is none."""
        import pyarrow.fs as pafs

        fs, path = self.filesystem()
        if fs.get_file_info(f"{path}/{name}").type == pafs.FileType.NotFound:
            raise NotFoundError(f"no {name} at {self.url}")
        if self.is_local and Path(path, name).resolve() == local.resolve():
            return  # already there (copying a file onto itself would empty it)
        local.parent.mkdir(parents=True, exist_ok=True)
        if self.is_local:
            pafs.copy_files(f"{path}/{name}", str(local), source_filesystem=fs)
            return
        with fs.open_input_stream(f"{path}/{name}") as source, open(local, "wb") as out:
            shutil.copyfileobj(source, out, COPY_CHUNK)

    def remove(self, name: str) -> None:
        """Delete ``name`` under this location, if it is there."""
        import pyarrow.fs as pafs

        fs, path = self.filesystem()
        if fs.get_file_info(f"{path}/{name}").type != pafs.FileType.NotFound:
            fs.delete_file(f"{path}/{name}")

    def objects(self) -> Objects:
        """This location as a key-value store of small objects with compare-and-swap."""
        return LocalObjects(self.path) if self.is_local else S3Objects(self)


COPY_CHUNK = 8 << 20  # bytes a read or write of an upload or download moves (a ranged GET each)


@functools.lru_cache(maxsize=8)
def _s3_filesystem(settings: tuple[tuple[str, str], ...]) -> FileSystem:
    import pyarrow.fs as pafs

    from featurestore.object_requests import counted

    s = dict(settings)
    endpoint = s.get("AWS_ENDPOINT_URL")
    s3 = pafs.S3FileSystem(
        access_key=s.get("AWS_ACCESS_KEY_ID"),
        secret_key=s.get("AWS_SECRET_ACCESS_KEY"),
        session_token=s.get("AWS_SESSION_TOKEN"),
        region=s["AWS_REGION"],
        endpoint_override=endpoint.split("://", 1)[1] if endpoint else None,
        scheme="http" if endpoint and endpoint.startswith("http://") else "https",
        # 503 SlowDown, dropped connections: retried with backoff
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=int(s["AWS_MAX_ATTEMPTS"])),
        allow_delayed_open=True,  # a file smaller than one part is one PutObject, not a multipart upload
    )
    return counted(s3)


def _attempts(default: int) -> int:
    """Tries per request: the standard ``AWS_MAX_ATTEMPTS`` when set, else ``default``."""
    given = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return int(given) if given.isdigit() and int(given) > 0 else default


def _profile_credentials(profile: str | None) -> dict[str, str]:
    """Credentials from the AWS config and credentials files (or any provider boto3 knows)."""
    try:
        import boto3
    except ImportError:
        return {}
    credentials = boto3.Session(profile_name=profile).get_credentials()
    if credentials is None:
        return {}
    frozen = credentials.get_frozen_credentials()
    found = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        found["AWS_SESSION_TOKEN"] = frozen.token
    return found


# ---------------------------------------------------------------- objects


class Objects(Protocol):
    """Small objects under string keys, each with an entity tag that changes with its content."""

    def get(self, key: str) -> tuple[bytes, str] | None:
        """``(data, etag)``, or None when there is no such object."""
        ...

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_absent: bool = False) -> str | None:
        """Write; returns the new etag, or None when the condition failed (another writer's change)."""
        ...

    def keys(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (at any depth), sorted."""
        ...

    def stamp(self, key: str) -> str | None:
        """The object's etag without reading it (a cheap change check), None when absent."""
        ...


class LocalObjects:
    """``Objects`` in a folder: writes are atomic renames, conditions checked under one advisory lock."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def get(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = (self.root / key).read_bytes()
        except FileNotFoundError:
            return None
        return data, _etag(data)

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_absent: bool = False) -> str | None:
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / ".lock"):
            if if_match is not None or if_absent:
                found = self.get(key)
                if (if_absent and found is not None) or (
                    if_match is not None and (found is None or found[1] != if_match)
                ):
                    return None
            atomic_write(self.root / key, data)
        return _etag(data)

    def keys(self, prefix: str) -> list[str]:
        folder = prefix.rpartition("/")[0]
        found = []
        for where, folders, files in os.walk(self.root / folder):
            folders[:] = [f for f in folders if not f.startswith(".")]  # locks, temp files, staging
            relative = Path(where).relative_to(self.root).as_posix()
            for name in files:
                key = name if relative == "." else f"{relative}/{name}"
                if key.startswith(prefix) and not name.startswith("."):
                    found.append(key)
        return sorted(found)

    def stamp(self, key: str) -> str | None:
        try:
            info = os.stat(self.root / key)
        except FileNotFoundError:
            return None
        return f"{info.st_mtime_ns}-{info.st_size}-{info.st_ino}"


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class S3Objects:
    """``Objects`` under an S3 prefix: ``If-Match`` / ``If-None-Match: *`` puts (boto3, retried by it
    on throttling and dropped connections)."""

    def __init__(self, location: Location):
        try:
            import boto3
            from botocore.config import Config

            from featurestore.object_requests import count_boto3
        except ImportError:
            raise FeatureStoreError(
                f"{location.url}: the registry on object storage needs boto3; pip install 'featurestore[s3]'"
            ) from None

        settings = location.settings()
        self.bucket, prefix = location.bucket_and_key
        self.prefix = prefix + "/" if prefix else ""
        self.client = boto3.client(
            "s3",
            endpoint_url=settings.get("AWS_ENDPOINT_URL"),
            region_name=settings["AWS_REGION"],
            aws_access_key_id=settings.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=settings.get("AWS_SECRET_ACCESS_KEY"),
            aws_session_token=settings.get("AWS_SESSION_TOKEN"),
            config=Config(
                retries={"max_attempts": _attempts(8), "mode": "standard"}, connect_timeout=5, read_timeout=30
            ),
        )
        count_boto3(self.client)

    def _failed(self, exc: Exception) -> Exception:
        """``exc`` as a one-line error naming this location, when object storage failed."""
        explained = explain(exc)
        return StorageUnavailable(f"s3://{self.bucket}/{self.prefix}: {explained}") if explained else exc

    def get(self, key: str) -> tuple[bytes, str] | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            return reply["Body"].read(), reply["ETag"]
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            raise self._failed(exc) from exc
        except BotoCoreError as exc:
            raise self._failed(exc) from exc

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_absent: bool = False) -> str | None:
        from botocore.exceptions import BotoCoreError, ClientError

        conditions: dict[str, str] = {}
        if if_match is not None:
            conditions["IfMatch"] = if_match
        if if_absent:
            conditions["IfNoneMatch"] = "*"
        try:
            reply = self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, **conditions)
        except ClientError as exc:
            # 412: the condition failed; 409: a concurrent conditional write to the same key is in flight
            if exc.response["ResponseMetadata"]["HTTPStatusCode"] in (409, 412):
                return None
            raise self._failed(exc) from exc
        except BotoCoreError as exc:
            raise self._failed(exc) from exc
        return reply["ETag"]

    def keys(self, prefix: str) -> list[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        found: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            ):
                found += [item["Key"][len(self.prefix) :] for item in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(exc) from exc
        return sorted(found)

    def stamp(self, key: str) -> str | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)["ETag"]
        except ClientError as exc:
            if exc.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
                return None
            raise self._failed(exc) from exc
        except BotoCoreError as exc:
            raise self._failed(exc) from exc


CAS_ATTEMPTS = 50


def update(objects: Objects, key: str, change: Callable[[bytes | None], bytes | None]) -> bytes | None:
    """Read-modify-write ``key`` by compare-and-swap: ``change(current bytes or None)`` returns the
    new content (None: leave it); on a concurrent writer's change it is re-read and re-applied."""
    for attempt in range(CAS_ATTEMPTS):
        found = objects.get(key)
        new = change(found[0] if found is not None else None)
        if new is None:
            return found[0] if found is not None else None
        written = objects.put(key, new, if_absent=True) if found is None else objects.put(key, new, if_match=found[1])
        if written is not None:
            return new
        time.sleep(random.uniform(0, 0.002 * 2 ** min(attempt, 8)))  # another writer won: back off, re-read
    raise FeatureStoreError(
        f"{key}: {CAS_ATTEMPTS} concurrent changes in a row won the race against this one; try again"
    )


# ---------------------------------------------------------------- errors

# What boto3, pyarrow's S3 client and delta-rs say when object storage fails, by cause: their
# messages differ ("NoSuchBucket", "NO_SUCH_BUCKET", "bucket does not exist"), their causes do not.
_CAUSES = (
    (
        ("nosuchbucket", "no_such_bucket", "bucket does not exist", "bucket not found"),
        "the bucket does not exist: create it, or correct the s3:// URL in featurestore.yaml",
    ),
    (
        (
            "invalidaccesskeyid",
            "invalid_access_key_id",
            "signaturedoesnotmatch",
            "signature_does_not_match",
            "expiredtoken",
            "expired_token",
            "invalidtoken",
        ),
        "the credentials were refused: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
        "(or AWS_PROFILE, or storage_options in featurestore.yaml)",
    ),
    (
        ("unable to locate credentials", "nocredentialserror", "no credentials"),
        "no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    ),
    (
        ("accessdenied", "access denied", "access_denied", "forbidden"),
        "access denied: these credentials may not use this bucket or prefix; grant s3:GetObject, "
        "s3:PutObject, s3:DeleteObject and s3:ListBucket on it",
    ),
    (
        ("slowdown", "slow_down", "reduce your request rate", "throttl", "503", "service unavailable"),
        "object storage kept refusing requests (503 SlowDown) after the retries; nothing past the last "
        "commit was kept: run the command again, or with fewer writers at once",
    ),
    (
        (
            "could not connect",
            "connection refused",
            "network_connection",
            "error sending request",
            "failed to connect",
            "connect timeout",
            "timed out",
            "connection reset",
            "connection aborted",
            "endpointconnectionerror",
            "connectionclosederror",
            "remotedisconnected",
            "dns",
        ),
        "object storage could not be reached: check AWS_ENDPOINT_URL (or storage_options) and the "
        "network; nothing past the last commit was kept, run the command again once it answers",
    ),
)
_STORAGE_MODULES = ("botocore", "boto3", "deltalake", "pyarrow", "urllib3")


def _as_pattern(word: str) -> str:
    """A status code matches only as a number of its own: a retry's duration ("in 1.503877665s")
    must not read as a 503."""
    return rf"(?<![\d.]){word}(?!\d)" if word.isdigit() else re.escape(word)


# a local disk refusing a write: full, over a quota or a file-size limit, mounted read-only
_DISK_REFUSED = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def explain(exc: BaseException) -> StorageUnavailable | None:
    """A one-line error saying what to do, when ``exc`` (or what caused it) is object storage
    failing, or a local disk refusing a write; None for anything else."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    if isinstance(chain[0], StorageUnavailable):
        return chain[0]
    refused = next((e for e in chain if isinstance(e, OSError) and e.errno in _DISK_REFUSED), None)
    if refused is not None:
        where = f": {refused.filename}" if refused.filename else ""
        return StorageUnavailable(
            f"the disk refused a write ({refused.strerror}{where}): free space, or raise the quota or the "
            "file-size limit, or mount it writable; what failed was not kept, so run it again then"
        )
    from_storage = [e for e in chain if type(e).__module__.split(".")[0] in _STORAGE_MODULES or type(e) is OSError]
    text = " ".join(f"{type(e).__name__} {e}" for e in from_storage).lower()
    for words, advice in _CAUSES if from_storage else ():
        if any(re.search(_as_pattern(w), text) for w in words):
            detail = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(from_storage[0])).split())[:240]
            return StorageUnavailable(f"{advice} ({detail})")
    return None
