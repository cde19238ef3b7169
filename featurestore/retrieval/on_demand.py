"""Request-time (on-demand) features: one function, applied to looked-up and joined rows alike.

A request naming on-demand features is **expanded**: the stored features it names plus the
on-demand views' inputs are looked up (or joined) under full names (``view__feature``, so an
input never clashes with a requested column), then each on-demand view's function runs on
``{feature: array}`` plus the request fields, and the result is **finished** into the columns
asked for, in the order asked. Online and offline call the same ``compute`` on Arrow arrays
of the declared types, so they get the same values for the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from featurestore.definitions import FeatureService, OnDemandFeatureView
from featurestore.errors import NotFoundError, OnDemandError, RequestError
from featurestore.registry.loader import Definitions
from featurestore.types import DType, as_declared


def requested_refs(
    defs: Definitions, features: Sequence[str] | None, feature_service: str | FeatureService | None
) -> list[str] | None:
    """The refs a request names (None if malformed: the ordinary resolution reports it)."""
    if isinstance(features, FeatureService):
        features, feature_service = None, features
    if feature_service is not None and not features:
        return defs.service(
            feature_service if isinstance(feature_service, str) else feature_service.name
        ).feature_refs()
    if isinstance(features, (list, tuple)) and all(isinstance(f, str) for f in features):
        return list(features)
    return None


@dataclass
class OnDemandPlan:
    refs: list[str]  # as requested
    base_refs: list[str]  # stored features to look up or join, under full names
    on_demand: list[OnDemandFeatureView]  # in first-use order
    full_feature_names: bool
    input_types: dict[str, pa.DataType]  # full input name -> declared type (nulls stay typed)

    @classmethod
    def build(
        cls,
        defs: Definitions,
        features: Sequence[str] | None,
        feature_service: str | FeatureService | None,
        full_feature_names: bool,
    ) -> OnDemandPlan | None:
        """A plan when the request names on-demand features; None otherwise (nothing to do)."""
        if not defs.on_demand_feature_views:
            return None
        refs = requested_refs(defs, features, feature_service)
        if refs is None or not any(r.split(":")[0] in defs.on_demand_feature_views for r in refs if ":" in r):
            return None
        base: list[str] = []
        views: list[OnDemandFeatureView] = []
        for ref in refs:
            name, _, feature = ref.partition(":")
            odfv = defs.on_demand_feature_views.get(name)
            if odfv is None:
                base.append(ref)
                continue
            if feature not in odfv.feature_names:
                raise NotFoundError(
                    f"feature {feature!r} not found in on-demand view {name!r}; its features: {odfv.feature_names}"
                )
            if odfv not in views:
                views.append(odfv)
        for odfv in views:
            base += [r for r in odfv.input_refs if r not in base]
        if len(set(refs)) != len(refs):
            raise RequestError("a feature is requested twice; list each feature once")
        types = {r.replace(":", "__"): defs.feature_type(r).arrow for v in views for r in v.input_refs}
        return cls(refs, base, views, full_feature_names, types)

    @property
    def request_fields(self) -> list[str]:
        return list(dict.fromkeys(f.name for v in self.on_demand for f in v.request_fields))

    def output_names(self) -> list[str]:
        names = [r.replace(":", "__") if self.full_feature_names else r.split(":")[1] for r in self.refs]
        clash = sorted({n for n in names if names.count(n) > 1})
        if clash:
            raise RequestError(
                f"feature name(s) {clash} appear twice; pass full_feature_names=True to name columns 'view__feature'"
            )
        return names

    def compute(self, columns: Mapping[str, Any], n: int) -> dict[str, pa.Array]:
        """Every on-demand output as ``view__feature`` -> array, from ``columns`` (full-named inputs
        and request fields, as Arrow arrays or lists)."""
        out: dict[str, pa.Array] = {}
        for odfv in self.on_demand:
            inputs: dict[str, pa.Array] = {}
            for ref in odfv.input_refs:
                full = ref.replace(":", "__")
                inputs[ref.split(":")[1]] = _array(columns[full], self.input_types[full])
            for f in odfv.request_fields:
                if f.name not in columns:
                    raise RequestError(
                        f"on-demand view {odfv.name!r} needs the request field {f.name!r}; "
                        "send it with the entities (online) or as an entity_df column (offline)"
                    )
                inputs[f.name] = _declared("request field", f.name, columns[f.name], f.dtype)
            try:
                result = odfv.udf(inputs)
            except Exception as exc:  # the user's function: one clear line, on both paths
                raise OnDemandError(
                    f"on-demand view {odfv.name!r} ({odfv.location}) raised {type(exc).__name__}: {exc}; its function must give "
                    "every row a value or null (e.g. pc.if_else(pc.equal(b, 0), None, pc.divide(a, b)) for a division by zero)"
                ) from exc
            if not isinstance(result, Mapping):
                raise OnDemandError(
                    f"on-demand view {odfv.name!r} returned {type(result).__name__}; return {{output name: values}}"
                )
            for f in odfv.schema:
                if f.name not in result:
                    raise OnDemandError(
                        f"on-demand view {odfv.name!r} returned no {f.name!r}; its function must return every field of its schema"
                    )
                try:
                    values = _declared("output", f.name, result[f.name], f.dtype)
                except RequestError as exc:
                    raise OnDemandError(f"on-demand view {odfv.name!r}: {exc}") from exc
                if len(values) != n:
                    raise OnDemandError(
                        f"on-demand view {odfv.name!r} returned {len(values)} values of {f.name!r} for {n} rows"
                    )
                out[f"{odfv.name}__{f.name}"] = values
        return out


def _declared(what: str, name: str, values: Any, dtype: DType) -> pa.Array:
    """Values (an Arrow array, or a list from JSON or a function) as ``dtype`` by the rule pushes
    follow (``types.as_declared``), the same on both paths: Arrow would make 1.5 an Int64 1 from a
    list, while an array's cast refuses it."""
    try:
        array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        array = array if isinstance(array, pa.Array) else pa.array(list(array))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise RequestError(f"{what} {name!r} takes {dtype.name} values: {exc}") from exc
    converted = as_declared(name, array, dtype, what)
    return converted.combine_chunks() if isinstance(converted, pa.ChunkedArray) else converted


def _array(values: Any, arrow_type: pa.DataType | None) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values.cast(arrow_type) if arrow_type is not None and values.type != arrow_type else values
    return pa.array(list(values), type=arrow_type)


def finish_columns(
    plan: OnDemandPlan, get: Callable[[str], Any], computed: Mapping[str, pa.Array]
) -> list[tuple[str, Any]]:
    """(output name, column) for each requested ref, in request order: stored ones via ``get(full_name)``."""
    columns = []
    for ref, name in zip(plan.refs, plan.output_names()):
        full = ref.replace(":", "__")
        columns.append((name, computed[full] if full in computed else get(full)))
    return columns
