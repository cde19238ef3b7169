"""Resolve ``"view:feature"`` references or a feature service into per-view requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from featurestore.definitions import FeatureService, FeatureView
from featurestore.errors import NotFoundError, RequestError
from featurestore.registry.layout import ViewLayout
from featurestore.registry.loader import Definitions


@dataclass
class ViewRequest:
    view: FeatureView
    features: list[str]  # in request order
    output_names: list[str]  # column names in the result
    positions: list[int]  # where each feature stands in the whole request (results follow it)
    layout: ViewLayout  # the applied version's storage, where the features are read


def resolve(
    defs: Definitions,
    features: Sequence[str] | None,
    feature_service: str | FeatureService | None,
    full_feature_names: bool,
) -> list[ViewRequest]:
    """Group requested features by view, in first-appearance order; check names exist and don't clash.

    Each request records its features' positions in the whole request, so results come back
    in request order (``["v:a", "w:b", "v:c"]`` gives a, b, c) although views are read together."""
    if feature_service is not None and not features:
        features = None  # Feast's clients send `"features": []` with a service
    if isinstance(features, FeatureService):  # Feast's `features=service`
        features, feature_service = None, features
    if (features is None) == (feature_service is None):
        raise RequestError("pass exactly one of `features` (a list of 'view:feature') or `feature_service`")
    if feature_service is not None:
        service = defs.service(feature_service if isinstance(feature_service, str) else feature_service.name)
        refs = service.feature_refs()
    else:
        refs = list(features or [])
    if not refs:
        raise RequestError("no features requested; list at least one 'view:feature'")
    grouped: dict[str, ViewRequest] = {}
    for ref in refs:
        if not isinstance(ref, str) or ref.count(":") != 1:
            raise RequestError(f"feature reference {ref!r} must look like 'view:feature'")
        view_name, feature = ref.split(":")
        view = defs.feature_views.get(view_name)
        if view is None:
            raise NotFoundError(
                f"feature view {view_name!r} (in {ref!r}) not found; known views: {sorted(defs.feature_views)}"
            )
        if feature not in view.feature_names:
            raise NotFoundError(
                f"feature {feature!r} not found in view {view_name!r}; its features: {view.feature_names}"
            )
        request = grouped.setdefault(view_name, ViewRequest(view, [], [], [], defs.layout(view_name)))
        if feature in request.features:
            raise RequestError(f"feature {ref!r} is requested twice; list each feature once")
        request.features.append(feature)
        request.output_names.append(f"{view_name}__{feature}" if full_feature_names else feature)
        request.positions.append(sum(len(r.features) for r in grouped.values()) - 1)
    owners: dict[str, str] = {}
    for request in grouped.values():
        for name in request.output_names:
            if name in owners:
                raise RequestError(
                    f"feature name {name!r} is in both views {owners[name]!r} and {request.view.name!r}; "
                    "pass full_feature_names=True to name columns 'view__feature'"
                )
            owners[name] = request.view.name
    return list(grouped.values())
