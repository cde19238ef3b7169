"""What the online store costs, measured on a repo's own data (``featurestore capacity``).

From a sample of the entities Redis holds: the bytes each layout takes per entity and per event
in the view's longest window (``MEMORY USAGE`` of the entity's keys: its hash of latest values,
and per aggregated view its events and blocks, event ids and tile summaries), the Redis
process's CPU time (``INFO cpu``: commands and their network handling) per lookup of one entity
(every feature of its views, a round trip each, read as a server reads it) and per event
written (the sampled events written again under a scratch project, then deleted); and what N
entities × E events need in memory and nodes, and a load of lookups and events a second in
Redis cores and nodes; and what layouts no longer read still hold (``featurestore compact
--drop-old-layouts``): how many sampled entities' hashes hold their values, and the share of the
project's keys that are their events. Redis runs commands on one
core: a node serves about 10⁶ / µs of them a second. Other clients' traffic while it measures
counts too: measure on a quiet moment.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from featurestore.aggregation import dedup_us
from featurestore.aggregation.tiles import tile_us
from featurestore.definitions import FeatureView
from featurestore.errors import FeatureStoreError
from featurestore.online import packed
from featurestore.online.base import EVENT_SCORES, PROJECT_HASHES
from featurestore.online.codec import event_columns, events_field, events_key, glob_escaped, key_prefix, key_value
from featurestore.online.lua import scripts
from featurestore.registry import Definitions
from featurestore.retrieval.online import OnlineQuery, OnlineReader

PROBE_PROJECT = "capacity-probe"  # the scratch project the write probe writes under (and deletes)
MOST_PROBE_EVENTS = 50_000  # events the write probe sends, at most
SCANNED_PER_SAMPLED = 100  # keys the sample's scan reads at most per entity sampled (a store of earlier layouts' keys)
LOOKUPS = 2000  # lookups timed (Redis counts CPU time in clock ticks: enough of them to be exact)
# the share of its one core a node's commands are sized to take: the rest is room for peaks, a
# node's replication streams and forks (snapshots, rewrites), and requests queue as a core fills
BUSY_MOST = 0.5
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class LayoutCost:
    """One layout's memory, over the sampled entities holding it."""

    name: str  # "latest values (card_id)", or "<view> events"
    entities: int
    bytes_per_entity: float
    # events in the longest window (None: latest values); the bytes also hold what an entity keeps
    # past it, the writes the duplicate rule needs a dedup window on, so a steady store's sample
    # sizes a steady store
    events_per_entity: float | None

    @property
    def bytes_per_event(self) -> float | None:
        if not self.events_per_entity:
            return None
        return self.bytes_per_entity / self.events_per_entity

    def bytes_for(self, events_per_entity: float | None) -> float:
        """Bytes per entity at ``events_per_entity`` (None: as sampled), at the sampled cost per event."""
        if events_per_entity is None or self.bytes_per_event is None:
            return self.bytes_per_entity
        return self.bytes_per_event * events_per_entity


@dataclass(frozen=True)
class Capacity:
    url: str
    keys: int  # in the whole Redis (DBSIZE)
    used_memory: int  # INFO memory: what the Redis takes now
    entities_now: int  # the project's entities, estimated from the sample's keys per entity
    sampled: int
    layouts: list[LayoutCost]
    lookup_us: float | None  # Redis CPU time per lookup of one entity, every view
    event_write_us: float | None  # Redis CPU time per event written
    compact_value_limit: int = packed.COMPACT_SETS_FROM  # the longest member Redis keeps a sorted set compact with
    earlier_layouts: int = 0  # sampled entities whose hash also holds values of layouts no longer read
    # events keys (with their ids and tiles) of layouts no longer read: estimated keys and bytes in the
    # whole project, from their share of the keys the sample's scan met (not in the layouts above)
    earlier_event_keys: int = 0
    earlier_event_bytes: float = 0.0

    def memory_for(self, entities: int, events_per_entity: float | None = None) -> float:
        """Bytes that ``entities`` entities of each layout need (``events_per_entity`` in each aggregated view)."""
        return entities * sum(layout.bytes_for(events_per_entity) for layout in self.layouts)

    def cores_for(self, lookups_per_second: float, events_per_second: float) -> float:
        """Redis cores (CPU seconds a second) that load takes, at the measured cost of a lookup of one
        entity and of an event written."""
        if (lookups_per_second and self.lookup_us is None) or (events_per_second and self.event_write_us is None):
            raise FeatureStoreError(
                "the cost of a lookup or of a write was not measured (writes: leave out --no-probe-writes)"
            )
        return (lookups_per_second * (self.lookup_us or 0) + events_per_second * (self.event_write_us or 0)) / 1e6

    def describe(
        self,
        entities: int | None,
        events_per_entity: float | None,
        node_memory: int,
        lookups_per_second: float = 0,
        events_per_second: float = 0,
    ) -> str:
        """The report ``featurestore capacity`` prints (the load, if any given, sized in nodes too)."""
        lines = [
            f"Online store {self.url}: {self.keys:,} keys, {_size(self.used_memory)} used; "
            f"about {self.entities_now:,} entities of this project, {self.sampled:,} sampled",
            f"{'layout':<40} {'entities':>9} {'events/entity':>14} {'bytes/entity':>13} {'bytes/event':>12}",
        ]
        for c in self.layouts:
            events = f"{c.events_per_entity:,.1f}" if c.events_per_entity is not None else "-"
            per_event = f"{c.bytes_per_event:,.1f}" if c.bytes_per_event is not None else "-"
            lines.append(f"{c.name:<40} {c.entities:>9,} {events:>14} {c.bytes_per_entity:>13,.0f} {per_event:>12}")
        if self.earlier_event_keys:
            lines.append(
                f"About {self.earlier_event_keys:,} keys ({_size(self.earlier_event_bytes)}) hold aggregated views' "
                "events of layouts no longer read (an upgrade or a definition change left them; not in the sizing "
                "below): they expire a longest window and a dedup window after their newest event, or, once every "
                "server runs this version, `featurestore compact --drop-old-layouts` deletes them"
            )
        if self.earlier_layouts:
            lines.append(
                f"{self.earlier_layouts:,} of the sampled entities also hold values of layouts no longer read (an "
                "upgrade or a definition change left them; their bytes count above): once every server runs this "
                "version, `featurestore compact --drop-old-layouts` deletes them"
            )
        if self.lookup_us is not None:
            lines.append(
                f"Redis CPU per lookup of 1 entity, every view: {self.lookup_us:.1f} µs"
                f" → about {1e6 / self.lookup_us:,.0f} lookups/s per Redis core"
            )
        if self.event_write_us is not None:
            lines.append(
                f"Redis CPU per event written (256 a call): {self.event_write_us:.2f} µs"
                f" → about {1e6 / self.event_write_us:,.0f} events/s per Redis core"
            )
        n = entities if entities is not None else self.entities_now
        need = self.memory_for(n, events_per_entity)
        profile = f" × {events_per_entity:,g} events per aggregated view" if events_per_entity is not None else ""
        nodes = max(1, math.ceil(need / node_memory))
        lines.append(
            f"{n:,} entities per layout{profile}: {_size(need)} of data → {nodes} Redis node{'s' * (nodes > 1)} "
            f"of {_size(node_memory)} (each replica as much again; Redis needs headroom for forks and fragmentation)"
        )
        if lookups_per_second or events_per_second:
            cores = self.cores_for(lookups_per_second, events_per_second)
            by_cpu = max(1, math.ceil(cores / BUSY_MOST))
            lines.append(
                f"{lookups_per_second:,g} lookups/s and {events_per_second:,g} events/s: {cores:,.2f} cores of Redis CPU "
                f"→ {by_cpu} Redis node{'s' * (by_cpu > 1)} at most {BUSY_MOST:.0%} busy; size for "
                f"{max(by_cpu, nodes)} (the {'load' if by_cpu > nodes else 'memory'} decides; a cluster spreads "
                "entities over its masters by slot, so one hot entity stays on one core)"
            )
        if events_per_entity is not None:
            lines.append(
                "  (at the sampled cost per event: Redis packs a sorted set of 128 events or fewer more "
                "tightly, so sizing far from the sample's events per entity is approximate)"
            )
        if self.compact_value_limit < packed.COMPACT_SETS_FROM and any(c.events_per_entity for c in self.layouts):
            lines.append(
                f"This Redis keeps sorted sets compact up to {self.compact_value_limit}-byte members, so events pack "
                f"{packed.pack_from(self.compact_value_limit)} or more to a block; with `CONFIG SET "
                f"zset-max-listpack-value {packed.COMPACT_SETS_FROM}` and `hash-max-listpack-value "
                f"{packed.COMPACT_SETS_FROM}` (…-ziplist-… before Redis 7; and in its config file) they pack from "
                f"{packed.pack_from(packed.COMPACT_SETS_FROM)}, fewer bytes an event for entities of tens to hundreds "
                "of events once `featurestore compact` re-packs them"
            )
        return "\n".join(lines)


def measure(online, defs: Definitions, project: str, sample: int = 1000, probe: bool = True) -> Capacity:
    """Sample up to ``sample`` of the project's entities in ``online`` (a ``RedisOnlineStore``) and
    measure their memory, lookups and (``probe``) writes."""
    client = online.client
    prefix = key_prefix(project)
    views = [v for v in defs.feature_views.values() if v.online]
    read_now = {defs.layout(v).online_field.encode() for v in views}

    def earlier_events(key: bytes) -> bool:
        field = events_field(key)
        return field is not None and field not in read_now

    entities, scanned, earlier_met, earlier_keys = _sample_entities(client, prefix, sample, earlier_events)
    earlier = 0  # sampled entities holding values of layouts no longer read
    now_us = time.time_ns() // 1000
    groups: dict[str, list[float]] = {}
    events_of: dict[str, list[int]] = {}
    held_keys: list[int] = []  # keys of each sampled entity
    lookups: list[tuple[dict, list[str]]] = []  # (entity, every feature of its views)
    written: list[tuple[bytes, FeatureView]] = []  # events keys the write probe copies
    for entity in entities:
        values = _key_values(entity)
        mine = [v for v in views if sorted(v.join_keys) == sorted(values)]
        aggregated = [(v, events_key(entity, defs.layout(v).online_field)) for v in mine if v.is_aggregated]
        pipe = client.pipeline(transaction=False)
        pipe.hkeys(entity)
        pipe.memory_usage(entity, samples=0)
        for _, key in aggregated:
            for part in _parts(key):
                pipe.memory_usage(part, samples=0)
            pipe.zrangebyscore(key, *EVENT_SCORES)
        fields, *replies = pipe.execute()
        earlier += any(b"#" in field and field not in read_now for field in fields)  # (fields are view#layout)
        width = len(_parts(b"")) + 1
        sizes = [replies[0], *(r for k, r in enumerate(replies[1:]) if k % width != width - 1)]  # (the events aside)
        held_keys.append(sum(1 for size in sizes if size))
        if replies[0]:
            groups.setdefault(f"latest values ({', '.join(sorted(values))})", []).append(replies[0])
        for k, (view, key) in enumerate(aggregated):
            *parts, members = replies[1 + width * k : 1 + width * (k + 1)]
            if parts[0] or parts[1]:
                name = f"{view.name} events"
                groups.setdefault(name, []).append(sum(size or 0 for size in parts))
                low_us = now_us - view.longest_window // timedelta(microseconds=1)
                events_of.setdefault(name, []).append(packed.events_after(members, low_us, tile_us(view)))
                written.append((key, view))
        if mine and any(sizes):
            types = defs.key_types[mine[0].name]
            typed = {name: key_value(text, types[name].name) for name, text in values.items()}
            lookups.append((typed, [f"{v.name}:{f}" for v in mine for f in v.feature_names]))
    layouts = [
        LayoutCost(
            name,
            len(sizes),
            sum(sizes) / len(sizes),
            sum(events_of[name]) / len(sizes) if name in events_of else None,
        )
        for name, sizes in groups.items()
    ]
    keys = sum(int(n) for n in online.transport.each_node("DBSIZE"))
    own = int(client.exists(*(prefix + name for name in PROJECT_HASHES)))  # (no entity's)
    keys_per_entity = sum(held_keys) / len(held_keys) if held_keys and sum(held_keys) else 1.0
    project_keys = max(0, keys * _project_share(client, prefix) - own)
    earlier_share = earlier_met / scanned if scanned else 0.0
    pipe = client.pipeline(transaction=False)
    for key in earlier_keys:
        pipe.memory_usage(key, samples=0)
    earlier_bytes = sum(size or 0 for size in pipe.execute())  # (an empty pipeline sends nothing)
    return Capacity(
        url=online.transport.safe_url,
        keys=keys,
        used_memory=sum(int(node["used_memory"]) for node in online.transport.each_node("INFO", "memory")),
        entities_now=round(project_keys * (1 - earlier_share) / keys_per_entity) if entities else 0,
        sampled=len(entities),
        layouts=sorted(layouts, key=lambda c: c.name),
        lookup_us=_lookup_us(online, defs, project, lookups) if lookups else None,
        event_write_us=_event_write_us(online, prefix, written, online.compact_value_limit()) if probe else None,
        compact_value_limit=online.compact_value_limit(),
        earlier_layouts=earlier,
        earlier_event_keys=round(project_keys * earlier_share),
        earlier_event_bytes=earlier_bytes / len(earlier_keys) * project_keys * earlier_share if earlier_keys else 0.0,
    )


def parse_size(text: str) -> int:
    """``25GB``, ``512MiB``, ``1.5TB``, ``1000000`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise FeatureStoreError(
            f"a size is a number and a unit (B, KB, MB, GB, TB, or KiB ... TiB), like 25GB; not {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _sample_entities(
    client, prefix: bytes, sample: int, earlier: Callable[[bytes], bool]
) -> tuple[list[bytes], int, int, list[bytes]]:
    """Up to ``sample`` distinct entity keys (``fs:<project>:{...}``), in SCAN's order (the hash
    table's: no bias by key), from at most ``SCANNED_PER_SAMPLED`` × ``sample`` of the project's
    keys; how many keys the scan met, how many of them ``earlier`` is true of (skipped), and up
    to ``sample`` of those."""
    entities: dict[bytes, None] = {}
    scanned, earlier_met = 0, 0
    kept: list[bytes] = []
    for key in client.scan_iter(match=glob_escaped(prefix) + b"{*", count=1000):
        if not key.startswith(prefix + b"{"):  # (the pattern is escaped: this is the proof)
            continue
        scanned += 1
        if earlier(key):
            earlier_met += 1
            if len(kept) < sample:
                kept.append(key)
        else:
            entities.setdefault(key[: key.index(b"}") + 1], None)
        if len(entities) >= sample or scanned >= SCANNED_PER_SAMPLED * sample:
            break
    return list(entities), scanned, earlier_met, kept


def _project_share(client, prefix: bytes, draws: int = 200) -> float:
    """The share of the Redis's keys that are this project's, from ``draws`` RANDOMKEYs (1.0 when
    all are); one at a time: a cluster client sends each to a node of its choosing, and refuses them pipelined."""
    drawn = [key for key in (client.randomkey() for _ in range(draws)) if key is not None]
    return sum(key.startswith(prefix) for key in drawn) / len(drawn) if drawn else 0.0


def _key_values(entity: bytes) -> dict[str, str]:
    """``{join key: key text}`` of an entity key (``fs:<project>:{card_id=42\x1fmerchant_id=7}``)."""
    inside = entity[entity.index(b"{") + 1 : -1].decode(errors="replace")
    return dict(part.split("=", 1) for part in inside.split("\x1f") if "=" in part)


def _redis_usec(online) -> float:
    """The CPU time the Redis process has used so far, µs (every master's, for a cluster): commands
    and the network handling around them, what bounds a core's throughput."""
    stats = online.transport.each_node("INFO", "cpu")
    return sum(float(node["used_cpu_sys"]) + float(node["used_cpu_user"]) for node in stats) * 1e6


def _lookup_us(online, defs: Definitions, project: str, lookups: Sequence[tuple[dict, list[str]]]) -> float:
    """Redis CPU per lookup of one entity and every feature of its views, as a server reads it
    (``OnlineReader``: a heavy entity's tile summaries; none stored here), a round trip each."""
    reader = OnlineReader(online, max_sealing=0)

    def lookup(entity: dict, refs: list[str]) -> None:
        reader.read(OnlineQuery.prepare(defs, project, [entity], refs, None, False))

    for entity, refs in lookups:  # (connections and scripts warm, heavy entities known as a server knows them)
        lookup(entity, refs)
    timed = list(itertools.islice(itertools.cycle(lookups), LOOKUPS))  # (a few entities: each read again)
    before = _redis_usec(online)
    for entity, refs in timed:
        lookup(entity, refs)
    return (_redis_usec(online) - before) / len(timed)


def _event_write_us(online, prefix: bytes, held: list[tuple[bytes, FeatureView]], limit: int) -> float | None:
    """Redis CPU per event: the sampled entities' events written again, as materialization writes
    them (``add_events.lua``, 256 a call), under ``PROBE_PROJECT``'s keys, deleted afterwards."""
    client, probe = online.client, key_prefix(PROBE_PROJECT)
    script = scripts()["add_events"]
    client.script_load(script.code)
    writes: list[tuple[bytes, FeatureView, list[bytes]]] = []
    total = 0
    for key, view in held:
        if total >= MOST_PROBE_EVENTS:
            break
        stored = event_columns(view)
        members = packed.expand(client.zrangebyscore(key, *EVENT_SCORES), stored)[: MOST_PROBE_EVENTS - total]
        writes.append((probe + key[len(prefix) :], view, members))
        total += len(members)
    if not total:
        return None
    now_ms = time.time_ns() // 1_000_000
    try:
        before = _redis_usec(online)
        for calls in _chunks(writes, now_ms, limit):
            pipe = client.pipeline(transaction=False)
            for keys, arguments in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *arguments)
            pipe.execute()
        return (_redis_usec(online) - before) / total
    finally:
        for key, _, _ in writes:
            client.delete(*_parts(key))


def _chunks(
    writes: list[tuple[bytes, FeatureView, list[bytes]]], now_ms: int, limit: int
) -> Iterator[list[tuple[list, list]]]:
    """``add_events.lua`` calls of 256 events, a pipeline of them per view: keys kept far longer than the probe takes."""
    for key, view, members in writes:
        stamps = [int.from_bytes(m[8:16], "big") - (1 << 63) for m in members]
        horizon_ms = now_ms - min(stamps, default=0) // 1000 + 3_600_000
        calls = []
        for i in range(0, len(members), 256):
            part, times = members[i : i + 256], stamps[i : i + 256]
            head = [0, horizon_ms, horizon_ms // 16, tile_us(view), dedup_us(view), 0, limit]
            calls.append(([key] * len(part), [*head, *times, *part]))
        yield calls


def _parts(events: bytes) -> tuple[bytes, ...]:
    """The keys of an entity's events in one view (``online.codec``): events and blocks, the ids
    hash, tile summaries."""
    return (events, events + b"|ids", events + b"|tiles")


def _size(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
