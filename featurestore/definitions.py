"""The declarative objects users write in a feature repo.

These are plain data: constructing one never touches storage. The registry loads,
validates and hashes them; materialization and retrieval read them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Sequence, Union

from featurestore.types import DType

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _caller_location() -> tuple[str, int]:
    """File and line of the user code that constructed a definition."""
    frame = sys._getframe(1)
    # skip our own frames and the __init__ that @dataclass generates (its file is "<string>")
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or (frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__")
    ):
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


@dataclass(frozen=True)
class Location:
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def _location() -> Location:
    return Location(*_caller_location())


def content_hash(spec: dict[str, Any]) -> str:
    """Hash of a normalized definition: equal specs, equal hashes, on any machine."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(eq=False)
class Field:
    """A named, typed column of a feature view or push source."""

    name: str
    dtype: DType
    description: str = ""

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.name}


@dataclass(eq=False)
class Entity:
    """A thing features describe (a card, a merchant), identified by its join keys."""

    name: str
    join_keys: list[str]
    value_type: DType | dict[str, DType] | None = None
    description: str = ""
    location: Location = field(default_factory=_location, repr=False)

    def key_types(self) -> dict[str, DType | None]:
        if isinstance(self.value_type, dict):
            return {k: self.value_type.get(k) for k in self.join_keys}
        return {k: self.value_type for k in self.join_keys}

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "entity",
            "name": self.name,
            "join_keys": list(self.join_keys),
            "key_types": {k: (t.name if t else None) for k, t in self.key_types().items()},
            "description": self.description,
        }


# ---------------------------------------------------------------- sources


@dataclass(eq=False)
class FileSource:
    """Rows in Parquet/CSV files (a path or glob) or a Delta table."""

    path: str
    timestamp_field: str
    created_timestamp_field: str | None = None
    format: Literal["parquet", "csv", "delta"] = "parquet"
    name: str = ""
    location: Location = field(default_factory=_location, repr=False)

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "file",
            "path": self.path,
            "format": self.format,
            "timestamp_field": self.timestamp_field,
            "created_timestamp_field": self.created_timestamp_field,
        }


@dataclass(eq=False)
class SqlSource:
    """A DuckDB ``SELECT`` (over files, e.g. ``read_parquet('x/*.parquet')``)."""

    query: str
    timestamp_field: str
    created_timestamp_field: str | None = None
    name: str = ""
    location: Location = field(default_factory=_location, repr=False)

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "sql",
            "query": " ".join(self.query.split()),
            "timestamp_field": self.timestamp_field,
            "created_timestamp_field": self.created_timestamp_field,
        }


@dataclass(eq=False)
class PushSource:
    """Rows pushed at run time with ``FeatureStore.push``; kept in a Delta log that views read."""

    name: str
    schema: list[Field]
    timestamp_field: str = "event_timestamp"
    created_timestamp_field: str | None = None
    location: Location = field(default_factory=_location, repr=False)

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "push",
            "name": self.name,
            "schema": [f.to_spec() for f in self.schema],
            "timestamp_field": self.timestamp_field,
            "created_timestamp_field": self.created_timestamp_field,
        }


Source = Union[FileSource, SqlSource, PushSource]
Transformation = Union[str, Callable[..., Any], None]


# ---------------------------------------------------------------- views


@dataclass(eq=False)
class FeatureView:
    """A group of features with one entity set, one source and one ttl.

    ``transformation`` is an optional SQL ``SELECT ... FROM source`` or a Python function
    taking and returning a pyarrow Table (or pandas DataFrame); it runs once, at
    materialization, so training and serving read the same computed rows.
    """

    name: str
    entities: list[Entity]
    source: Source
    schema: list[Field]
    ttl: timedelta | None = None
    online: bool = True
    offline: bool = True
    transformation: Transformation = None
    description: str = ""
    owner: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    location: Location = field(default_factory=_location, repr=False)

    @property
    def join_keys(self) -> list[str]:
        return [k for e in self.entities for k in e.join_keys]

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.schema]

    def field(self, name: str) -> Field:
        for f in self.schema:
            if f.name == name:
                return f
        raise KeyError(name)

    def __getitem__(self, features: Sequence[str]) -> "FeatureViewProjection":
        if isinstance(features, str):
            features = [features]
        return FeatureViewProjection(self, list(features))

    def transformation_spec(self) -> str | None:
        if self.transformation is None:
            return None
        if isinstance(self.transformation, str):
            return " ".join(self.transformation.split())
        try:
            return textwrap.dedent(inspect.getsource(self.transformation))
        except (OSError, TypeError):
            return getattr(self.transformation, "__qualname__", repr(self.transformation))

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "feature_view",
            "name": self.name,
            "entities": [e.name for e in self.entities],
            "join_keys": self.join_keys,
            "source": self.source.to_spec(),
            "schema": [f.to_spec() for f in self.schema],
            "ttl_seconds": self.ttl.total_seconds() if self.ttl is not None else None,
            "online": self.online,
            "offline": self.offline,
            "transformation": self.transformation_spec(),
            "description": self.description,
            "owner": self.owner,
            "tags": dict(self.tags),
        }


@dataclass(eq=False)
class FeatureViewProjection:
    """``view[["f1", "f2"]]``: a subset of a view's features, as used by services."""

    view: FeatureView
    features: list[str]


@dataclass(eq=False)
class FeatureService:
    """A named set of features a model consumes, in a fixed order."""

    name: str
    features: list[FeatureView | FeatureViewProjection]
    description: str = ""
    owner: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    location: Location = field(default_factory=_location, repr=False)

    def feature_refs(self) -> list[str]:
        """``view:feature`` strings in service order."""
        refs = []
        for item in self.features:
            if isinstance(item, FeatureViewProjection):
                refs += [f"{item.view.name}:{f}" for f in item.features]
            else:
                refs += [f"{item.name}:{f}" for f in item.feature_names]
        return refs

    def to_spec(self) -> dict[str, Any]:
        return {
            "kind": "feature_service",
            "name": self.name,
            "features": self.feature_refs(),
            "description": self.description,
            "owner": self.owner,
            "tags": dict(self.tags),
        }


Definition = Union[Entity, FeatureView, FeatureService, PushSource]
