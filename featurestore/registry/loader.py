"""Import a repo's definition modules (only those listed in featurestore.yaml) and collect objects."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

from featurestore.config import RepoConfig
from featurestore.definitions import (
    Entity,
    FeatureService,
    FeatureView,
    FeatureViewProjection,
    OnDemandFeatureView,
    PushSource,
    content_hash,
)
from featurestore.errors import NotFoundError
from featurestore.registry.layout import ViewLayout, layout_of
from featurestore.registry.shapes import shape_problems
from featurestore.types import DType


class LRUCache(OrderedDict):
    """A dict that keeps its ``capacity`` most recently used entries."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def get(self, key, default=None):
        try:
            value = self[key]
        except KeyError:
            return default
        self.move_to_end(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)


@dataclass
class Definitions:
    """Every object a repo defines, by kind and name."""

    entities: dict[str, Entity] = field(default_factory=dict)
    feature_views: dict[str, FeatureView] = field(default_factory=dict)
    on_demand_feature_views: dict[str, OnDemandFeatureView] = field(default_factory=dict)
    feature_services: dict[str, FeatureService] = field(default_factory=dict)
    push_sources: dict[str, PushSource] = field(default_factory=dict)
    # join-key types per view: declared on the entity, else read from the source at validation
    key_types: dict[str, dict[str, DType]] = field(default_factory=dict)
    # the history version the registry applied per view (1 if absent): see ``layout``
    versions: dict[str, int] = field(default_factory=dict)
    # compiled online lookups by request signature (definitions and versions are fixed once
    # loaded: ``with_versions`` makes new Definitions with an empty cache); bounded: a client
    # cycling through distinct feature lists cannot grow it without limit
    query_cache: LRUCache = field(default_factory=lambda: LRUCache(1024), repr=False)
    _layouts: dict[str, ViewLayout] = field(default_factory=dict, repr=False)

    def with_versions(self, versions: dict[str, int]) -> Definitions:
        """The same objects under the registry's applied versions (nothing is set on the objects)."""
        return replace(self, versions=dict(versions), query_cache=LRUCache(self.query_cache.capacity), _layouts={})

    def layout(self, view: FeatureView | str) -> ViewLayout:
        """Where the applied version of a view keeps its rows, offline and online."""
        name = view if isinstance(view, str) else view.name
        found = self._layouts.get(name)
        if found is None:
            found = self._layouts[name] = layout_of(self.view(name), self.versions.get(name, 1))
        return found

    def all(self) -> dict[str, dict]:
        return {
            "entity": self.entities,
            "feature_view": self.feature_views,
            "on_demand_feature_view": self.on_demand_feature_views,
            "feature_service": self.feature_services,
            "push_source": self.push_sources,
        }

    def specs(self) -> dict[str, dict[str, dict]]:
        """``{kind: {name: {"hash": ..., "spec": ...}}}``, the registry's persisted form."""
        out: dict[str, dict[str, dict]] = {}
        for kind, objects in self.all().items():
            out[kind] = {}
            for name, obj in objects.items():
                spec = obj.to_spec()
                out[kind][name] = {"hash": content_hash(spec), "spec": spec}
        return out

    def history_schema(self, view: FeatureView):
        """Arrow schema of the view's history table."""
        from featurestore.offline.base import history_schema

        keys = {k: t.arrow for k, t in self.key_types[view.name].items()}
        return history_schema(keys, [(f.name, f.dtype.arrow) for f in view.schema])

    def feature_type(self, ref: str):
        """The declared type of ``view:feature`` (a stored, aggregated or on-demand feature)."""
        view_name, feature = ref.split(":", 1)
        view = self.on_demand_feature_views.get(view_name) or self.view(view_name)
        return view.field(feature).dtype

    def spec_of(self, name: str) -> dict:
        """A feature view's or on-demand view's spec."""
        obj = self.feature_views.get(name) or self.on_demand_feature_views.get(name)
        if obj is None:
            raise NotFoundError(f"no feature view named {name!r}")
        return obj.to_spec()

    def view(self, name: str) -> FeatureView:
        try:
            return self.feature_views[name]
        except KeyError:
            raise NotFoundError(f"feature view {name!r} not found; known views: {sorted(self.feature_views)}") from None

    def service(self, name: str) -> FeatureService:
        try:
            return self.feature_services[name]
        except KeyError:
            raise NotFoundError(
                f"feature service {name!r} not found; known services: {sorted(self.feature_services)}"
            ) from None

    def push_source(self, name: str) -> PushSource:
        try:
            return self.push_sources[name]
        except KeyError:
            raise NotFoundError(f"push source {name!r} not found; known: {sorted(self.push_sources)}") from None


def load_definitions(config: RepoConfig) -> tuple[Definitions, list[str]]:
    """Import the configured modules; return the objects and problems found while collecting."""
    defs = Definitions()
    problems: list[str] = []
    seen: dict[tuple[str, str], object] = {}
    package = "featurestore_repo_" + hashlib.sha1(str(config.repo_path).encode()).hexdigest()[:8]
    sys.path.insert(0, str(config.repo_path))
    try:
        for module_file in config.modules:
            path = config.repo_path / module_file
            if not path.exists():
                problems.append(
                    f"module {module_file!r} listed in featurestore.yaml does not exist in {config.repo_path}"
                )
                continue
            try:
                module = _import(path, f"{package}.{path.stem}")
            except Exception as exc:
                problems.append(f"importing {module_file} failed: {_where_it_failed(exc, config.repo_path, path)}")
                continue
            for value in list(vars(module).values()):
                if isinstance(value, tuple(_KINDS)):
                    misshapen = shape_problems(value)
                    if misshapen:
                        problems += misshapen
                        continue
                for obj in _with_dependencies(value):
                    _collect(obj, defs, seen, problems)
    finally:
        sys.path.remove(str(config.repo_path))
    return defs, problems


def _where_it_failed(exc: BaseException, repo: Path, module: Path) -> str:
    """``file:line: Error: message`` at the innermost line of the repo's own code (one line, no traceback)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}"
    file, line = str(module), 0
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if name.startswith(str(repo)) and not name.startswith(str(repo / ".venv")):
            file, line = name, lineno
    return f"{file}:{line}: {type(exc).__name__}: {exc}"


def _import(path: Path, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _with_dependencies(value: object) -> list[object]:
    """The object plus the entities and push sources it refers to (they need not be top level)."""
    if isinstance(value, FeatureView):
        extra = [value.source] if isinstance(value.source, PushSource) else []
        return [value, *value.entities, *extra]
    if isinstance(value, OnDemandFeatureView):
        views = [s.view if isinstance(s, FeatureViewProjection) else s for s in value.sources]
        return [value, *(d for v in views if isinstance(v, FeatureView) for d in _with_dependencies(v))]
    if isinstance(value, (Entity, FeatureService, PushSource)):
        return [value]
    return []


_KINDS = {
    Entity: "entity",
    FeatureView: "feature_view",
    OnDemandFeatureView: "on_demand_feature_view",
    FeatureService: "feature_service",
    PushSource: "push_source",
}


def _collect(obj: object, defs: Definitions, seen: dict, problems: list[str]) -> None:
    kind = next(k for cls, k in _KINDS.items() if isinstance(obj, cls))
    key = (kind, obj.name)  # type: ignore[attr-defined]
    previous = seen.get(key)
    if previous is obj:
        return
    if previous is not None:
        problems.append(
            f"{kind.replace('_', ' ')} {obj.name!r} is defined twice: at {previous.location} "  # type: ignore
            f"and at {obj.location}; give each a unique name"  # type: ignore[attr-defined]
        )
        return
    seen[key] = obj
    defs.all()[kind][obj.name] = obj  # type: ignore[attr-defined]
