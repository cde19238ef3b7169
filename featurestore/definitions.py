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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from featurestore.aggregation.functions import FUNCTIONS
from featurestore.types import DType

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _caller_location() -> tuple[str, int]:
    """File and line of the user code that constructed a definition."""
    frame: FrameType | None = sys._getframe(1)
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


@dataclass(eq=False)
class StreamSource(PushSource):
    """A push source fed by a Redis Stream: ``featurestore stream NAME`` consumes it (at least once,
    acknowledged after both stores have the rows; duplicates are harmless: event ids and row
    identities deduplicate). Entries map column names to text values; timestamps in ISO 8601.
    ``stream`` defaults to ``fs:<project>:stream:<name>``."""

    stream: str = ""

    def to_spec(self) -> dict[str, Any]:
        return {**super().to_spec(), "kind": "stream", "stream": self.stream}


Source = FileSource | SqlSource | PushSource
Transformation = str | Callable[..., Any] | None


# ---------------------------------------------------------------- aggregations


def window_label(window: timedelta) -> str:
    """``timedelta(hours=24)`` -> ``"24h"``, ``timedelta(days=7)`` -> ``"7d"``: the suffix of derived names."""
    seconds = int(window.total_seconds())
    if window != timedelta(seconds=seconds):
        return f"{int(window / timedelta(microseconds=1))}us"
    if seconds % 86400 == 0 and seconds >= 2 * 86400:
        return f"{seconds // 86400}d"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@dataclass(eq=False)
class Aggregation:
    """A feature computed over an entity's events in a trailing window.

    The value at time t aggregates the events with event time in ``(t - window, t]``: offline t
    is the entity row's time, online it is the moment of the lookup. Nulls in ``column`` are
    skipped (as in SQL); ``count`` without a column counts events. ``where`` keeps only events
    passing a comparison on a stored column, ``(column, op, value)`` with op one of ``==``, ``!=``,
    ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in`` (a null column never passes); both stores
    evaluate it the same way. ``last_n`` keeps the ``n`` newest non-null values, newest first.
    """

    function: str
    window: timedelta
    column: str | None = None
    name: str = ""
    n: int | None = None
    where: tuple[str, str, Any] | None = None

    @property
    def output_name(self) -> str:
        if self.name:
            return self.name
        what = f"{self.column}_{self.function}" if self.column else self.function
        function = FUNCTIONS.get(self.function)
        if self.column and function and function.takes_n:  # last_n -> amount_last_5
            what = f"{self.column}_{self.function.removesuffix('_n')}_{self.n}"
        return f"{what}_{window_label(self.window)}"

    def output_type(self, input_type: DType | None) -> DType:
        """The feature's type, given the aggregated column's (None for a column-less count)."""
        return FUNCTIONS[self.function].output_type(input_type)

    def to_spec(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "column": self.column,
            "window_us": self.window // timedelta(microseconds=1),
            "name": self.output_name,
            "n": self.n,
            "where": list(self.where) if self.where else None,
        }


# ---------------------------------------------------------------- views


@dataclass(eq=False)
class FeatureView:
    """A group of features with one entity set, one source and one ttl.

    ``transformation`` is an optional SQL ``SELECT ... FROM source`` or a Python function
    taking and returning a pyarrow Table (or pandas DataFrame); it runs once, at
    materialization, so training and serving read the same computed rows.

    With ``aggregations`` the view stores events (``schema`` lists their columns) and serves
    windowed aggregates of them, exact at any moment online and offline. ``event_id`` names
    the column identifying an event, so a retried push never counts twice (default: the
    event's whole content). Two writes of an id less than ``dedup_window`` apart in event time
    are one event (default: the longest window, so no window counts an id twice); a shorter one
    keeps fewer past writes online (``featurestore.aggregation.dedup_us``).
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
    aggregations: list[Aggregation] = field(default_factory=list)
    event_id: str | None = None
    dedup_window: timedelta | None = None
    location: Location = field(default_factory=_location, repr=False)

    @property
    def join_keys(self) -> list[str]:
        return [k for e in self.entities for k in e.join_keys]

    @property
    def is_aggregated(self) -> bool:
        return bool(self.aggregations)

    @property
    def features(self) -> list[Field]:
        """What the view serves: its stored columns, or for an aggregated view the aggregates."""
        if not self.aggregations:
            return self.schema
        stored = {f.name: f.dtype for f in self.schema}
        return [
            Field(a.output_name, a.output_type(stored.get(a.column) if a.column else None)) for a in self.aggregations
        ]

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    @property
    def longest_window(self) -> timedelta:
        return max(a.window for a in self.aggregations)

    @property
    def own_dedup_window(self) -> timedelta | None:
        """The dedup window where it is not the default (the longest window), else None: what the
        spec and the online layout record, so setting the default changes neither."""
        if self.dedup_window is None or not self.aggregations or self.dedup_window == self.longest_window:
            return None
        return self.dedup_window

    def field(self, name: str) -> Field:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    def __getitem__(self, features: Sequence[str]) -> FeatureViewProjection:
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
            **(
                {"aggregations": [a.to_spec() for a in self.aggregations], "event_id": self.event_id}
                if self.aggregations
                else {}
            ),
            **(
                {"dedup_window_us": self.own_dedup_window // timedelta(microseconds=1)}
                if self.own_dedup_window is not None
                else {}
            ),
        }


@dataclass(eq=False)
class RequestSource:
    """Values a caller sends with each lookup (REST ``entities``, SDK entity rows) or each
    training row (entity_df columns), such as the payment's ``amount``."""

    name: str
    schema: list[Field]


OnDemandFunction = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(eq=False)
class OnDemandFeatureView:
    """Features computed at request time by one Python function from request values and
    looked-up features, e.g. ``amount / amount_mean_7d``. The same function runs on the joined
    training rows (historical retrieval, export) and on each lookup (SDK, feature server,
    inference server): written once, no training/serving skew.

    ``udf`` takes ``{name: pyarrow.Array}`` (the sources' features by feature name, the request
    fields by name; nulls where a value is missing) and returns ``{output: array or list}``
    with one value per row for each field of ``schema`` (cast to its declared type).
    """

    name: str
    sources: list[FeatureView | FeatureViewProjection | RequestSource]
    schema: list[Field]
    udf: OnDemandFunction
    description: str = ""
    owner: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    location: Location = field(default_factory=_location, repr=False)

    @property
    def features(self) -> list[Field]:
        return self.schema

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.schema]

    def field(self, name: str) -> Field:
        for f in self.schema:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def input_refs(self) -> list[str]:
        """The looked-up features it reads, as ``view:feature``."""
        refs = []
        for source in self.sources:
            if isinstance(source, FeatureViewProjection):
                refs += [f"{source.view.name}:{f}" for f in source.features]
            elif isinstance(source, FeatureView):
                refs += [f"{source.name}:{f}" for f in source.feature_names]
        return refs

    @property
    def request_fields(self) -> list[Field]:
        return [f for s in self.sources if isinstance(s, RequestSource) for f in s.schema]

    def __getitem__(self, features: Sequence[str]) -> FeatureViewProjection:
        return FeatureViewProjection(self, [features] if isinstance(features, str) else list(features))  # type: ignore[arg-type]

    def to_spec(self) -> dict[str, Any]:
        try:
            code = textwrap.dedent(inspect.getsource(self.udf))
        except (OSError, TypeError):
            code = getattr(self.udf, "__qualname__", repr(self.udf))
        return {
            "kind": "on_demand_feature_view",
            "name": self.name,
            "inputs": self.input_refs,
            "request_schema": [f.to_spec() for f in self.request_fields],
            "schema": [f.to_spec() for f in self.schema],
            "udf": code,
            "description": self.description,
            "owner": self.owner,
            "tags": dict(self.tags),
        }


def on_demand_feature_view(
    *,
    sources: list[FeatureView | FeatureViewProjection | RequestSource],
    schema: list[Field],
    name: str = "",
    description: str = "",
) -> Callable[[OnDemandFunction], OnDemandFeatureView]:
    """Decorator form, as in Feast: ``@on_demand_feature_view(sources=[...], schema=[...])`` over the function."""

    def wrap(udf: OnDemandFunction) -> OnDemandFeatureView:
        return OnDemandFeatureView(name or udf.__name__, sources, schema, udf, description, location=_location())

    return wrap


@dataclass(eq=False)
class FeatureViewProjection:
    """``view[["f1", "f2"]]``: a subset of a view's features, as used by services."""

    view: FeatureView
    features: list[str]


@dataclass(eq=False)
class FeatureService:
    """A named set of features a model consumes, in a fixed order."""

    name: str
    features: list[FeatureView | OnDemandFeatureView | FeatureViewProjection]
    description: str = ""
    owner: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    location: Location = field(default_factory=_location, repr=False)

    def feature_refs(self) -> list[str]:
        """``view:feature`` strings in service order (on-demand views' outputs included)."""
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


Definition = Entity | FeatureView | OnDemandFeatureView | FeatureService | PushSource
