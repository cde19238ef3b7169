"""Online lookups: entity rows → one pipelined Redis round trip → values with true statuses.

Split in three steps so the SDK (sync) and the servers (async) share everything but the I/O:
``OnlineQuery.prepare`` (validate, build keys), the store's ``read``/``read_async``, and
``OnlineQuery.assemble`` (decode, apply ttl, statuses). ``read_online``/``read_online_async``
run them, with a second round trip for heavy entities' tile summaries (an entity known heavy
skips its plain range read, and the first round trip when nothing else is read).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from itertools import repeat
from numbers import Integral, Real
from operator import is_
from typing import TYPE_CHECKING, Any

from featurestore.aggregation import tiles
from featurestore.aggregation.evaluate import WindowEvaluator
from featurestore.definitions import FeatureService
from featurestore.errors import RequestError
from featurestore.online.codec import (
    EPOCH,
    datetime_to_micros,
    entity_key,
    events_key,
    key_prefix,
    key_text,
    make_decoder,
    make_events_decoder,
    micros_to_datetime,
)
from featurestore.registry.loader import Definitions
from featurestore.retrieval.on_demand import OnDemandPlan, finish_columns
from featurestore.retrieval.refs import ViewRequest, resolve
from featurestore.timestamps import parse_timestamp

if TYPE_CHECKING:
    import pandas as pd

    from featurestore.online.base import OnlineReads

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


def _integer(v: Any) -> bool:
    return type(v) is int or (isinstance(v, Integral) and not isinstance(v, bool))  # numpy ints too


_BAD = object()  # a key value that does not convert to the declared type


def _to_int(v: Any) -> Any:
    """Integers, integral floats, and integers' canonical text (``"17"``, as Feast clients send; ``"017"``
    is ambiguous: refused). One outside the key's declared range names no entity: NOT_FOUND, as for
    any entity never written (JSON carries integers of any size, and its readers disagree near 2^63)."""
    if isinstance(v, str) and v.lstrip("-").isdigit() and str(int(v)) == v:
        v = int(v)
    elif isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if _integer(v) else _BAD


# Join-key values by declared type, coerced as Feast does where it is unambiguous: a String key
# takes an integer as its text, an integer key takes its canonical text. Anything else is an error.
_KEY_COERCIONS: dict[str, Callable[[Any], Any]] = {
    "Int32": _to_int,
    "Int64": _to_int,
    "String": lambda v: v if isinstance(v, str) else str(v) if _integer(v) else _BAD,
    "Bool": lambda v: v if isinstance(v, bool) else _BAD,
    "Bytes": lambda v: v if isinstance(v, (bytes, str)) else _BAD,
    "Float32": lambda v: v if isinstance(v, (int, float, Real)) and not isinstance(v, bool) else _BAD,
    "Float64": lambda v: v if isinstance(v, (int, float, Real)) and not isinstance(v, bool) else _BAD,
    "UnixTimestamp": lambda v: _timestamp_key(v),
}


def _timestamp_key(value: Any) -> Any:
    """A datetime, ISO 8601 text or an epoch number (REST sends no datetimes: ``featurestore.timestamps``)."""
    try:
        return parse_timestamp(value)
    except (ValueError, OverflowError):
        return _BAD


@dataclass
class _Group:
    """Views sharing one entity key: one HMGET per entity fetches all of them."""

    keyset: tuple[str, ...]
    fields: list[str]  # view names = hash fields
    key_of: Callable[[tuple], bytes]  # key values (in keyset order) -> Redis key


@dataclass
class _ViewPlan:
    request: ViewRequest
    group: int
    position: int  # index of this view's field in its group's HMGET
    decode: Callable[[bytes], tuple[int, list[Any]]]
    width: int  # number of features asked from this view
    ttl_us: int | None

    def __post_init__(self) -> None:  # shared per-row fillers (read-only: zip copies them into columns)
        self.blank, self.present = (None,) * self.width, (PRESENT,) * self.width
        self.not_found, self.outside = (NOT_FOUND,) * self.width, (OUTSIDE_MAX_AGE,) * self.width


@dataclass
class _WindowPlan:
    """An aggregated view: its events in the longest window, read per entity, aggregated here;
    or for a heavy entity, the tile summaries of that window and the events of its edges."""

    request: ViewRequest
    keyset: tuple[str, ...]
    key_of: Callable[[tuple], bytes]  # key values (in keyset order) -> events key
    decode: Callable[
        [list[bytes], int, int], tuple[list[int], dict[int, list[Any]]]
    ]  # (members, low, high) -> (times, columns)
    evaluator: WindowEvaluator
    tiled: tiles.TiledEvaluator | None  # None: some aggregation asked for is not tiled
    wanted: list[int]  # the aggregations asked for, as indexes into the tile spec's

    def heavy_from(self) -> int | None:
        """Events in the window from which an entity reads tile summaries (None: never)."""
        if self.tiled is None:
            return None
        return tiles.HEAVY_PER_TILE * -(-self.evaluator.longest_us // self.tiled.spec.tile_us)

    def tiles_arguments(self, now_us: int) -> list[bytes | int]:
        """``READ_WINDOW``'s arguments at ``now_us``: the window, and the tiles holding a cut."""
        assert self.tiled is not None
        spec = self.tiled.spec
        return [now_us - self.evaluator.longest_us, now_us, spec.tile_us, spec.tag, *self.cuts(now_us)]

    def cuts(self, now_us: int) -> list[int]:
        """The first µs of each window and the lookup time: the tiles holding them are read event by event."""
        return sorted({now_us - w + 1 for w in self.evaluator.windows_us} | {now_us})


@dataclass
class QueryTemplate:
    """Everything about a lookup that depends only on what is asked, not for whom: built once, cached."""

    key_names: list[str]
    key_checks: list[tuple[str, str, Callable[[Any], Any]]]
    groups: list[_Group]
    views: list[_ViewPlan]
    windows: list[_WindowPlan]
    names: list[str] = field(init=False)  # the response's columns, keys first
    order: list[int] | None = field(init=False)  # views' then windows' columns -> request order (None: already)

    def __post_init__(self) -> None:
        plans: list[_ViewPlan | _WindowPlan] = [*self.views, *self.windows]
        positions = [p for plan in plans for p in plan.request.positions]
        order = sorted(range(len(positions)), key=positions.__getitem__)
        self.order = None if order == list(range(len(positions))) else order
        names = [n for plan in plans for n in plan.request.output_names]
        self.names = self.key_names + (names if self.order is None else [names[i] for i in self.order])

    @classmethod
    def build(
        cls, defs: Definitions, project: str, features, feature_service, full_feature_names: bool
    ) -> QueryTemplate:
        requests = resolve(defs, features, feature_service, full_feature_names)
        needed: list[str] = []
        for req in requests:
            needed += [k for k in req.view.join_keys if k not in needed]
        checks = []
        for name in needed:
            dtype = defs.key_types[next(r.view.name for r in requests if name in r.view.join_keys)][name]
            checks.append((name, dtype.name, _KEY_COERCIONS.get(dtype.name, lambda v: v if v is not None else _BAD)))
        groups: dict[tuple[str, ...], _Group] = {}
        views: list[_ViewPlan] = []
        windows: list[_WindowPlan] = []
        for req in requests:
            keyset = tuple(sorted(req.view.join_keys))
            if req.view.is_aggregated:
                by_name = {a.output_name: a for a in req.view.aggregations}
                stored = [(f.name, f.dtype) for f in req.view.schema]
                entity_of = _key_builder(project, keyset, {k: t.name for k, t in defs.key_types[req.view.name].items()})
                events_of = partial(_events_key_of, entity_of, req.view.online_field)
                evaluator = WindowEvaluator(req.view, [by_name[f] for f in req.features])
                spec = tiles.TileSpec.of(req.view)
                tiled = (
                    tiles.TiledEvaluator(req.view, spec)
                    if spec is not None and spec.covers(evaluator.aggregations)
                    else None
                )
                wanted = (
                    [spec.aggregations.index(a) for a in evaluator.aggregations] if tiled is not None and spec else []
                )
                decoded = sorted(set(evaluator.needed) | set(tiled.needed if tiled is not None else []))
                windows.append(
                    _WindowPlan(req, keyset, events_of, make_events_decoder(stored, decoded), evaluator, tiled, wanted)
                )
                continue
            if keyset not in groups:
                groups[keyset] = _Group(
                    keyset,
                    [],
                    _key_builder(project, keyset, {k: t.name for k, t in defs.key_types[req.view.name].items()}),
                )
            group = groups[keyset]
            group.fields.append(req.view.online_field)
            wanted = [req.view.feature_names.index(f) for f in req.features]
            decode = make_decoder([(f.name, f.dtype) for f in req.view.schema], wanted)
            ttl = req.view.ttl // timedelta(microseconds=1) if req.view.ttl is not None else None
            views.append(_ViewPlan(req, list(groups).index(keyset), len(group.fields) - 1, decode, len(wanted), ttl))
        return cls(needed, checks, list(groups.values()), views, windows)


def _events_key_of(entity_of: Callable[[tuple], bytes], view: str, values: tuple) -> bytes:
    return events_key(entity_of(values), view)


def _key_builder(project: str, keyset: tuple[str, ...], types: dict[str, str]) -> Callable[[tuple], bytes]:
    if len(keyset) == 1:
        head, type_name = key_prefix(project) + b"{" + keyset[0].encode() + b"=", types[keyset[0]]
        return lambda values: head + key_text(values[0], type_name).encode() + b"}"
    return lambda values: entity_key(project, dict(zip(keyset, values)), types)


class _HeavyKeys:
    """Events keys of entities found heavy lately. Their next lookups read tile summaries at once,
    skipping the plain range read: up to the heavy threshold's events (~1,500), read only to be
    dropped, cost a heavy card ~1 ms of Redis and a round trip. A hint only saves time (summaries
    answer exactly for any entity), and it is bounded and expires, so an entity gone light
    returns to the plain read."""

    def __init__(self, size: int = 10_000, seconds: float = 60.0):
        self.size, self.seconds = size, seconds
        self._until: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            self._until.pop(key, None)
            return False
        return True

    def add(self, key: bytes) -> None:
        with self._lock:
            self._until[key] = time.monotonic() + self.seconds
            self._until.move_to_end(key)
            while len(self._until) > self.size:
                self._until.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)

    def clear(self) -> None:
        with self._lock:
            self._until.clear()


HEAVY_KEYS = _HeavyKeys()


@dataclass
class OnlineQuery:
    template: QueryTemplate
    key_columns: list[list[Any]]
    lookups: list[tuple[bytes, list[str]]]
    slots: list[list[int]]  # per group, per entity row: index into lookups
    ranges: list[tuple[bytes, int, int, int | None]]
    range_slots: list[list[int]]  # per window plan, per entity row: index into ranges
    range_plans: list[int]  # per range: index into the template's window plans
    now_us: int  # the lookup time: ttl and windows are evaluated at it
    on_demand: OnDemandPlan | None = None  # request-time features to compute after the read
    request_columns: dict[str, list[Any]] | None = None  # their request fields, from the entities
    seals: list[tuple[bytes, int, list[tuple[int, int, bytes]]]] = field(
        default_factory=list
    )  # tile summaries to store
    known_heavy: set[int] = field(default_factory=set)  # ranges read through tile summaries at once (``HEAVY_KEYS``)
    replayed: bool = False  # evaluated at a time the caller gave (``at``), not at the lookup's own

    @property
    def key_names(self) -> list[str]:
        return self.template.key_names

    @classmethod
    def prepare(
        cls,
        defs: Definitions,
        project: str,
        entities: Sequence[dict[str, Any]] | dict[str, Sequence[Any]],
        features: Sequence[str] | None,
        feature_service: str | FeatureService | None,
        full_feature_names: bool,
        max_entities: int = 10_000,
        cache: dict | None = None,
        now: datetime | None = None,
    ) -> OnlineQuery:
        signature = (
            tuple(features) if isinstance(features, (list, tuple)) else features,
            feature_service if isinstance(feature_service, str) or feature_service is None else feature_service.name,
            full_feature_names,
        )
        cache = cache if cache is not None else defs.query_cache
        template, on_demand = cache.get(signature, (None, None))
        if template is None:
            on_demand = OnDemandPlan.build(defs, features, feature_service, full_feature_names)
            if on_demand is not None:  # look up the stored features it needs, under full names
                features, feature_service, full_feature_names = on_demand.base_refs, None, True
            template = QueryTemplate.build(defs, project, features, feature_service, full_feature_names)
            cache[signature] = (template, on_demand)
        columns = _as_columns(entities)
        n = len(next(iter(columns.values()))) if columns else 0
        if n == 0:
            raise RequestError("no entities given; pass at least one entity row")
        if n > max_entities:
            raise RequestError(f"{n} entities in one request; the limit is {max_entities} (split the request)")
        missing = [k for k in template.key_names if k not in columns]
        if missing:
            raise RequestError(f"missing join key(s) {missing} for the requested features; got {sorted(columns)}")
        for name, type_name, coerce in template.key_checks:
            converted = [coerce(value) for value in columns[name]]
            bad = list(map(is_, converted, repeat(_BAD)))  # identity, in C: a value's own == may misbehave
            if any(bad):
                value = columns[name][bad.index(True)]
                raise RequestError(
                    f"join key {name!r} takes {type_name} values; got {value!r} ({type(value).__name__})"
                )
            columns[name] = converted
        lookups: list[tuple[bytes, list[str]]] = []
        slots = []
        for group in template.groups:
            index: dict[bytes, int] = {}
            rows = []
            for values in zip(*(columns[k] for k in group.keyset)):
                key = group.key_of(values)
                pos = index.get(key)
                if pos is None:  # repeated entities share one lookup
                    pos = index[key] = len(lookups)
                    lookups.append((key, group.fields))
                rows.append(pos)
            slots.append(rows)
        now_us = datetime_to_micros(now) if now is not None else time.time_ns() // 1000
        ranges: list[tuple[bytes, int, int, int | None]] = []
        range_slots, range_plans = [], []
        known_heavy: set[int] = set()
        for number, window in enumerate(template.windows):
            index = {}
            rows = []
            low, limit = now_us - window.evaluator.longest_us, window.heavy_from()
            for values in zip(*(columns[k] for k in window.keyset)):
                key = window.key_of(values)
                pos = index.get(key)
                if pos is None:
                    pos = index[key] = len(ranges)
                    ranges.append((key, low, now_us, limit))
                    range_plans.append(number)
                    if limit is not None and key in HEAVY_KEYS:
                        known_heavy.add(pos)
                rows.append(pos)
            range_slots.append(rows)
        request_columns = {f: columns[f] for f in on_demand.request_fields if f in columns} if on_demand else None
        return cls(
            template,
            [columns[k] for k in template.key_names],
            lookups,
            slots,
            ranges,
            range_slots,
            range_plans,
            now_us,
            on_demand,
            request_columns,
            known_heavy=known_heavy,
            replayed=now is not None,
        )

    def view_versions(self) -> list[dict[str, Any]]:
        """The feature views the query reads, each once, with the history version read (Feast's
        ``feature_view_metadata``; our versions count from 1, as ``plan`` names them)."""
        views = {
            plan.request.view.name: plan.request.view.history_version
            for plan in [*self.template.views, *self.template.windows]
        }
        return [{"name": name, "version": version} for name, version in views.items()]

    def first_reads(self) -> list[tuple[bytes, int, int, int | None]]:
        """The ranges the first round trip reads plainly: all but those known heavy."""
        if not self.known_heavy:
            return self.ranges
        return [r for pos, r in enumerate(self.ranges) if pos not in self.known_heavy]

    def placed(self, replies: list) -> list:
        """The first round trip's replies (lookups, then ``first_reads``) laid out as ``assemble``
        takes them, known-heavy ranges left ``None`` for their summaries."""
        if not self.known_heavy:
            return replies
        n = len(self.lookups)
        raw: list = replies[:n] + [None] * len(self.ranges)
        plain = iter(replies[n:])
        for pos in range(len(self.ranges)):
            if pos not in self.known_heavy:
                raw[n + pos] = next(plain)
        return raw

    def heavy(self, raw: list) -> list[tuple[int, tuple[bytes, list[bytes | int]]]]:
        """The ranges known heavy, and those whose plain read stopped at its limit (noted in
        ``HEAVY_KEYS``), with what ``read_tiles`` needs to read their tile summaries instead:
        ``(range index, (key, arguments))``."""
        out = []
        for pos, (key, _, _, limit) in enumerate(self.ranges):
            if pos in self.known_heavy or (limit is not None and len(raw[len(self.lookups) + pos]) >= limit):
                if pos not in self.known_heavy:
                    HEAVY_KEYS.add(key)
                out.append((pos, (key, self.template.windows[self.range_plans[pos]].tiles_arguments(self.now_us))))
        return out

    def assemble(self, raw: list) -> OnlineResponse:
        """Decode what ``read(self.lookups, self.ranges)`` returned into the response."""
        now_us, template = self.now_us, self.template
        n = len(self.key_columns[0])
        values: list[list[Any]] = []
        statuses: list[list[str]] = []
        times: list[list[datetime | None]] = []
        for plan in template.views:
            v, st, t = self._view_columns(plan, raw, now_us)
            values += v
            statuses += st
            times += t
        if template.windows:
            events = raw[len(self.lookups) :]  # per range: its events, or [summaries, events]
            for window, slots in zip(template.windows, self.range_slots):
                v, st, t = self._window_columns(window, slots, events, now_us)
                values += v
                statuses += st
                times += t
        order = template.order
        if order is not None:
            values, statuses, times = (
                [values[i] for i in order],
                [statuses[i] for i in order],
                [times[i] for i in order],
            )
        keys = len(self.key_columns)
        no_times: list[list[datetime | None]] = list(
            map(list, repeat([None] * n, keys))
        )  # join keys have no event time
        response = OnlineResponse(
            list(template.names),
            list(map(list, self.key_columns)) + values,
            list(map(list, repeat([PRESENT] * n, keys))) + statuses,
            no_times + times,
        )
        return self._with_on_demand(response) if self.on_demand is not None else response

    def _with_on_demand(self, base: OnlineResponse) -> OnlineResponse:
        """The requested columns: stored ones from ``base``, request-time ones computed from it."""
        plan, keys = self.on_demand, len(self.key_names)
        assert plan is not None
        n = len(self.key_columns[0])
        by_name = {name: i for i, name in enumerate(base.feature_names)}
        computed = plan.compute(
            {**(self.request_columns or {}), **{name: base.values[i] for name, i in by_name.items()}}, n
        )
        response = OnlineResponse(
            base.feature_names[:keys], base.values[:keys], base.statuses[:keys], base.event_timestamps[:keys]
        )
        for name, column in finish_columns(plan, lambda full: by_name[full], computed):
            if isinstance(column, int):  # a stored feature: its values, statuses and times as read
                response.feature_names.append(name)
                response.values.append(base.values[column])
                response.statuses.append(base.statuses[column])
                response.event_timestamps.append(base.event_timestamps[column])
            else:
                values = column.to_pylist()
                response.feature_names.append(name)
                response.values.append(values)
                response.statuses.append([PRESENT if v is not None else NULL_VALUE for v in values])
                response.event_timestamps.append([None] * n)
        return response

    def _window_columns(self, plan: _WindowPlan, slots: list[int], events: list, now_us: int):
        decode, evaluate = plan.decode, plan.evaluator.evaluate
        results: dict[int, tuple[list[Any], list[str], datetime | None]] = {}
        row_values, row_statuses, row_times = [], [], []
        low = now_us - plan.evaluator.longest_us
        for pos in slots:
            result = results.get(pos)
            if result is None:
                reply = events[pos]
                if reply and isinstance(reply[0], list):  # a heavy entity: [summaries, events]
                    result = results[pos] = self._tiled(plan, self.ranges[pos][0], reply, low, now_us)
                else:
                    limit = self.ranges[pos][3]
                    if limit is not None and len(reply) >= limit:  # (a partial read: never evaluate it)
                        raise RuntimeError(
                            "a heavy entity's window reads tile summaries: answer queries with read_online"
                        )
                    times, columns = decode(reply, low, now_us)
                    vals, stats = evaluate(times, columns, now_us)
                    result = results[pos] = (vals, stats, micros_to_datetime(times[-1]) if times else None)
            row_values.append(result[0])
            row_statuses.append(result[1])
            row_times.append(result[2])
        width = len(plan.evaluator.aggregations)
        return (
            list(map(list, zip(*row_values))),
            list(map(list, zip(*row_statuses))),
            list(map(list, repeat(row_times, width))),
        )

    def _tiled(self, plan: _WindowPlan, key: bytes, reply: list, low: int, now_us: int):
        """One heavy entity's aggregates from its tile summaries and edge events; the tiles it read
        whole are summarized for the next lookups (``seals``)."""
        tiled = plan.tiled
        assert tiled is not None
        flat, runs = reply
        members = list(itertools.chain.from_iterable(runs))
        summaries = {int(flat[i]): tiled.decode(flat[i + 1]) for i in range(0, len(flat), 2)}
        times, columns = plan.decode(members, low, now_us)
        vals, stats = tiles.evaluate_tiled(
            tiled,
            plan.wanted,
            plan.evaluator.windows_us,
            {t: s[1] for t, s in summaries.items()},
            times,
            columns,
            now_us,
        )
        newest = max(([times[-1]] if times else []) + [s[0] for s in summaries.values()], default=None)
        size = tiled.spec.tile_us
        cut = {c // size for c in plan.cuts(now_us)}
        sealed = tiles.seals(tiled, times, columns, cut, time.time_ns() // 1000)
        if sealed:
            self.seals.append((key, size, sealed))
        return vals, stats, micros_to_datetime(newest) if newest is not None else None

    def _view_columns(self, plan: _ViewPlan, raw: list, now_us: int):
        width, decode, ttl_us, position = plan.width, plan.decode, plan.ttl_us, plan.position
        cutoff = now_us - ttl_us if ttl_us is not None else None
        blank, not_found, outside, present = plan.blank, plan.not_found, plan.outside, plan.present
        row_values, row_statuses, row_times = [], [], []
        for pos in self.slots[plan.group]:
            blob = raw[pos][position]
            if blob is None:
                row_values.append(blank)
                row_statuses.append(not_found)
                row_times.append(None)
                continue
            event_us, decoded = decode(blob)
            row_times.append(micros_to_datetime(event_us))
            if cutoff is not None and event_us < cutoff:
                row_values.append(blank)
                row_statuses.append(outside)
            else:
                row_values.append(decoded)
                row_statuses.append(
                    present if None not in decoded else [NULL_VALUE if v is None else PRESENT for v in decoded]
                )
        # rows -> columns in C (zip, map), not value by value in Python
        return (
            list(map(list, zip(*row_values))),
            list(map(list, zip(*row_statuses))),
            list(map(list, repeat(row_times, width))),
        )


def _as_columns(entities: Sequence[dict[str, Any]] | dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
    if isinstance(entities, dict):
        if not all(isinstance(v, (list, tuple)) for v in entities.values()):
            bad = [k for k, v in entities.items() if not isinstance(v, (list, tuple))]
            raise RequestError(f"entities must map each join key to a list of values; {bad} are not lists")
        columns = dict(zip(entities, map(list, entities.values())))
        lengths = set(map(len, columns.values()))
        if len(lengths) > 1:
            raise RequestError(
                f"entity columns have different lengths {sorted(lengths)}; give one value per row in each"
            )
        return columns
    if not isinstance(entities, (list, tuple)) or not all(isinstance(r, dict) for r in entities):
        raise RequestError("entity_rows must be a list of {join_key: value} dicts")
    keys = list(entities[0]) if entities else []
    for r in entities:
        if list(r) != keys and set(r) != set(keys):
            raise RequestError(f"every entity row needs the same keys; {sorted(r)} differs from {sorted(keys)}")
    return {k: [r[k] for r in entities] for k in keys}


def read_online(store: OnlineReads, query: OnlineQuery) -> OnlineResponse:
    """``query`` answered from ``store``: one round trip, a second for heavy entities' tile summaries."""
    first = query.first_reads()
    raw = query.placed(store.read(query.lookups, first) if query.lookups or first else [])
    heavy = query.heavy(raw)
    if heavy:
        for (pos, _), reply in zip(heavy, store.read_tiles([r for _, r in heavy])):
            raw[len(query.lookups) + pos] = reply
    return query.assemble(raw)


# Events a response may decode and aggregate on the event loop; past it (a cold heavy card: 50,000
# events, ~25 ms) assembling runs on a thread, and the loop answers other requests meanwhile.
OFF_LOOP_EVENTS = 2_000


async def read_online_async(store: OnlineReads, query: OnlineQuery) -> OnlineResponse:
    """``read_online`` on the event loop."""
    first = query.first_reads()
    raw = query.placed(await store.read_async(query.lookups, first) if query.lookups or first else [])
    heavy = query.heavy(raw)
    if heavy:
        for (pos, _), reply in zip(heavy, await store.read_tiles_async([r for _, r in heavy])):
            raw[len(query.lookups) + pos] = reply
    if query.ranges and _events_in(raw[len(query.lookups) :]) > OFF_LOOP_EVENTS:
        return await asyncio.to_thread(query.assemble, raw)
    return query.assemble(raw)


def _events_in(replies: list) -> int:
    """Events in range replies: a plain one is its events, a heavy one ``[summaries, runs of events]``."""
    return sum(sum(map(len, r[1])) if r and isinstance(r[0], list) else len(r) for r in replies)
