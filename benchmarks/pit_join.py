"""Point-in-time join: `get_historical_features(...)` vs a hand-written DuckDB ASOF JOIN.

Seeded data, stored once as a Delta table (the reference reads the same Parquet files), in
one of two shapes:

  mixed       100k entities, 5M history rows in random order, 10 features of mixed types,
              ttl 30 days, output an Arrow table (the default);
  append-log  the shape of issue 15: 5M history rows sorted by event time like an append
              log, 1 % of rows tied on (entity, event time) with a different created time,
              8 float64 + 1 int64 + 1 string features, ttl 7 days, output a pandas DataFrame.

Both: 1M entity rows in random order. Each side runs in its own fresh process, so wall time
and peak RSS are its own. Usage:

    python benchmarks/pit_join.py [--shape append-log]
    python benchmarks/pit_join.py --history 500000 --entity-rows 100000 --entities 10000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_rss_mb, run_child  # noqa: E402

HERE = Path(__file__).resolve()
START = datetime(2024, 1, 1, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")
MIXED = [
    ("f_f64_a", "Float64"),
    ("f_f64_b", "Float64"),
    ("f_f64_c", "Float64"),
    ("f_f32_a", "Float32"),
    ("f_f32_b", "Float32"),
    ("f_i64_a", "Int64"),
    ("f_i64_b", "Int64"),
    ("f_i32", "Int32"),
    ("f_str", "String"),
    ("f_bool", "Bool"),
]
APPEND_LOG = [*((f"f_f64_{c}", "Float64") for c in "abcdefgh"), ("f_i64_a", "Int64"), ("f_str", "String")]
SHAPES = {"mixed": (MIXED, 30), "append-log": (APPEND_LOG, 7)}  # features, ttl days

DEFS = """
from datetime import timedelta
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import *

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
src = PushSource(name="src", schema=[Field("user_id", Int64), Field("event_timestamp", UnixTimestamp), {fields}])
stats = FeatureView(name="stats", entities=[user], source=src, ttl=timedelta(days={ttl}), schema=[{fields}])
"""


def setup(root: Path, shape: str, entities: int, history: int, entity_rows: int, seed: int) -> None:
    from featurestore import FeatureStore

    features, ttl_days = SHAPES[shape]
    fields = ", ".join(f'Field("{n}", {t})' for n, t in features)
    root.mkdir(parents=True, exist_ok=True)
    (root / "featurestore.yaml").write_text("project: bench_pit\nmodules: [features.py]\n")
    (root / "features.py").write_text(DEFS.replace("{fields}", fields).replace("{ttl}", str(ttl_days)))
    rng = np.random.default_rng(seed)
    span = 90 * 86_400 * 10**6
    start_us = int(START.timestamp() * 1e6)
    if shape == "append-log":
        table = _append_log(rng, entities, history, start_us, span)
    else:
        table = _mixed(rng, entities, history, start_us, span)
    store = FeatureStore(root)
    store.apply()
    store.offline_store.append("stats", table.cast(store.definitions.history_schema(store.get_feature_view("stats"))))
    entity = pa.table(
        {
            "user_id": rng.integers(1, int(entities * 1.1) + 1, entity_rows),
            "event_timestamp": pa.array(
                start_us + rng.integers(0, span + 10 * 86_400 * 10**6, entity_rows), pa.int64()
            ).cast(TS),
            "label": rng.integers(0, 2, entity_rows).astype(np.int32),
        }
    )
    import pyarrow.parquet as pq

    pq.write_table(entity, root / "entities.parquet")


def _append_log(rng: np.random.Generator, entities: int, history: int, start_us: int, span: int) -> pa.Table:
    """Rows sorted by event time; 1 % repeat an earlier row's (entity, event time) with a later created time."""
    users = rng.integers(1, entities + 1, history)
    event = start_us + rng.integers(0, span, history)
    created = event + rng.integers(0, 10**6, history)
    tied = rng.random(history) < 0.01
    users[tied], event[tied] = np.roll(users, 1)[tied], np.roll(event, 1)[tied]  # same key and time as the row before
    created[tied] = event[tied] + rng.integers(10**6, 2 * 10**6, int(tied.sum()))
    order = np.argsort(event, kind="stable")
    f64 = {f"f_f64_{c}": rng.normal(size=history) for c in "abcdefgh"}  # i.i.d.: no reordering needed
    return pa.table(
        {
            "user_id": users[order],
            "event_timestamp": pa.array(event[order], pa.int64()).cast(TS),
            "created_timestamp": pa.array(created[order], pa.int64()).cast(TS),
            "_run_id": np.ones(history, np.int64),
            "_row_id": np.arange(history, dtype=np.int64),
            **f64,
            "f_i64_a": rng.integers(0, 10**6, history),
            "f_str": pa.array(rng.integers(0, 100, history).astype(str)),
        }
    )


def _mixed(rng: np.random.Generator, entities: int, history: int, start_us: int, span: int) -> pa.Table:
    # whole seconds: equal event times (ties) happen, as in real data
    event = start_us + rng.integers(0, span // 10**6, history) * 10**6
    return pa.table(
        {
            "user_id": rng.integers(1, entities + 1, history),
            "event_timestamp": pa.array(event, pa.int64()).cast(TS),
            "created_timestamp": pa.array(event + rng.integers(0, 3, history) * 10**6, pa.int64()).cast(TS),
            "_run_id": np.ones(history, np.int64),
            "_row_id": rng.permutation(history).astype(np.int64),
            "f_f64_a": rng.normal(size=history),
            "f_f64_b": rng.normal(size=history),
            "f_f64_c": rng.normal(size=history),
            "f_f32_a": rng.normal(size=history).astype(np.float32),
            "f_f32_b": rng.normal(size=history).astype(np.float32),
            "f_i64_a": rng.integers(0, 10**6, history),
            "f_i64_b": rng.integers(0, 10**6, history),
            "f_i32": rng.integers(0, 1000, history).astype(np.int32),
            "f_str": pa.array(rng.integers(0, 100, history).astype(str)),
            "f_bool": rng.random(history) < 0.5,
        }
    )


def run_ours(root: Path, shape: str, engine: str = "local") -> dict:
    import os

    import pyarrow.parquet as pq

    from featurestore import FeatureStore
    from featurestore.config import RepoConfig

    if engine == "ray":  # a local Ray cluster on every core, started (untimed) before the join
        import ray

        ray.init(num_cpus=os.cpu_count(), log_to_driver=False, include_dashboard=False)
    store = FeatureStore(root, RepoConfig.load(root).with_engine(engine))
    store.definitions
    entity = pq.read_table(root / "entities.parquet")
    refs = [f"stats:{n}" for n, _ in SHAPES[shape][0]]
    if engine == "ray":  # warm: workers started and importing, as on a cluster already serving
        store.get_historical_features(entity.slice(0, 1000), features=refs).to_arrow()
    t0 = time.perf_counter()
    job = store.get_historical_features(entity, features=refs)
    result = job.to_df() if shape == "append-log" else job.to_arrow()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": len(result), "checksum": _checksum(result), "peak_rss_mb": peak_rss_mb()}


REFERENCE = """
WITH latest AS (
    SELECT user_id, CAST(event_timestamp AS TIMESTAMP) AS ev, {features} FROM read_parquet({files})
    QUALIFY row_number() OVER (PARTITION BY user_id, event_timestamp ORDER BY created_timestamp DESC, _run_id DESC, _row_id DESC) = 1
), e AS (
    SELECT *, CAST(event_timestamp AS TIMESTAMP) AS t, row_number() OVER () AS rn FROM entities
)
SELECT e.user_id, e.event_timestamp, e.label, {ttl_features}
FROM e ASOF LEFT JOIN latest l ON e.user_id = l.user_id AND e.t >= l.ev
ORDER BY e.rn
"""


def run_reference(root: Path, shape: str) -> dict:
    import duckdb
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    entities = pq.read_table(root / "entities.parquet")  # noqa: F841 - scanned by name
    files = "[" + ", ".join(f"'{f}'" for f in DeltaTable(str(root / "data" / "offline" / "stats")).file_uris()) + "]"
    features, ttl_days = SHAPES[shape]
    names = [n for n, _ in features]
    sql = REFERENCE.format(
        features=", ".join(names),
        files=files,
        ttl_features=", ".join(
            f"CASE WHEN l.ev >= e.t - INTERVAL {ttl_days} DAYS THEN l.{n} END AS {n}" for n in names
        ),
    )
    t0 = time.perf_counter()
    result = con.sql(sql).df() if shape == "append-log" else con.sql(sql).to_arrow_table()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows": len(result), "checksum": _checksum(result), "peak_rss_mb": peak_rss_mb()}


def _checksum(table) -> str:
    """A few sums that differ if any row joined a different history row (Arrow table or pandas frame)."""
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table[["f_i64_a", "f_f64_a"]], preserve_index=False)
    import pyarrow.compute as pc

    parts = [
        str(pc.sum(pc.cast(table["f_i64_a"], pa.float64())).as_py()),
        str(table["f_f64_a"].null_count),
        str(table.num_rows),
    ]
    return "/".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixed", help="data shape (see above)")
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--history", type=int, default=5_000_000)
    parser.add_argument("--entity-rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--data-dir", type=Path, default=HERE.parent / ".data" / "pit_join")
    parser.add_argument("--ray", action="store_true", help="Also time the Ray engine (a local cluster on every core).")
    parser.add_argument("--child", choices=["ours", "reference", "ray"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run = {"ours": run_ours, "reference": run_reference, "ray": lambda root, shape: run_ours(root, shape, "ray")}[
            args.child
        ]
        print(json.dumps(run(args.data_dir, args.shape)))
        return
    tag = f"{args.shape}-{args.entities}-{args.history}-{args.entity_rows}-{args.seed}"
    root = args.data_dir / tag
    if not (root / "entities.parquet").exists():
        print(
            f"generating {args.history:,} history rows for {args.entities:,} entities, {args.entity_rows:,} entity rows ..."
        )
        t0 = time.perf_counter()
        setup(root, args.shape, args.entities, args.history, args.entity_rows, args.seed)
        print(f"  written in {time.perf_counter() - t0:.1f}s to {root}")
    results = {}
    for side in (
        "reference",
        "ours",
        *(["ray"] if args.ray else []),
        "reference",
        "ours",
        *(["ray"] if args.ray else []),
    ):  # interleaved; best of two each
        r = run_child(str(HERE), "--child", side, "--data-dir", str(root), "--shape", args.shape)
        if side not in results or r["seconds"] < results[side]["seconds"]:
            results[side] = {**r, "peak_rss_mb": max(r["peak_rss_mb"], results.get(side, {}).get("peak_rss_mb", 0))}
    ours, ref = results["ours"], results["reference"]
    assert ours["rows"] == ref["rows"] == args.entity_rows, (ours, ref)
    print(f"{'':24}{'wall s':>10}{'peak RSS MB':>14}")
    print(f"{'hand-written ASOF SQL':24}{ref['seconds']:>10.2f}{ref['peak_rss_mb']:>14.0f}")
    print(f"{'get_historical_features':24}{ours['seconds']:>10.2f}{ours['peak_rss_mb']:>14.0f}")
    print(
        f"ratio (ours / reference): time {ours['seconds'] / ref['seconds']:.2f}x, peak RSS {ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x"
    )
    print(f"results agree: {ours['checksum'] == ref['checksum']} ({ours['checksum']})")
    if args.ray:
        on_ray = results["ray"]
        print(
            f"{'Ray engine':24}{on_ray['seconds']:>10.2f}{on_ray['peak_rss_mb']:>14.0f}  (driver's RSS; workers not counted)"
        )
        print(
            f"ratio (Ray / local engine): time {on_ray['seconds'] / ours['seconds']:.2f}x; "
            f"results agree: {on_ray['checksum'] == ours['checksum']}"
        )


if __name__ == "__main__":
    main()
