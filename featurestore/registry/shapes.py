"""Whether definition objects hold what their fields take (a name is a string, entities are
``Entity`` objects, a schema lists ``Field``s), checked before anything reads them: a mistake is
one line naming the object, its location and the fix, never a traceback from deep inside."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from featurestore.definitions import (
    Aggregation,
    Entity,
    FeatureService,
    FeatureView,
    FeatureViewProjection,
    Field,
    FileSource,
    OnDemandFeatureView,
    PushSource,
    RequestSource,
    SqlSource,
)
from featurestore.types import DType


def _what(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _name_of(obj: Any) -> str:
    name = getattr(obj, "name", None)
    return repr(name) if isinstance(name, str) else "(unnamed)"


def _field_problems(fields: Any, where: str, what: str = "schema") -> list[str]:
    if not isinstance(fields, (list, tuple)):
        return [f"{where}: {what} must be a list of Field(name, dtype), got {_what(fields)}"]
    problems = []
    for item in fields:
        if not isinstance(item, Field):
            problems.append(
                f"{where}: {what} lists {_what(item)}; write Field(name, dtype), e.g. Field('amount', Float64)"
            )
        elif not isinstance(item.name, str):
            problems.append(f"{where}: a Field's name must be a string, got {_what(item.name)}")
        elif not isinstance(item.dtype, DType):
            problems.append(
                f"{where}: Field {item.name!r} has type {_what(item.dtype)}; use one of featurestore.types (Int64, Float64, ...)"
            )
    return problems


def _entity_problems(entity: Entity, where: str) -> list[str]:
    problems = []
    if (
        not isinstance(entity.join_keys, (list, tuple))
        or not entity.join_keys
        or not all(isinstance(k, str) for k in entity.join_keys)
    ):
        problems.append(f"{where}: join_keys must be a list of column names, got {_what(entity.join_keys)}")
    types = entity.value_type.values() if isinstance(entity.value_type, dict) else [entity.value_type]
    if not all(t is None or isinstance(t, DType) for t in types):
        problems.append(
            f"{where}: value_type must be a type of featurestore.types (or {{join key: type}}), got {_what(entity.value_type)}"
        )
    return problems


def _source_problems(source: Any, where: str) -> list[str]:
    if not isinstance(source, (FileSource, SqlSource, PushSource)):
        return [f"{where}: source must be a FileSource, SqlSource, PushSource or StreamSource, got {_what(source)}"]
    problems = []
    for attribute in (
        "timestamp_field",
        *(["path"] if isinstance(source, FileSource) else []),
        *(["query"] if isinstance(source, SqlSource) else []),
    ):
        if not isinstance(getattr(source, attribute), str) or not getattr(source, attribute):
            problems.append(
                f"{where}: the source's {attribute} must be a non-empty string, got {_what(getattr(source, attribute))}"
            )
    if isinstance(source, PushSource):
        problems += _field_problems(source.schema, where, "the push source's schema")
    return problems


def _view_problems(view: FeatureView, where: str) -> list[str]:
    problems = []
    if not isinstance(view.entities, (list, tuple)):
        problems.append(f"{where}: entities must be a list of Entity objects, got {_what(view.entities)}")
    else:
        for entity in view.entities:
            if not isinstance(entity, Entity):
                problems.append(
                    f"{where}: entities lists {_what(entity)}; pass the Entity object itself "
                    f"(e.g. user = Entity(name='user', join_keys=['user_id']), then entities=[user])"
                )
            else:
                problems += shape_problems(entity)
    problems += _source_problems(view.source, where)
    problems += _field_problems(view.schema, where)
    if view.ttl is not None and not isinstance(view.ttl, timedelta):
        problems.append(f"{where}: ttl must be a timedelta (or None), got {_what(view.ttl)}")
    if not isinstance(view.aggregations, (list, tuple)) or not all(
        isinstance(a, Aggregation) for a in view.aggregations
    ):
        problems.append(f"{where}: aggregations must be a list of Aggregation(...), got {_what(view.aggregations)}")
    else:  # (a window names its output: ``count_1h``)
        problems += [
            f"{where}: aggregation {a.function!r}: window must be a timedelta, got {_what(a.window)}"
            for a in view.aggregations
            if not isinstance(a.window, timedelta)
        ]
    if view.event_id is not None and not isinstance(view.event_id, str):
        problems.append(f"{where}: event_id must be a column name, got {_what(view.event_id)}")
    if view.dedup_window is not None and not isinstance(view.dedup_window, timedelta):
        problems.append(f"{where}: dedup_window must be a timedelta (or None), got {_what(view.dedup_window)}")
    return problems


def _on_demand_problems(odfv: OnDemandFeatureView, where: str) -> list[str]:
    problems = _field_problems(odfv.schema, where)
    if not isinstance(odfv.sources, (list, tuple)):
        return [
            *problems,
            f"{where}: sources must be a list of feature views, view[[...]] projections and RequestSources",
        ]
    for source in odfv.sources:
        if isinstance(source, RequestSource):
            problems += _field_problems(source.schema, where, f"request source {source.name!r}'s schema")
        elif not isinstance(source, (FeatureView, FeatureViewProjection)):
            problems.append(
                f"{where}: sources lists {_what(source)}; list feature views, view[[...]] projections and RequestSources"
            )
    return problems


_CHECKS: dict[type, tuple[str, Callable[[Any, str], list[str]]]] = {
    Entity: ("entity", _entity_problems),
    FeatureView: ("feature view", _view_problems),
    OnDemandFeatureView: ("on-demand feature view", _on_demand_problems),
    PushSource: ("push source", lambda source, where: _source_problems(source, where)),
    FeatureService: (
        "feature service",
        lambda service, where: (
            []
            if isinstance(service.features, (list, tuple))
            else [
                f"{where}: features must be a list of views and view[[...]] projections, got {_what(service.features)}"
            ]
        ),
    ),
}


def shape_problems(obj: Any) -> list[str]:
    """Problems with what ``obj`` (a definition) holds; empty when every field has its type."""
    for cls, (kind, check) in _CHECKS.items():
        if isinstance(obj, cls):
            where = f"{kind} {_name_of(obj)} ({getattr(obj, 'location', '?')})"
            name = getattr(obj, "name", None)
            if not isinstance(name, str) or not name:
                return [f"{where}: name must be a non-empty string, got {_what(getattr(obj, 'name', None))}"]
            return check(obj, where)
    return []
