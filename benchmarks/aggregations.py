"""Windowed aggregations: offline join and online lookup, each against a raw reference in the same run.

Offline: ``get_historical_features`` of 12 aggregates (count, sum, mean, max over 1 h, 24 h and
7 d) for 1M entity rows over 5M events of 100k cards, against a hand-written DuckDB query
computing the same exact values (entity rows and events in one stream, RANGE frames). Each
side runs in a fresh process, so wall time and peak RSS are its own.

Online: an SDK lookup of 1 card × 5 aggregates (each card has ~10 events in its 7 d window)
against a plain latest-value lookup of 1 entity × 5 features, timed in alternating blocks;
one-event pushes in-process and over HTTP (a feature server process), to Redis only and to both
stores; sustained ingest with pushes of 1,000 events; lookups of heavy cards (1,000, 10,000
and 50,000 events in the 7 d window), written with and without the write's tile sealing; the
event loop's longest stall during a cold heavy card's first lookups on the servers' path; the
memory a card's events take; and ``featurestore capacity``'s report on the whole store.

    python benchmarks/aggregations.py                          # full size
    python benchmarks/aggregations.py --events 500000 --entity-rows 100000 --cards 10000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_rss_mb, percentiles, run_child  # noqa: E402

HERE = Path(__file__).resolve()
START = datetime(2024, 1, 1, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")
WINDOWS = {"1h": 3600, "24h": 86400, "7d": 7 * 86400}
FUNCTIONS = ("count", "sum", "mean", "max")

DEFS = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, PushSource
from featurestore.types import *

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
src = PushSource(name="payments", schema=[Field("tx_id", Int64), Field("card_id", Int64), Field("amount", Float64),
                                          Field("event_timestamp", UnixTimestamp)])
activity = FeatureView(name="activity", entities=[card], source=src, event_id="tx_id",
    schema=[Field("tx_id", Int64), Field("amount", Float64)],
    aggregations=[Aggregation(f, timedelta(seconds=s), "amount", name=f"amount_{f}_{w}")
                  for w, s in {windows}.items() for f in {functions}])
latest = FeatureView(name="latest", entities=[card], source=PushSource(name="profiles", schema=[
        Field("card_id", Int64), Field("event_timestamp", UnixTimestamp), Field("f1", Float64), Field("f2", Float64),
        Field("f3", Int64), Field("f4", String), Field("f5", Float64)]),
    schema=[Field("f1", Float64), Field("f2", Float64), Field("f3", Int64), Field("f4", String), Field("f5", Float64)])
"""
NAMES = [f"amount_{f}_{w}" for w in WINDOWS for f in FUNCTIONS]


def write_repo(
    root: Path, retention: str = "", dedup_window: str = "", windows: dict = WINDOWS, online: str = ""
) -> None:
    """The benchmark's repo; ``dedup_window``: the activity view's, as Python (``timedelta(days=1)``);
    ``online``: more ``online_store`` settings, as YAML (``pack_pushes: false``)."""
    root.mkdir(parents=True, exist_ok=True)
    settings = ", ".join(x for x in (f"event_retention: {retention}" if retention else "", online) if x)
    extra = f"online_store: {{{settings}}}\n" if settings else ""
    (root / "featurestore.yaml").write_text(f"project: bench_agg\nmodules: [features.py]\n{extra}")
    defs = DEFS.replace("{windows}", repr(windows)).replace("{functions}", repr(FUNCTIONS))
    if dedup_window:
        defs = defs.replace('event_id="tx_id",', f'event_id="tx_id", dedup_window={dedup_window},')
    (root / "features.py").write_text(defs)


def setup_offline(root: Path, cards: int, events: int, entity_rows: int, seed: int) -> None:
    from featurestore import FeatureStore

    write_repo(root)
    rng = np.random.default_rng(seed)
    span_s = 90 * 86_400
    start_us = int(START.timestamp() * 1e6)
    event = start_us + np.sort(rng.integers(0, span_s, events)) * 10**6  # whole seconds: ties happen
    table = pa.table(
        {
            "card_id": rng.integers(1, cards + 1, events),
            "event_timestamp": pa.array(event, pa.int64()).cast(TS),
            "created_timestamp": pa.array(event, pa.int64()).cast(TS),
            "_run_id": np.ones(events, np.int64),
            "_row_id": rng.permutation(events).astype(np.int64),
            "tx_id": np.arange(events, dtype=np.int64),
            "amount": np.round(rng.lognormal(3.5, 1.1, events), 2),
        }
    )
    store = FeatureStore(root)
    store.apply()
    store.offline_store.append(
        "activity", table.cast(store.definitions.history_schema(store.get_feature_view("activity")))
    )
    pq.write_table(
        pa.table(
            {
                "card_id": rng.integers(1, int(cards * 1.1) + 1, entity_rows),
                "event_timestamp": pa.array(
                    start_us + rng.integers(0, (span_s + 86_400) * 10**6, entity_rows), pa.int64()
                ).cast(TS),
            }
        ),
        root / "entities.parquet",
    )


def run_ours(root: Path) -> dict:
    from featurestore import FeatureStore

    store = FeatureStore(root)
    store.definitions
    entity = pq.read_table(root / "entities.parquet")
    t0 = time.perf_counter()
    result = store.get_historical_features(entity, features=[f"activity:{n}" for n in NAMES]).to_arrow()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": result.num_rows, "checksum": _checksum(result), "peak_rss_mb": peak_rss_mb()}


def run_reference(root: Path) -> dict:
    import duckdb
    from deltalake import DeltaTable

    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    entities = pq.read_table(root / "entities.parquet")  # noqa: F841 - scanned by name
    files = "[" + ", ".join(f"'{f}'" for f in DeltaTable(str(root / "data" / "offline" / "activity")).file_uris()) + "]"
    frames = ", ".join(
        f"w{w} AS (PARTITION BY card_id ORDER BY ts RANGE BETWEEN INTERVAL ({s * 10**6 - 1}) MICROSECONDS PRECEDING AND CURRENT ROW)"
        for w, s in WINDOWS.items()
    )
    sql_of = {
        "count": "count(amount) OVER w{w}",
        "sum": "COALESCE(fsum(amount) OVER w{w}, 0)",
        "mean": "fsum(amount) OVER w{w} / NULLIF(count(amount) OVER w{w}, 0)",
        "max": "max(amount) OVER w{w}",
    }
    aggregates = ", ".join(f"{sql_of[f].format(w=w)} AS amount_{f}_{w}" for w in WINDOWS for f in FUNCTIONS)
    sql = f"""
        WITH e AS (SELECT card_id, event_timestamp, CAST(event_timestamp AS TIMESTAMP) AS ts, row_number() OVER () AS rn FROM entities),
        u AS (SELECT card_id, event_timestamp, ts, rn, NULL::DOUBLE AS amount FROM e
              UNION ALL SELECT card_id, NULL, CAST(event_timestamp AS TIMESTAMP), NULL, amount FROM read_parquet({files}))
        SELECT card_id, event_timestamp, {aggregates} FROM u WINDOW {frames} QUALIFY rn IS NOT NULL ORDER BY rn"""
    t0 = time.perf_counter()
    result = con.sql(sql).to_arrow_table()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": result.num_rows, "checksum": _checksum(result), "peak_rss_mb": peak_rss_mb()}


def _checksum(table: pa.Table) -> str:
    import pyarrow.compute as pc

    return "/".join(
        str(pc.sum(table[n]).as_py()) for n in ("amount_count_1h", "amount_count_7d", "amount_max_24h", "amount_sum_7d")
    )


def offline(args: argparse.Namespace) -> None:
    root = args.data_dir / f"offline-{args.cards}-{args.events}-{args.entity_rows}-{args.seed}"
    if not (root / "entities.parquet").exists():
        print(f"generating {args.events:,} events for {args.cards:,} cards, {args.entity_rows:,} entity rows ...")
        setup_offline(root, args.cards, args.events, args.entity_rows, args.seed)
    results: dict[str, dict] = {}
    for side in ("reference", "ours", "reference", "ours"):  # interleaved; best of two each
        r = run_child(str(HERE), "--child", side, "--data-dir", str(root))
        if side not in results or r["seconds"] < results[side]["seconds"]:
            results[side] = {**r, "peak_rss_mb": max(r["peak_rss_mb"], results.get(side, {}).get("peak_rss_mb", 0))}
    ours, ref = results["ours"], results["reference"]
    print(
        f"offline: {args.entity_rows:,} entity rows x {args.events:,} events, {len(NAMES)} aggregates over {list(WINDOWS)}"
    )
    print(f"  {'':26}{'wall s':>10}{'peak RSS MB':>14}")
    print(f"  {'hand-written DuckDB SQL':26}{ref['seconds']:>10.2f}{ref['peak_rss_mb']:>14.0f}")
    print(f"  {'get_historical_features':26}{ours['seconds']:>10.2f}{ours['peak_rss_mb']:>14.0f}")
    print(
        f"  ratio (ours / reference): time {ours['seconds'] / ref['seconds']:.2f}x, "
        f"peak RSS {ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x"
    )
    print(f"  results agree: {ours['checksum'] == ref['checksum']} ({ours['checksum']})")


def online(args: argparse.Namespace) -> None:
    import tempfile

    from featurestore import FeatureStore

    root = Path(tempfile.mkdtemp(prefix="bench-agg-online-"))
    write_repo(root)
    rng = np.random.default_rng(args.seed)
    n_cards = args.online_cards
    now = datetime.now(UTC)
    per_card = 10
    events = n_cards * per_card
    with FeatureStore(root) as store:
        store.apply()
        ts = [now - timedelta(seconds=int(s)) for s in rng.integers(60, 7 * 86400 - 60, events)]
        store.push(
            "payments",
            pa.table(
                {
                    "tx_id": np.arange(events, dtype=np.int64),
                    "card_id": np.repeat(np.arange(1, n_cards + 1), per_card),
                    "amount": np.round(rng.lognormal(3.5, 1.1, events), 2),
                    "event_timestamp": pa.array(ts, TS),
                }
            ),
            to="online",
        )
        store.push(
            "profiles",
            pa.table(
                {
                    "card_id": np.arange(1, n_cards + 1),
                    "event_timestamp": pa.array([now - timedelta(hours=1)] * n_cards, TS),
                    "f1": rng.normal(size=n_cards),
                    "f2": rng.normal(size=n_cards),
                    "f3": rng.integers(0, 100, n_cards),
                    "f4": pa.array(rng.integers(0, 100, n_cards).astype(str)),
                    "f5": rng.normal(size=n_cards),
                }
            ),
            to="online",
        )
        agg_refs = [f"activity:amount_{f}" for f in ("count_1h", "sum_24h", "mean_7d", "max_7d", "count_7d")]
        latest_refs = [f"latest:f{i}" for i in range(1, 6)]
        timings: dict[str, list[float]] = {"aggregates": [], "latest": []}
        deadline = time.monotonic() + args.seconds * 2
        for block in range(2 * args.blocks):
            refs, key = (agg_refs, "aggregates") if block % 2 == 0 else (latest_refs, "latest")
            for _ in range(args.block_size):
                row = [{"card_id": int(rng.integers(1, n_cards + 1))}]
                t0 = time.perf_counter()
                store.get_online_features(row, features=refs)
                timings[key].append(time.perf_counter() - t0)
            if time.monotonic() > deadline:
                break
        # the cards become active: each gets an event now, as in a stream (a card's first event after a
        # quiet spell extends its keys' expiry and trims its old events; later ones, for hours, do not)
        store.push(
            "payments",
            pa.table(
                {
                    "tx_id": np.arange(events, events + n_cards, dtype=np.int64),
                    "card_id": np.arange(1, n_cards + 1),
                    "amount": np.full(n_cards, 1.0),
                    "event_timestamp": pa.array([datetime.now(UTC)] * n_cards, TS),
                }
            ),
            to="online",
        )
        events += n_cards
        push_times: dict[str, list[float]] = {"online": [], "online_and_offline": []}
        for i, to in enumerate(["online"] * args.pushes + ["online_and_offline"] * args.pushes):
            one = pa.table(
                {
                    "tx_id": [events + i],
                    "card_id": [int(rng.integers(1, n_cards + 1))],
                    "amount": [12.5],
                    "event_timestamp": pa.array([datetime.now(UTC)], TS),
                }
            )
            t0 = time.perf_counter()
            store.push("payments", one, to=to)
            push_times[to].append(time.perf_counter() - t0)
        store.flush()
        # a stream of one-event pushes long enough that the buffer commits to Delta (every 5 s) while it runs
        stream: list[float] = []
        first, deadline = events + 2 * args.pushes, time.monotonic() + args.stream_seconds
        while time.monotonic() < deadline:
            one = pa.table(
                {
                    "tx_id": [first + len(stream)],
                    "card_id": [int(rng.integers(1, n_cards + 1))],
                    "amount": [12.5],
                    "event_timestamp": pa.array([datetime.now(UTC)], TS),
                }
            )
            t0 = time.perf_counter()
            store.push("payments", one, to="online_and_offline")
            stream.append(time.perf_counter() - t0)
        store.flush()
        http = http_push(root, first + len(stream) + 5_000, n_cards, args.pushes)
        ingest = {}
        # sustained, batched: what a stream consumer does; both stores with the history's statistics
        # kept up to date (the default) and without
        for n, (to, statistics) in enumerate(
            [("online", True), ("online_and_offline", True), ("online_and_offline, no statistics", False)]
        ):
            store.offline_store.summarize_commits = statistics
            batch, batches = 1000, 20
            tables = []
            for b in range(batches):
                first = events + 10_000 + (b + n * batches) * batch
                tables.append(
                    pa.table(
                        {
                            "tx_id": np.arange(first, first + batch, dtype=np.int64),
                            "card_id": rng.integers(1, n_cards + 1, batch),
                            "amount": np.round(rng.lognormal(3.5, 1.1, batch), 2),
                            "event_timestamp": pa.array([datetime.now(UTC)] * batch, TS),
                        }
                    )
                )
            t0 = time.perf_counter()
            for table in tables:
                store.push("payments", table, to=to.split(",")[0])
            store.flush()
            ingest[to] = batch * batches / (time.perf_counter() - t0)
            store.offline_store.statistics.idle(timeout=120)  # (its background work done before the next)
        store.offline_store.summarize_commits = True
        # heavy cards, last (their big pushes would disturb the timings above): tile summaries against
        # reading every event of the window. Each card's events are written twice, to two cards: as
        # materialize and batch pushes write (the write seals the ended tiles it holds), and without
        # the write sealing (as events streamed one by one leave them: the first lookups seal)
        from featurestore.aggregation import tiles
        from featurestore.online import packed

        heavy: dict[int, dict] = {}
        heavy_per_tile = tiles.HEAVY_PER_TILE
        for k, n in enumerate((1_000, 10_000, 50_000)):
            ts = pa.array([now - timedelta(seconds=int(s)) for s in rng.integers(60, 7 * 86400 - 60, n)], TS)
            amounts = np.round(rng.lognormal(3.5, 1.1, n), 2)
            heavy[n] = {}
            # three sealed copies (a first lookup is one sample each: their median), three more whose first
            # lookup follows a lookup of another card (as on a server under traffic, where the write came
            # from another process: right after its own push, this process's caches hold the push's
            # work), one not sealed, and one not sealed by its write but by `featurestore compact`
            # (``pack_online``) after it
            copies = [(True, n_cards + 1 + k), (True, n_cards + 200 + 2 * k), (True, n_cards + 201 + 2 * k)]
            serving = [("serving", n_cards + 300 + 3 * k + j) for j in range(3)]
            unsealed = [(False, n_cards + 21 + k), ("compacted", n_cards + 41 + k)]
            for copy, (sealing, card) in enumerate([*copies, *serving, *unsealed]):
                table = pa.table(
                    {
                        "tx_id": np.arange(n, dtype=np.int64) + (10 * k + copy + 1) * 10**9,
                        "card_id": np.full(n, card),
                        "amount": amounts,
                        "event_timestamp": ts,
                    }
                )
                with write_sealing(sealing in (True, "serving")):
                    t0 = time.perf_counter()
                    store.push("payments", table, to="online")
                    heavy[n].setdefault(("push", sealing), (time.perf_counter() - t0) * 1000)
                if sealing == "compacted":
                    store.pack_online(["activity"])
                if sealing == "serving":
                    store.get_online_features([{"card_id": copies[0][1]}], features=agg_refs)
                t0 = time.perf_counter()
                store.get_online_features([{"card_id": card}], features=agg_refs)
                heavy[n].setdefault(("first", sealing), []).append((time.perf_counter() - t0) * 1000)
            card = n_cards + 1 + k
            for _ in range(20):  # (sealed already: nothing left to summarize)
                store.get_online_features([{"card_id": card}], features=agg_refs)
            for label, per_tile in (("tiles", heavy_per_tile), ("events", 10**9)):
                tiles.HEAVY_PER_TILE = per_tile
                store.online_reader.heavy.clear()  # (a card whose plain read stopped at its limit reads summaries at once)
                times = []
                for _ in range(max(50, 20_000 // n)):
                    t0 = time.perf_counter()
                    store.get_online_features([{"card_id": card}], features=agg_refs)
                    times.append(time.perf_counter() - t0)
                heavy[n][label] = percentiles(times)["p50"]
            tiles.HEAVY_PER_TILE = heavy_per_tile
            # a first lookup's own work, many times over: the process forgets what it decoded and
            # which cards are heavy before each (as for a card it never read; nothing else cold)
            times = []
            for _ in range(max(50, 20_000 // n)):
                packed.decoded_blocks.clear()
                tiles.decoded_summaries.clear()
                store.online_reader.heavy.clear()
                t0 = time.perf_counter()
                store.get_online_features([{"card_id": card}], features=agg_refs)
                times.append(time.perf_counter() - t0)
            heavy[n]["forgotten"] = percentiles(times)["p50"]
        stalls = loop_stalls(store, agg_refs, n_cards + 10, rng, now)
        from featurestore import capacity

        # (before memory_by_layout's cards: a never-packed one of 50,000 events in the sample or
        # not would double the figure)
        measured = capacity.measure(store.online_store, store.definitions, store.config.project)
        memory = memory_by_layout(store, n_cards + 100, rng, now)
        steady = a_window_on(store, n_cards + 2000, rng)
        into_blocks = [
            ingest_into_blocks(store, n_cards + 10_000 * (k + 1), cards, per, rng, now)
            for k, (cards, per) in enumerate(INTO_BLOCKS)
        ]
        floor = write_path_floor(store.online_store.client, store.online_store.compact_value_limit(), args.seed)
    packing = pushes_packing(args.pack_seconds, args.seed)
    shorter = {}  # a card a window on where the activity view's dedup window is shorter than its longest window
    for name, dedup_window in (("1 d", "timedelta(days=1)"), ("1 h", "timedelta(hours=1)")):
        other = Path(tempfile.mkdtemp(prefix="bench-agg-dedup-"))
        write_repo(other, dedup_window=dedup_window)
        with FeatureStore(other) as deduped:
            deduped.apply()
            shorter[name] = a_window_on(deduped, 1, rng)
    agg, lat = percentiles(timings["aggregates"]), percentiles(timings["latest"])
    print(f"online (SDK, {n_cards:,} cards x {per_card} events in 7 d, alternating blocks):")
    print(f"  1 card x 5 aggregates     p50 {agg['p50']:.3f} ms  p99 {agg['p99']:.3f} ms  (n={agg['n']})")
    print(f"  1 entity x 5 latest       p50 {lat['p50']:.3f} ms  p99 {lat['p99']:.3f} ms  (n={lat['n']})")
    print(f"  ratio aggregates / latest: p50 {agg['p50'] / lat['p50']:.2f}x, p99 {agg['p99'] / lat['p99']:.2f}x")
    print(
        f"  1 heavy card x 5 aggregates, p50 from tile summaries (from every event; {heavy_per_tile}+ events per 1 h tile use summaries):"
    )
    for n, p in heavy.items():
        firsts = p[("first", True)]
        first, serving = float(np.median(firsts)), float(np.median(p[("first", "serving")]))
        print(
            f"    {n:>6,} events in 7 d: {p['tiles']:.2f} ms ({p['events']:.2f} ms, {p['events'] / p['tiles']:.1f}x); "
            f"first lookup {first:.1f} ms = {first / p['tiles']:.1f}x steady "
            f"(median of {len(firsts)} cards, {min(firsts):.1f}-{max(firsts):.1f} ms; "
            f"after another card's lookup: {serving:.1f} ms = {serving / p['tiles']:.1f}x; "
            f"p50 with the process's decoded blocks, summaries and heavy cards forgotten before each: "
            f"{p['forgotten']:.2f} ms = {p['forgotten'] / p['tiles']:.2f}x; "
            f"tiles not sealed by the write: {p[('first', False)][0]:.1f} ms, "
            f"then by `featurestore compact`: {p[('first', 'compacted')][0]:.1f} ms); "
            f"push {p[('push', True)]:.0f} ms ({p[('push', False)]:.0f} ms without sealing)"
        )
    print(
        "  a cold card of 50,000 events, its first 3 lookups on the servers' path (OnlineReader.read_async): longest event-loop stall"
    )
    for label, (lookups, stall) in stalls.items():
        print(
            f"    {label}: lookups {' / '.join(f'{ms:.0f}' for ms in lookups)} ms, "
            f"longest stall {' / '.join(f'{ms:.1f}' for ms in stall)} ms"
        )
    for to, times in push_times.items():
        push = percentiles(times)
        print(
            f"  push 1 event to {to:<18} in-process  p50 {push['p50']:.2f} ms  p99 {push['p99']:.2f} ms  (n={push['n']})"
        )
    ms = np.array(stream) * 1000
    print(
        f"  push 1 event to online_and_offline, {len(ms):,} in {args.stream_seconds:g} s (Delta commits in the background): "
        f"p50 {np.percentile(ms, 50):.2f} ms  p99 {np.percentile(ms, 99):.2f} ms  p99.9 {np.percentile(ms, 99.9):.2f} ms  "
        f"max {ms.max():.1f} ms"
    )
    for to, times in http.items():
        push = percentiles(times)
        print(
            f"  POST /push 1 event to {to:<18}     p50 {push['p50']:.2f} ms  p99 {push['p99']:.2f} ms  "
            f"(n={push['n']}, one keep-alive client)"
        )
    for to, rate in ingest.items():
        print(f"  sustained ingest, pushes of 1,000 events to {to}: {rate:,.0f} events/s")
    for (cards, per), rounds in zip(INTO_BLOCKS, into_blocks, strict=True):
        print(
            f"  sustained ingest into {cards:,} cards of {per} events packed in blocks, pushes of 1,000 new "
            "events to online, 4 rounds of 5,000: "
            + " / ".join(
                f"{rate:,.0f} events/s ({us:.1f} µs of Redis script CPU, {reads:.2f} block reads an event)"
                for rate, us, reads in rounds
            )
        )
    print(
        "  Redis script CPU per new event, add_events.lua against its commands alone (HMGET, then ZRANGE of a "
        "light entity's members or HSETNX of a heavy one's id, ZADD, PTTL: one Lua call of 1,000, no other work; "
        "5,000 light entities, 2,000 heavy; 150,000 events/s on one core needs 6.7 µs): "
        + ", ".join(
            f"{shape} {ours:.1f} µs against {alone:.1f} ({ours / alone:.2f}x)" for shape, (ours, alone) in floor.items()
        )
    )
    print(
        f"  pushes of 1,000 events for {args.pack_seconds:g} s into a view whose longest window is 5 min (tiles of 1 s, "
        "so they end as it runs), the pushes packing and summarizing the tiles they wrote (the default) against "
        "not (online_store.pack_pushes: false): events/s, Redis CPU and the pushing process's CPU an event, Redis "
        "memory an event at the end:"
    )
    for cards in sorted({c for c, _ in packing}):
        on, off = packing[cards, True], packing[cards, False]
        print(
            f"    {cards:,} cards: {on[0]:,.0f} against {off[0]:,.0f} events/s ({on[0] / off[0]:.2f}x), Redis "
            f"{on[1]:.1f} against {off[1]:.1f} µs, the pusher {on[2]:.1f} against {off[2]:.1f} µs, "
            f"{on[3]:.1f} against {off[3]:.1f} bytes"
        )
    print(
        "  memory of a card's events, bytes per event (MEMORY USAGE of its events and blocks, ids and tile summaries):"
    )
    print("    events  " + "".join(f"{name:>16}" for name in LAYOUTS) + "   never packed / packed")
    for n, sizes in memory.items():
        print(
            f"    {n:>6,}  "
            + "".join(f"{sizes[name] / n:>16.1f}" for name in LAYOUTS)
            + f"   {sizes['never packed'] / sizes['packed']:.1f}x"
        )
    print(
        "  a card a window on (its previous window's events gone, their writes still recorded: a light card's in its "
        "ledger, a heavy one's by its old blocks), bytes per event in the window: "
        + ", ".join(f"{n:,} events {a / n:.1f} (fresh {f / n:.1f})" for n, (f, a) in steady.items())
    )
    for name, sizes in shorter.items():
        print(
            f"    with a dedup window of {name} (writes of an id further apart are two events): "
            + ", ".join(f"{n:,} events {a / n:.1f} (fresh {f / n:.1f})" for n, (f, a) in sizes.items())
        )
    print("featurestore capacity on this store (sizing 100M cards x 100 events, 20,000 lookups/s, 150,000 events/s):")
    report = measured.describe(10**8, 100, capacity.parse_size("25GB"), 20_000, 150_000)
    print("  " + report.replace("\n", "\n  "))


LAYOUTS = {  # how memory_by_layout writes a card: ids, times' unit (µs), Redis's compact value limit, packing
    "packed": ("tx_id", 10**6, 1024, True),
    "µs times": ("tx_id", 1, 1024, True),
    "random ids": ("random", 10**6, 1024, True),
    "Redis defaults": ("tx_id", 10**6, 64, True),
    "never packed": ("tx_id", 10**6, 1024, False),
}


# cards, events each over the past 7 d: packed into ~6 blocks a card, of ~60 and of ~15 events
INTO_BLOCKS = [(200, 400), (2000, 100)]


def ingest_into_blocks(
    store, first_card: int, cards: int, per: int, rng, now: datetime
) -> list[tuple[float, float, float]]:
    """New events streamed into cards whose events are packed (a write checks the blocks a dedup
    window either side, where their id filters let its id through): per round, events/s, Redis's
    script CPU per event (``INFO commandstats``) and block reads (``ZRANGEBYSCORE``) per event."""
    client = store.online_store.client
    n = cards * per
    ts = pa.array([now - timedelta(seconds=int(s)) for s in rng.integers(60, 7 * 86400 - 60, n)], TS)
    store.push(
        "payments",
        pa.table(
            {
                "tx_id": np.arange(n, dtype=np.int64) + 10**12,
                "card_id": np.repeat(np.arange(first_card, first_card + cards), per),
                "amount": np.round(rng.lognormal(3.5, 1.1, n), 2),
                "event_timestamp": ts,
            }
        ),
        to="online",
    )
    out = []
    for k in range(4):
        first = 10**12 + n + k * 5000
        table = pa.table(
            {
                "tx_id": np.arange(first, first + 5000, dtype=np.int64),
                "card_id": rng.integers(first_card, first_card + cards, 5000),
                "amount": np.round(rng.lognormal(3.5, 1.1, 5000), 2),
                "event_timestamp": pa.array([datetime.now(UTC)] * 5000, TS),
            }
        )
        before = client.info("commandstats")
        t0 = time.perf_counter()
        for b in range(5):
            store.push("payments", table.slice(b * 1000, 1000), to="online")
        rate = 5000 / (time.perf_counter() - t0)
        after = client.info("commandstats")

        def grew(name: str, field: str) -> float:
            return (after.get(name, {}).get(field, 0) - before.get(name, {}).get(field, 0)) / 5000

        out.append((rate, grew("cmdstat_evalsha", "usec"), grew("cmdstat_zrangebyscore", "calls")))
    return out


def pushes_packing(seconds: float, seed: int) -> dict[tuple[int, bool], tuple[float, float, float, float]]:
    """Pushes of 1,000 new events for ``seconds`` into 2,000 and into 20,000 cards of a view whose
    longest window is 5 min (tiles of 1 s, so tiles end while it runs: ~20 and ~2 events a card a
    tile), with the pushes' packing on and off (``online_store.pack_pushes``), each on its own
    embedded Redis: ``{(cards, on): (events/s, Redis CPU µs an event, the pushing process's CPU µs
    an event, Redis memory bytes an event at the end)}``."""
    import tempfile

    from featurestore import FeatureStore

    out = {}
    for cards in (2_000, 20_000):
        for on in (False, True):
            root = Path(tempfile.mkdtemp(prefix="bench-agg-packing-"))
            write_repo(root, windows={"5m": 300}, online=f"pack_pushes: {str(on).lower()}")
            rng = np.random.default_rng(seed)
            with FeatureStore(root) as store:
                store.apply()
                client, n = store.online_store.client, 0
                memory, cpu = client.info("memory")["used_memory"], client.info("cpu")
                started, process = time.perf_counter(), time.process_time()
                while time.perf_counter() - started < seconds:
                    rows = {
                        "tx_id": np.arange(n, n + 1000, dtype=np.int64),
                        "card_id": rng.integers(1, cards + 1, 1000),
                        "amount": np.round(rng.lognormal(3.5, 1.1, 1000), 2),
                        "event_timestamp": pa.array([datetime.now(UTC)] * 1000, TS),
                    }
                    store.push("payments", pa.table(rows), to="online")
                    n += 1000
                rate = n / (time.perf_counter() - started)
                store.pack_pushed(wait=True)
                after = client.info("cpu")
                redis_s = sum(after[k] - cpu[k] for k in ("used_cpu_user", "used_cpu_sys"))
                pushing_s = time.process_time() - process
                grown = client.info("memory")["used_memory"] - memory
                out[cards, on] = (rate, redis_s / n * 1e6, pushing_s / n * 1e6, grown / n)
    return out


# the commands a new event's write cannot do without, from one Lua call and nothing else: its
# entity's ids hash read (the mark and block list, the id's writes, when it was last trimmed), a
# light entity's members or a heavy one's id recorded, the event added, its key's expiry read
FLOOR = """
for k = 1, #KEYS do
  local events, event = KEYS[k], ARGV[7 + #KEYS + k]
  local ids, id = events .. '|ids', string.sub(event, 1, 8)
  redis.call('HMGET', ids, '', id, 't')
  if LIGHT then redis.call('ZRANGE', events, 0, 17) else redis.call('HSETNX', ids, id, string.sub(event, 9, 16)) end
  redis.call('ZADD', events, ARGV[7 + k], event)
  redis.call('PTTL', events)
end
return #KEYS
"""


def write_path_floor(client, limit: int, seed: int) -> dict[str, tuple[float, float]]:
    """Redis's script CPU per new event: ``add_events.lua`` against ``FLOOR`` (its commands alone),
    each on its own entities (5,000 light ones of 8 plain events, 12 at the end; 2,000 heavy ones of
    20), 20 calls of 1,000 events now; scratch keys, deleted afterwards."""
    import random

    from featurestore.online.lua import scripts

    rnd, now_us = random.Random(seed), time.time_ns() // 1000
    add = scripts()["add_events"].code
    head = [0, 8 * 86_400_000, 8 * 86_400_000 // 16, 3_600_000_000, 8 * 86_400_000_000, 0, limit]
    out, next_id = {}, 0

    def call(code: str, writes: list[tuple[bytes, int]]) -> None:
        nonlocal next_id
        members = []
        for _, us in writes:
            members.append(next_id.to_bytes(8, "big") + (us + (1 << 63)).to_bytes(8, "big") + rnd.randbytes(9))
            next_id += 1
        client.eval(code, len(writes), *[k for k, _ in writes], *head, *[us for _, us in writes], *members)

    def usec() -> int:
        return client.info("commandstats").get("cmdstat_eval", {}).get("usec", 0)

    for shape, entities, per in (("light", 5000, 8), ("heavy", 2000, 20)):
        timed = {}
        for name, code in (
            ("add_events.lua", add),
            ("its commands alone", FLOOR.replace("LIGHT", str(shape == "light").lower())),
        ):
            keys = [b"bench-floor:{%d}:ev" % i for i in range(entities)]
            for i in range(0, entities, 100):  # (made by add_events.lua either way: the layout the writes meet)
                call(
                    add,
                    [
                        (key, now_us - rnd.randrange(60, 6 * 86400) * 10**6)
                        for key in keys[i : i + 100]
                        for _ in range(per)
                    ],
                )
            before = usec()
            for _ in range(20):
                call(code, [(rnd.choice(keys), time.time_ns() // 1000) for _ in range(1000)])
            timed[name] = (usec() - before) / 20_000
            for i in range(0, entities, 500):
                client.delete(*[k + suffix for k in keys[i : i + 500] for suffix in (b"", b"|ids", b"|tiles")])
        out[shape] = (timed["add_events.lua"], timed["its commands alone"])
    return out


def a_window_on(store, first_card: int, rng) -> dict[int, tuple[int, int]]:
    """Bytes a card of 10 and of 1,000 events takes, fresh and a window on: its previous window's
    events written by a writer a window earlier, then this window's, then its ended tiles packed
    (``pack_online``). The old events are gone from the window, but their writes stay recorded
    for the duplicate rule a dedup window (the longest window): a light card's in its ledger
    (``scripts/_blocks.lua``), a heavy one's by its old blocks."""
    from featurestore.online.base import EVENT_SCORES

    client, view = store.online_store.client, store.get_feature_view("activity")
    schema, field = store.definitions.history_schema(view), store.layout("activity").online_field.encode()
    now, out, card = datetime.now(UTC), {}, first_card
    for n in (10, 1_000):
        sizes = []
        for writers in ([now], [now - timedelta(days=7), now]):
            card += 1
            for k, writer in enumerate(writers):
                ts = pa.array([writer - timedelta(seconds=int(s)) for s in rng.integers(3600, 7 * 86400 - 3600, n)], TS)
                ids = pa.array(np.arange(n, dtype=np.int64) + card * 10**6 + n * k)
                amounts = pa.array(np.round(rng.lognormal(3.5, 1.1, n), 2))
                cards = pa.array(np.full(n, card))
                rows = {"card_id": cards, "event_timestamp": ts, "created_timestamp": ts, "_run_id": pa.array([k] * n)}
                rows |= {"_row_id": pa.array(np.arange(n)), "tx_id": ids, "amount": amounts}
                store.materializer().write_online(view, pa.table(rows).cast(schema), writer)
                pushed = pa.table({"tx_id": ids, "card_id": cards, "amount": amounts, "event_timestamp": ts})
                store.pack_online_entities("payments", pushed)
            key = b"fs:%s:{card_id=%d}:ev:%s" % (store.config.project.encode(), card, field)
            assert client.zcount(key, *EVENT_SCORES) > 0
            sizes.append(
                sum(client.memory_usage(part, samples=0) or 0 for part in (key, key + b"|ids", key + b"|tiles"))
            )
        out[n] = (sizes[0], sizes[1])
    return out


def memory_by_layout(store, first_card: int, rng, now: datetime) -> dict[int, dict[str, int]]:
    """Bytes a card's events take for 10, 100, 1,000 and 50,000 events in the 7 d window (amounts
    in cents, as the other cards), by ``LAYOUTS``: packed (the default: integer ids, times whole
    seconds apart, the embedded server's compact sorted sets up to 1 KB values), with times any µs
    apart, with random 64-bit ids (content hashes), on a Redis with its default 64-byte limit, and
    never packed."""
    from featurestore.online import packed, redis_store
    from featurestore.online.base import EVENT_SCORES

    client, blocks, online = store.online_store.client, redis_store._written_groups, store.online_store
    out: dict[int, dict[str, int]] = {}
    card = first_card
    for n in (10, 100, 1_000, 50_000):
        ts = pa.array([now - timedelta(seconds=int(s)) for s in rng.integers(60, 7 * 86400 - 60, n)], TS)
        amounts = np.round(rng.lognormal(3.5, 1.1, n), 2)
        out[n] = {}
        any_micros = pa.array(ts.cast(pa.int64()).to_numpy() + rng.integers(0, 10**6, n)).cast(TS)
        for name, (ids, unit, limit, packing) in LAYOUTS.items():
            card += 1
            redis_store._written_groups = blocks if packing else lambda *a: []
            for setting in ("zset-max-ziplist-value", "hash-max-ziplist-value"):
                client.config_set(setting, limit)
            online._zset_value_limit = None  # (read again)
            try:
                tx_ids = np.arange(n, dtype=np.int64) + card * 10**6
                if ids == "random":
                    tx_ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
                times = ts if unit == 10**6 else any_micros
                table = pa.table(
                    {"tx_id": tx_ids, "card_id": np.full(n, card), "amount": amounts, "event_timestamp": times}
                )
                store.push("payments", table, to="online")
            finally:
                redis_store._written_groups = blocks
                for setting in ("zset-max-ziplist-value", "hash-max-ziplist-value"):
                    client.config_set(setting, 1024)
                online._zset_value_limit = None
            key = b"fs:%s:{card_id=%d}:ev:%s" % (
                store.config.project.encode(),
                card,
                store.layout("activity").online_field.encode(),
            )
            assert packed.event_count(client.zrangebyscore(key, *EVENT_SCORES)) == n
            parts = (key, key + b"|ids", key + b"|tiles")
            out[n][name] = sum(client.memory_usage(part, samples=0) or 0 for part in parts)
    return out


@contextlib.contextmanager
def write_sealing(on: bool) -> Iterator[None]:
    """Writes seal the ended tiles they hold (``on``, the default), or leave them to the first lookups."""
    from featurestore.materialization import online_write

    sealer = online_write.sealer
    if not on:
        online_write.sealer = lambda view, storage_id: None  # type: ignore[assignment]
    try:
        yield
    finally:
        online_write.sealer = sealer


def loop_stalls(
    store, refs: list[str], first_card: int, rng, now: datetime
) -> dict[str, tuple[list[float], list[float]]]:
    """A cold heavy card's first lookups through ``OnlineReader.read_async`` while a ticker task runs on
    the same event loop: the longest gap between its ticks is how long the loop could not answer
    anything else. Assembling on the loop (as before) and off it (past ``OFF_LOOP_EVENTS``)."""
    import asyncio

    from featurestore.retrieval.online import OnlineQuery, OnlineReader
    from featurestore.retrieval.online import reader as online

    n = 50_000
    for card in (first_card, first_card + 1):
        ts = [now - timedelta(seconds=int(s)) for s in rng.integers(60, 7 * 86400 - 60, n)]
        with write_sealing(False):  # (cold: its lookups summarize)
            store.push(
                "payments",
                pa.table(
                    {
                        "tx_id": np.arange(n, dtype=np.int64) + card * 10**7,
                        "card_id": np.full(n, card),
                        "amount": np.round(rng.lognormal(3.5, 1.1, n), 2),
                        "event_timestamp": pa.array(ts, TS),
                    }
                ),
                to="online",
            )
    threshold, out = online.OFF_LOOP_EVENTS, {}
    reader = OnlineReader(store.online_store)

    async def measure() -> None:
        gaps: list[float] = []
        running = True

        async def ticker() -> None:
            last = time.perf_counter()
            while running:
                await asyncio.sleep(0)
                now_ = time.perf_counter()
                gaps.append(now_ - last)
                last = now_

        task = asyncio.create_task(ticker())
        for card, label, limit in (
            (first_card, "assembled on the loop ", 10**12),
            (first_card + 1, "assembled off the loop", threshold),
        ):
            online.OFF_LOOP_EVENTS = limit
            lookups, stalls = [], []
            for _ in range(3):
                gaps.clear()
                t0 = time.perf_counter()
                q = OnlineQuery.prepare(store.definitions, store.config.project, [{"card_id": card}], refs, None, False)
                await reader.read_async(q)
                await reader.drain()
                lookups.append((time.perf_counter() - t0) * 1000)
                stalls.append(max(gaps) * 1000)
            out[label] = (lookups, stalls)
        running = False
        await task

    try:
        asyncio.run(measure())
    finally:
        online.OFF_LOOP_EVENTS = threshold
    return out


def http_push(root: Path, first_id: int, n_cards: int, n: int) -> dict[str, list[float]]:
    """One-event ``POST /push`` to a feature server process on the same repo, each target in turn."""
    import os

    from online import HttpClient, free_port, start

    port = free_port()
    server = start(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "serve",
            "--repo",
            str(root),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        dict(os.environ),
        port,
    )
    times: dict[str, list[float]] = {"online": [], "online_and_offline": []}
    try:
        client = HttpClient(port)
        for i in range(2 * n + 50):
            to = "online" if i < n + 50 else "online_and_offline"
            body = json.dumps(
                {
                    "push_source_name": "payments",
                    "to": to,
                    "df": {
                        "tx_id": [first_id + i],
                        "card_id": [1 + i % n_cards],
                        "amount": [12.5],
                        "event_timestamp": [datetime.now(UTC).isoformat()],
                    },
                }
            ).encode()
            t0 = time.perf_counter()
            client.post("/push", body)
            if i >= 50:  # after warm-up
                times[to].append(time.perf_counter() - t0)
    finally:
        server.terminate()
        server.wait(timeout=30)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--entity-rows", type=int, default=1_000_000)
    parser.add_argument("--online-cards", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=300)
    parser.add_argument("--pushes", type=int, default=1000, help="one-event pushes timed per target and path")
    parser.add_argument("--stream-seconds", type=float, default=12, help="how long the one-event push stream runs")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument(
        "--pack-seconds", type=float, default=60, help="how long pushes run, per shape, with their packing and without"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip", choices=["offline", "online"])
    parser.add_argument("--data-dir", type=Path, default=HERE.parent / ".data" / "aggregations")
    parser.add_argument("--child", choices=["ours", "reference"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps((run_ours if args.child == "ours" else run_reference)(args.data_dir)))
        return
    if args.skip != "offline":
        offline(args)
    if args.skip != "online":
        online(args)


if __name__ == "__main__":
    main()
