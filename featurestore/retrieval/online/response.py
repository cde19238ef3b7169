"""The answer to an online lookup, column-major, in Feast's shapes (``to_dict``, REST, DataFrame)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from itertools import repeat
from typing import TYPE_CHECKING, Any

from featurestore.online.codec import EPOCH

if TYPE_CHECKING:
    import pandas as pd

PRESENT, NOT_FOUND, NULL_VALUE, OUTSIDE_MAX_AGE = "PRESENT", "NOT_FOUND", "NULL_VALUE", "OUTSIDE_MAX_AGE"


@dataclass
class OnlineResponse:
    """Column-major lookup result: join keys first, then features in request order."""

    feature_names: list[str]
    values: list[list[Any]]
    statuses: list[list[str]]
    event_timestamps: list[list[datetime | None]]
    # Feast's ``include_feature_view_version_metadata``: [{"name": view, "version": history version}]
    feature_view_metadata: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, list[Any]]:
        """``{name: values}``, join keys first, as Feast's ``OnlineResponse.to_dict()``."""
        return dict(zip(self.feature_names, self.values))

    def to_rest(self, replace_non_finite: bool = True) -> dict[str, Any]:
        """Feast's REST response shape: ``metadata.feature_names`` and per-column ``results``.

        Event timestamps stay ``datetime`` (UTC); the servers render them as ISO 8601 with ``Z``,
        and, as Feast does, the epoch (1970) where there is no event time (keys, missing values).
        NaN and infinities become ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (protobuf's JSON
        mapping, as Feast's server writes them): JSON has no such numbers, and ``null`` means missing."""
        results = []
        for v, s, ts in zip(self.values, self.statuses, self.event_timestamps):
            results.append(
                {
                    "values": json_numbers(v) if replace_non_finite else v,
                    "statuses": s,
                    "event_timestamps": [t or EPOCH for t in ts] if None in ts else ts,
                }
            )
        metadata: dict[str, Any] = {"feature_names": self.feature_names}
        if self.feature_view_metadata is not None:
            metadata["feature_view_metadata"] = self.feature_view_metadata
        return {"metadata": metadata, "results": results}

    def to_rest_json(self, dumps: Callable[[Any], bytes]) -> bytes:
        """``dumps(self.to_rest())``, without looking at every value in Python: ``dumps`` (orjson)
        writes a non-finite float as ``null``, so the response is written once and, only when it
        holds more ``null`` than the values have Nones (a NaN, or a name or string containing
        "null"), written again with the replacements."""
        payload = dumps(self.to_rest(replace_non_finite=False))
        if payload.count(b"null") != sum(map(list.count, self.values, repeat(None))):
            payload = dumps(self.to_rest())
        return payload

    def to_df(self, include_statuses: bool = False) -> pd.DataFrame:
        import pandas as pd

        data: dict[str, list] = dict(zip(self.feature_names, self.values))
        if include_statuses:
            data.update({f"{n}__status": s for n, s in zip(self.feature_names, self.statuses)})
        return pd.DataFrame(data)


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def json_number(v: Any) -> Any:
    """A float JSON can carry: non-finite floats as protobuf's JSON strings (see ``to_rest``)."""
    if isinstance(v, float) and not math.isfinite(v):
        return _NON_FINITE[repr(v)]
    if isinstance(v, list):
        return [json_number(x) for x in v]
    return v


def json_numbers(values: list[Any]) -> list[Any]:
    """``values`` with non-finite floats replaced; the list itself when it has none (the usual case)."""
    for v in values:
        if (isinstance(v, float) and not math.isfinite(v)) or isinstance(v, list):
            return [json_number(x) for x in values]
    return values
