"""Check definitions against each other and against their sources; report every problem at once."""

from __future__ import annotations

import re
from datetime import timedelta

import duckdb

from featurestore.aggregation.functions import FUNCTIONS
from featurestore.aggregation.where import OPERATORS as WHERE_OPERATORS
from featurestore.aggregation.where import typed_value
from featurestore.config import RepoConfig
from featurestore.definitions import (
    FeatureView,
    FeatureViewProjection,
    OnDemandFeatureView,
    RequestSource,
)
from featurestore.offline.base import HISTORY_COLUMNS, PARTITION_COLUMN
from featurestore.registry.loader import Definitions
from featurestore.sources import INGESTED_AT, view_output_schema
from featurestore.types import String, castable, from_arrow, is_timestamp_like

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # (whole names: fullmatch, as `$` lets a newline end one)
RESERVED = {*HISTORY_COLUMNS, PARTITION_COLUMN, INGESTED_AT}  # names the stores use themselves


def validate(defs: Definitions, config: RepoConfig) -> list[str]:
    problems: list[str] = []
    for kind, objects in defs.all().items():
        for name, obj in objects.items():
            if not _NAME.fullmatch(name):
                problems.append(
                    f"{kind.replace('_', ' ')} {name!r} ({obj.location}): names must be letters, digits and "
                    "underscores, not starting with a digit; rename it"
                )
    con = duckdb.connect()  # one for every view's source check
    for view in defs.feature_views.values():
        problems += _validate_view(view, config, defs, con)
    for odfv in defs.on_demand_feature_views.values():
        problems += _validate_on_demand(odfv, defs)
    for service in defs.feature_services.values():
        for item in service.features:
            member: object = item.view if isinstance(item, FeatureViewProjection) else item
            where = f"feature service {service.name!r} ({service.location})"
            if not isinstance(member, (FeatureView, OnDemandFeatureView)):
                problems.append(f"{where}: {item!r} is not a feature view; list views or view[[...]] projections")
                continue
            if (defs.feature_views.get(member.name) or defs.on_demand_feature_views.get(member.name)) is not member:
                problems.append(
                    f"{where}: feature view {member.name!r} is not defined in the repo's modules; add its module to featurestore.yaml"
                )
                continue
            if isinstance(item, FeatureViewProjection):
                for f in item.features:
                    if f not in member.feature_names:
                        problems.append(
                            f"{where}: feature {f!r} is not in view {member.name!r}; its features are {member.feature_names}"
                        )
    return problems


def _validate_on_demand(odfv: OnDemandFeatureView, defs: Definitions) -> list[str]:
    where = f"on-demand feature view {odfv.name!r} ({odfv.location})"
    problems = []
    if not callable(odfv.udf):
        problems.append(
            f"{where}: udf must be a function taking {{name: pyarrow.Array}} and returning {{output: values}}"
        )
    if not odfv.schema:
        problems.append(f"{where}: schema lists no outputs; declare each output Field")
    inputs: list[str] = []
    for source in odfv.sources:
        view = source.view if isinstance(source, FeatureViewProjection) else source
        if isinstance(source, RequestSource):
            inputs += [f.name for f in source.schema]
        elif not isinstance(view, FeatureView) or defs.feature_views.get(view.name) is not view:
            problems.append(
                f"{where}: source {getattr(view, 'name', view)!r} is not a feature view defined in the repo's modules "
                "(on-demand views read stored features and RequestSource fields)"
            )
        else:
            projected = (
                source.features if isinstance(source, FeatureViewProjection) else []
            )  # a whole view: all its features
            unknown = [f for f in projected if f not in view.feature_names]
            if unknown:
                problems.append(
                    f"{where}: {unknown} are not features of {view.name!r}; its features are {view.feature_names}"
                )
            inputs += [r.split(":")[1] for r in odfv.input_refs if r.startswith(view.name + ":")]
    twice = sorted({i for i in inputs if inputs.count(i) > 1})
    if twice:
        problems.append(
            f"{where}: input name(s) {twice} come from two sources; the function sees inputs by name, so rename one"
        )
    return problems


def _validate_view(
    view: FeatureView, config: RepoConfig, defs: Definitions, con: duckdb.DuckDBPyConnection
) -> list[str]:
    where = f"feature view {view.name!r} ({view.location})"
    problems: list[str] = []
    if view.ttl is not None and (not isinstance(view.ttl, timedelta) or view.ttl < timedelta(0)):
        problems.append(f"{where}: ttl must be a timedelta >= 0 (or None for no limit), got {view.ttl!r}")
    if not view.entities:
        problems.append(f"{where}: give it at least one entity")
    if not view.schema:
        problems.append(f"{where}: schema is empty; list its features as Field(name, dtype)")
    names = [f.name for f in view.schema]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}: feature {dup!r} appears twice in schema; remove one")
    for f in view.schema:
        if f.name in RESERVED or f.name in view.join_keys:
            problems.append(f"{where}: feature {f.name!r} uses a reserved or join-key name; rename it")
    if view.aggregations:
        problems += _validate_aggregations(view, where)
    elif view.dedup_window is not None:
        problems.append(f"{where}: dedup_window is for views with aggregations (their events); remove it")
    try:
        schema = view_output_schema(view, config.repo_path, config.push_logs, con)
    except Exception as exc:
        what = "its transformation" if view.transformation is not None else "its source"
        problems.append(
            f"{where}: reading {what} failed: {str(exc).strip().splitlines()[0]}; fix the source path or query"
        )
        return problems
    produced = "produced by the transformation" if view.transformation is not None else "in the source"
    key_types = defs.key_types.setdefault(view.name, {})
    for entity in view.entities:
        for key, declared in entity.key_types().items():
            if key in schema.names:
                key_types[key] = declared or from_arrow(schema.field(key).type) or String
            if key not in schema.names:
                problems.append(
                    f"{where}: join key {key!r} of entity {entity.name!r} is not {produced} "
                    f"(columns: {schema.names}); add it or fix the entity's join_keys"
                )
            elif declared is not None and not castable(schema.field(key).type, declared):
                problems.append(
                    f"{where}: join key {key!r} is {declared!r} on entity {entity.name!r} but "
                    f"{schema.field(key).type} {produced}; make the types agree"
                )
    ts = view.source.timestamp_field
    if ts not in schema.names:
        problems.append(
            f"{where}: timestamp field {ts!r} is not {produced} (columns: {schema.names}); set timestamp_field"
        )
    elif not is_timestamp_like(schema.field(ts).type):
        problems.append(
            f"{where}: timestamp field {ts!r} is {schema.field(ts).type}, not a timestamp; cast it in the source"
        )
    created = view.source.created_timestamp_field
    if created and created not in schema.names:
        problems.append(f"{where}: created_timestamp_field {created!r} is not {produced}; fix or remove it")
    for f in view.schema:
        if f.name not in schema.names:
            problems.append(
                f"{where}: feature {f.name!r} is not {produced} (columns: {schema.names}); add it or remove the Field"
            )
        elif not castable(schema.field(f.name).type, f.dtype):
            suggestion = from_arrow(schema.field(f.name).type)
            hint = f"declare it as {suggestion!r}" if suggestion else "cast it in a transformation"
            problems.append(
                f"{where}: feature {f.name!r} is declared {f.dtype!r} but is {schema.field(f.name).type} {produced}; {hint}"
            )
    return problems


_NUMERIC = {"Int32", "Int64", "Float32", "Float64", "Bool"}


def _validate_aggregations(view: FeatureView, where: str) -> list[str]:
    problems: list[str] = []
    stored = {f.name: f.dtype for f in view.schema}
    if view.ttl is not None:
        problems.append(f"{where}: an aggregated view takes no ttl (each window bounds its events); remove ttl")
    if view.event_id is not None and view.event_id not in stored:
        problems.append(
            f"{where}: event_id {view.event_id!r} is not in its schema {list(stored)}; add Field({view.event_id!r}, ...)"
        )
    names = [a.output_name for a in view.aggregations]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}: two aggregations are named {dup!r}; give one a name=")
    dedup, longest = view.dedup_window, view.longest_window
    if dedup is not None and (dedup <= timedelta(0) or dedup % timedelta(microseconds=1) or dedup > longest):
        problems.append(
            f"{where}: dedup_window must be a positive timedelta of whole microseconds up to the longest window "
            f"({longest}), got {dedup!r}"
        )
    for agg in view.aggregations:
        what = f"{where}: aggregation {agg.output_name!r}"
        if agg.function not in FUNCTIONS:
            problems.append(f"{what}: function {agg.function!r} is not one of {list(FUNCTIONS)}")
            continue
        if agg.window <= timedelta(0) or agg.window % timedelta(microseconds=1):  # (a timedelta: shapes.py)
            problems.append(f"{what}: window must be a positive timedelta of whole microseconds, got {agg.window!r}")
        function = FUNCTIONS[agg.function]
        if agg.column is None and function.needs_column:
            problems.append(f"{what}: {agg.function} needs a column=")
        elif agg.column is not None and agg.column not in stored:
            problems.append(
                f"{what}: column {agg.column!r} is not in the view's schema {list(stored)}; add it as a Field"
            )
        elif agg.column is not None and function.numeric and stored[agg.column].name not in _NUMERIC:
            problems.append(f"{what}: {agg.function} needs a numeric column; {agg.column!r} is {stored[agg.column]!r}")
        elif agg.column is not None and stored[agg.column].is_array:
            problems.append(f"{what}: column {agg.column!r} is an array; aggregate scalar columns")
        if function.takes_n and not (isinstance(agg.n, int) and agg.n >= 1):
            problems.append(f"{what}: {agg.function} needs n= (a whole number >= 1), got {agg.n!r}")
        if agg.where is not None:
            if not (isinstance(agg.where, (tuple, list)) and len(agg.where) == 3):
                problems.append(
                    f"{what}: where= takes (column, op, value), e.g. ('amount', '>', 100); got {agg.where!r}"
                )
            elif agg.where[0] not in stored:
                problems.append(f"{what}: where-column {agg.where[0]!r} is not in the view's schema {list(stored)}")
            elif agg.where[1] not in WHERE_OPERATORS:
                problems.append(f"{what}: where-operator {agg.where[1]!r} is not one of {list(WHERE_OPERATORS)}")
            elif agg.where[1] in ("in", "not in") and not isinstance(agg.where[2], (list, tuple, set, frozenset)):
                problems.append(f"{what}: '{agg.where[1]}' takes a list of values, got {agg.where[2]!r}")
            else:
                try:  # compared as a value of the column's type on both paths
                    typed_value(agg.where[1], agg.where[2], stored[agg.where[0]])
                except ValueError as exc:
                    problems.append(f"{what}: where-value {exc}; give a value of the column's type")
    return problems
