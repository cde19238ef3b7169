"""The plan of an online lookup: what to read for whom, compiled once per request shape.

``QueryTemplate`` holds what depends only on what is asked (views, fields, decoders, evaluators;
cached per definitions), ``OnlineQuery.prepare`` what depends on the entities: join keys checked
and coerced as Feast's clients send them, Redis keys built, repeated entities read once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from itertools import repeat
from numbers import Integral, Real
from operator import is_
from typing import Any

from featurestore.aggregation import dedup_us, tiles
from featurestore.aggregation.evaluate import WindowEvaluator
from featurestore.definitions import FeatureService
from featurestore.errors import NotRetainedError, RequestError
from featurestore.online import packed
from featurestore.online.base import HORIZONS, LACKED_FROM, Range
from featurestore.online.codec import (
    datetime_to_micros,
    entity_key,
    event_columns,
    events_key,
    key_prefix,
    key_text,
    make_decoder,
    make_events_decoder,
    micros_to_datetime,
)
from featurestore.registry.loader import Definitions
from featurestore.retrieval.on_demand import OnDemandPlan
from featurestore.retrieval.online.response import NOT_FOUND, OUTSIDE_MAX_AGE, PRESENT
from featurestore.retrieval.refs import ViewRequest, resolve
from featurestore.timestamps import parse_timestamp
from featurestore.types import DType


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
    stored: list[tuple[str, DType]]  # the view's stored columns: what events (and blocks) hold
    tile_us: int

    def events(
        self, members: list[bytes], low: int, high: int, skip_tiles: Collection[int] = ()
    ) -> tuple[list[int], dict[int, list[Any]]]:
        """The events of ``members`` (blocks unpacked: ``online.packed``) in ``(low, high]``, decoded."""
        return self.decode(packed.expand(members, self.stored, (low, high), self.tile_us, skip_tiles), low, high)

    def heavy_from(self) -> int | None:
        """Events in the window from which an entity reads tile summaries (None: never)."""
        if self.tiled is None:
            return None
        return tiles.HEAVY_PER_TILE * -(-self.evaluator.longest_us // self.tiled.spec.tile_us)

    def tiles_arguments(self, now_us: int) -> list[bytes | int]:
        """``read_window.lua``'s arguments at ``now_us``: the window and the tiles holding a cut."""
        assert self.tiled is not None
        spec = self.tiled.spec
        low = now_us - self.evaluator.longest_us
        return [low, now_us, spec.tile_us, spec.tag, *self.cuts(now_us)]

    def held_tiled(self, stored: dict[bytes, bytes] | list[bytes], members: list[bytes], now_us: int) -> list:
        """A heavy entity's window read whole (``members``) with its stored tile summaries
        (HGETALL's reply: a map, or in RESP2 ``[tile, summary, ...]``), as ``read_window.lua``
        returns it at ``now_us``: the summaries of the tiles inside the window holding no cut,
        written with this view's tag, in tile order; then as one run, the members but the plain
        events of those tiles (a block's events of them are skipped as it is unpacked)."""
        assert self.tiled is not None
        spec = self.tiled.spec
        size, tag = spec.tile_us, spec.tag
        first, last = (now_us - self.evaluator.longest_us + 1) // size, now_us // size
        cut = {c // size for c in self.cuts(now_us)}
        read: list[bytes | int] = []
        pairs = stored.items() if isinstance(stored, dict) else zip(stored[::2], stored[1::2])
        for tile, summary in sorted((int(t), s) for t, s in pairs):
            if first <= tile <= last and tile not in cut and summary.startswith(tag):
                read += [tile, summary]
        summarized = set(read[::2])
        return [read, [[m for m in members if packed.is_block(m) or packed.tile_of(m, size) not in summarized]]]

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
                stored = event_columns(req.view)
                entity_of = _key_builder(project, keyset, {k: t.name for k, t in defs.key_types[req.view.name].items()})
                events_of = partial(_events_key_of, entity_of, req.layout.online_field)
                evaluator = WindowEvaluator(req.view, [by_name[f] for f in req.features])
                spec = tiles.TileSpec.of(req.view, req.layout.storage_id)
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
                    _WindowPlan(
                        req,
                        keyset,
                        events_of,
                        make_events_decoder(stored, decoded),
                        evaluator,
                        tiled,
                        wanted,
                        stored,
                        tiles.tile_us(req.view),
                    )
                )
                continue
            if keyset not in groups:
                groups[keyset] = _Group(
                    keyset,
                    [],
                    _key_builder(project, keyset, {k: t.name for k, t in defs.key_types[req.view.name].items()}),
                )
            group = groups[keyset]
            group.fields.append(req.layout.online_field)
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
    known_heavy: set[int] = field(default_factory=set)  # ranges read by ``read_window.lua`` at once (``HeavyKeys``)
    unread: set[int] = field(default_factory=set)  # ranges of views whose events online wait for a resend: none
    replayed: bool = False  # evaluated at a time the caller gave (``at``), not at the lookup's own
    # a replay's: the lookup of the views' horizons, and a read of what each range's entity lacks
    horizons_at: int | None = None
    lacked: list[Range] = field(default_factory=list)

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
        unfilled: Collection[str] = (),
    ) -> OnlineQuery:
        """The reads and assembly of a lookup; ``unfilled``: aggregated views whose events online
        wait for a resend (``FeatureStore.unfilled_views``), answered NOT_FOUND, not read."""
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
        for number, window in enumerate(template.windows):
            index = {}
            rows = []
            low, limit = now_us - window.evaluator.longest_us, window.heavy_from()
            scores = packed.block_range(low, now_us, window.tile_us)  # (with the blocks holding its events)
            for values in zip(*(columns[k] for k in window.keyset)):
                key = window.key_of(values)
                pos = index.get(key)
                if pos is None:
                    pos = index[key] = len(ranges)
                    ranges.append((key, *scores, limit))
                    range_plans.append(number)
                rows.append(pos)
            range_slots.append(rows)
        horizons_at: int | None = None
        lacked: list[Range] = []
        if now is not None and ranges:  # a replay also reads the horizons, and what each entity's events lack
            horizons_at = len(lookups)
            lookups.append((key_prefix(project) + HORIZONS, [w.request.layout.online_field for w in template.windows]))
            lacked = [(key, LACKED_FROM, math.inf, None) for key, *_ in ranges]
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
            unread={
                pos for pos, number in enumerate(range_plans) if template.windows[number].request.view.name in unfilled
            },
            replayed=now is not None,
            horizons_at=horizons_at,
            lacked=lacked,
        )

    def require_retained(self, replies: list) -> None:
        """Refuse a replay whose window reaches back to events Redis may lack: those the entity's
        writes did not keep or trimmed (its ledger, read by ``lacked``), and those of keys expired
        (a key lives until its newest event + horizon + dedup window, under the horizons writes have
        used: ``keep_horizon.lua``). Counted without them, a window's aggregates would be wrong, and
        look right."""
        if self.horizons_at is None:
            return
        wall_us = time.time_ns() // 1000
        horizons = replies[self.horizons_at]
        ledgers = replies[len(self.lookups) + len(self.ranges) :]
        expired = [
            _expired_up_to_us(listed, wall_us, window) for listed, window in zip(horizons, self.template.windows)
        ]
        for pos in range(len(self.ranges)):
            if pos in self.unread:
                continue
            window = self.template.windows[self.range_plans[pos]]
            low = self.now_us - window.evaluator.longest_us  # (the window read holds events after it)
            held = [int.from_bytes(ledger[:8], "big") - (1 << 63) for ledger in ledgers[pos]]
            lacked = max(*held, _NONE, expired[self.range_plans[pos]])
            if lacked > low:
                view = window.request.view.name
                raise NotRetainedError(
                    f"view {view!r}: a lookup at {_iso(self.now_us)} needs events from {_iso(low)} on, but "
                    f"Redis may lack this entity's events up to {_iso(lacked)} (it keeps the longest window plus "
                    "online_store.event_retention). Raise event_retention and re-materialize to replay that "
                    "far back, or read the history (get_historical_features)"
                )

    def view_versions(self) -> list[dict[str, Any]]:
        """The feature views the query reads, each once, with the history version read (Feast's
        ``feature_view_metadata``; our versions count from 1, as ``plan`` names them)."""
        plans: list[_ViewPlan | _WindowPlan] = [*self.template.views, *self.template.windows]
        views = {plan.request.view.name: plan.request.layout.version for plan in plans}
        return [{"name": name, "version": version} for name, version in views.items()]

    def reads(
        self,
    ) -> tuple[list[Range], list[tuple[bytes, list[bytes | int]]], list[bytes]]:
        """What the first round trip reads besides the lookups: the ranges read plainly (up to
        ``heavy_from`` members where tile summaries may answer), the windows of entities known to
        hold more members than that, read by ``read_window.lua`` at once, and the events keys whose
        tile summaries come with their plain read; nothing of an unread range."""
        plain = self._plain()
        summaries = [self.ranges[pos][0] for pos in plain if self.ranges[pos][3] is not None]
        ranges = [self.ranges[pos] for pos in plain] + self.lacked
        return ranges, [self.tiles_read(pos) for pos in self._scripted()], summaries

    def _plain(self) -> list[int]:
        """The ranges the first round trip reads plainly."""
        return [pos for pos in range(len(self.ranges)) if pos not in self.unread and pos not in self.known_heavy]

    def _scripted(self) -> list[int]:
        """The ranges the first round trip reads by ``read_window.lua``, in order."""
        return sorted(self.known_heavy - self.unread)

    def placed(self, replies: list) -> list:
        """The first round trip's replies (lookups, ``reads``' ranges, its windows, its summaries)
        laid out as ``assemble`` takes them: a reply per lookup, then per range its events (none
        if unread), or a heavy entity's ``[summaries, runs of events]``, then a replay's ``lacked``
        reads. A plain read that holds its whole window and is heavy (blocks count their events)
        is answered from the summaries read with it: no second round trip; one that stopped at its
        limit is left to ``found_heavy``."""
        n = len(self.lookups)
        raw: list = replies[:n] + [[] for _ in self.ranges]
        answers = iter(replies[n:])
        plain = self._plain()
        for pos in plain:
            raw[n + pos] = next(answers)
        raw += [next(answers) for _ in self.lacked]
        for pos in self._scripted():
            raw[n + pos] = next(answers)
        for pos in plain:
            limit = self.ranges[pos][3]
            if limit is None:
                continue
            stored, members = next(answers), raw[n + pos]
            if len(members) < limit and packed.event_count(members) >= limit:
                raw[n + pos] = self.template.windows[self.range_plans[pos]].held_tiled(stored, members, self.now_us)
        return raw

    def found_heavy(self, raw: list) -> list[int]:
        """The ranges whose plain read stopped at ``heavy_from`` members: their entities answer from
        tile summaries and the events of their other tiles (``tiles_read``)."""
        n = len(self.lookups)
        return [
            pos
            for pos, (_, _, _, limit) in enumerate(self.ranges)
            if limit is not None
            and pos not in self.known_heavy
            and pos not in self.unread
            and not is_tiled(raw[n + pos])
            and len(raw[n + pos]) >= limit
        ]

    def tiles_read(self, pos: int) -> tuple[bytes, list[bytes | int]]:
        """Range ``pos`` as ``read_window.lua`` reads it: its events key and the script's arguments."""
        window = self.template.windows[self.range_plans[pos]]
        return self.ranges[pos][0], window.tiles_arguments(self.now_us)

    def place_heavy(self, found: list[int], raw: list, replies: list) -> None:
        """The second round trip's replies (``tiles_read`` of the ranges ``found``) into ``raw``."""
        n = len(self.lookups)
        for pos, reply in zip(found, replies):
            raw[n + pos] = reply


def _iso(us: int) -> str:
    """µs since the epoch as ISO 8601 (a window may start before the first time a datetime holds)."""
    try:
        return micros_to_datetime(us).isoformat()
    except OverflowError:
        return "before 0001-01-01" if us < 0 else "after 9999-12-31"


_NONE = -(1 << 63)  # (no event lacked)


def _expired_up_to_us(listed: bytes | None, wall_us: int, window: _WindowPlan) -> int:
    """The newest µs an event of the window's view may have whose key has expired, from the view's
    ``keep_horizon.lua`` pairs (``_NONE``: no write recorded). A key written under a horizon lives
    until its newest event + horizon + dedup window, so an expired one held no event newer than
    now, or the pair's until, less those."""
    bounds = [
        min(int(until_ms) * 1000, wall_us) - int(horizon_ms) * 1000
        for horizon_ms, until_ms in (pair.split(b":") for pair in (listed or b"").split())
    ]
    return max(bounds) - dedup_us(window.request.view) if bounds else _NONE


def is_tiled(reply: list) -> bool:
    """Whether a range's reply is a heavy entity's ``[summaries, runs of events]`` (not its events)."""
    return bool(reply) and isinstance(reply[0], list)


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
