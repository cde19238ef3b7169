"""Small writes to a latest-values view: a push of 1 and 10 rows and Feast's ``write_to_online_store``
of 1 row (typed, ordered, compare-and-set in Redis), against redis-py writing the same encoded
values by hand (an HSET, a pipeline of 10); and a push of 1 event to an aggregated view against
redis-py sending the script call it makes (``add_events.lua``, captured from a push, each time
with a new event id and card); in the same run, alternating.

A REST push or a stream's entries are a few rows at a time: what each write costs beyond its
round trip is the store's own work.

    python benchmarks/small_writes.py [--writes 500]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentiles  # noqa: E402

DEFS = """
from datetime import timedelta
from featurestore import Aggregation, Entity, FeatureView, Field, PushSource
from featurestore.types import *

user = Entity(name="user", join_keys=["user_id"], value_type=Int64)
FIELDS = [Field("f1", Float64), Field("f2", Float64), Field("f3", Int64), Field("f4", String), Field("f5", Bool)]
pushed = PushSource(name="user_push", schema=[Field("user_id", Int64), *FIELDS, Field("event_timestamp", UnixTimestamp)])
stats = FeatureView(name="stats", entities=[user], source=pushed, schema=FIELDS)

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
payments = PushSource(name="payments", schema=[Field("tx_id", Int64), Field("card_id", Int64), Field("amount", Float64),
                                               Field("event_timestamp", UnixTimestamp)])
activity = FeatureView(name="activity", entities=[card], source=payments, event_id="tx_id",
    schema=[Field("tx_id", Int64), Field("amount", Float64)],
    aggregations=[Aggregation("count", timedelta(hours=1)), Aggregation("sum", timedelta(days=1), "amount"),
                  Aggregation("max", timedelta(days=7), "amount")])
"""
CARDS = 2000  # the cards one-event pushes spread over


def rows(first: int, n: int) -> pa.Table:
    rng = np.random.default_rng(first)
    return pa.table(
        {
            "user_id": np.arange(first, first + n, dtype=np.int64),
            "f1": rng.normal(size=n),
            "f2": rng.normal(size=n),
            "f3": rng.integers(0, 1000, n),
            "f4": [f"s{i}" for i in range(n)],
            "f5": rng.integers(0, 2, n).astype(bool),
            "event_timestamp": pa.array([datetime.now(UTC)] * n, pa.timestamp("us", tz="UTC")),
        }
    )


def payment(i: int) -> pa.Table:
    return pa.table(
        {
            "tx_id": [i],
            "card_id": [i % CARDS],
            "amount": [float(i % 1000) / 10],
            "event_timestamp": pa.array([datetime.now(UTC)], pa.timestamp("us", tz="UTC")),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=500)
    args = parser.parse_args()
    os.environ.pop("REDIS_URL", None)

    from featurestore import FeatureStore
    from featurestore.online.codec import encode_values, entity_keys
    from featurestore.online.lua import scripts

    root = Path(tempfile.mkdtemp(prefix="bench-small-writes-"))
    (root / "featurestore.yaml").write_text("project: bench_small\nmodules: [features.py]\n")
    (root / "features.py").write_text(DEFS)
    with FeatureStore(root) as store:
        store.apply()
        client = store.online_store.client
        view = store.get_feature_view("stats")
        features = [(f.name, f.dtype) for f in view.schema]
        field = store.definitions.layout(view).online_field

        def ours_push(n: int):
            return lambda i: store.push("user_push", rows(i * n, n), to="online")

        def ours_write(i: int) -> None:
            store.write_to_online_store("stats", rows(10**7 + i, 1))

        def raw(n: int):  # the same keys and encoded values, written by hand
            def write(i: int) -> None:
                table = rows(2 * 10**7 + i * n, n)  # (a stored value carries its order key: created, run, row id)
                table = table.append_column("created_timestamp", table["event_timestamp"])
                table = table.append_column("_run_id", pa.array(np.full(n, i), pa.int64()))
                table = table.append_column("_row_id", pa.array(np.arange(n), pa.int64()))
                keys = entity_keys("bench_small", table, ["user_id"]).to_pylist()
                values = encode_values(table, features).to_pylist()
                pipe = client.pipeline(transaction=False)
                for key, value in zip(keys, values):
                    pipe.hset(key, field, value)
                pipe.execute()

            return write

        def ours_event(i: int) -> None:
            store.push("payments", payment(i), to="online")

        events_call = captured_add_events(store, payment(3 * 10**7))
        name, keys, arguments, (scores, events) = events_call
        suffix = keys[0].as_py()[len(entity_keys("bench_small", payment(3 * 10**7), ["card_id"])[0].as_py()) :]
        card_keys = [
            k + suffix for k in entity_keys("bench_small", pa.table({"card_id": range(CARDS)}), ["card_id"]).to_pylist()
        ]
        sha, score, member = scripts()[name].sha, scores[0].as_py(), events[0].as_py()

        def raw_event(i: int) -> None:  # the script call a push sends, of a new event id and card
            event_id = 4 * 10**7 + i
            event = event_id.to_bytes(8, "big") + member[8:]
            client.evalsha(sha, 1, card_keys[event_id % CARDS], *arguments, score, event)

        cases = {
            "push of 1 event (aggregated)": (ours_event, raw_event),
            "push of 1 row": (ours_push(1), raw(1)),
            "push of 10 rows": (ours_push(10), raw(10)),
            "write_to_online_store of 1 row": (ours_write, raw(1)),
        }
        for ours, by_hand in cases.values():  # warm: imports, scripts, connections
            for i in range(20):
                ours(10**6 + i)
                by_hand(10**6 + i)
        timings: dict[tuple[str, str], list[float]] = {}
        for name, (ours, by_hand) in cases.items():
            for i in range(args.writes):
                for kind, write in (("ours", ours), ("raw", by_hand)):
                    t0 = time.perf_counter()
                    write(i)
                    timings.setdefault((name, kind), []).append(time.perf_counter() - t0)
    print(
        f"small writes to a latest-values view of 5 features and an aggregated view of 3, {args.writes} each, p50 (p99) ms:"
    )
    for name in cases:
        a, b = percentiles(timings[(name, "ours")]), percentiles(timings[(name, "raw")])
        print(
            f"  {name:<32} ours {a['p50']:.3f} ({a['p99']:.3f})   redis-py by hand {b['p50']:.3f} ({b['p99']:.3f})   "
            f"{a['p50'] / b['p50']:.2f}x"
        )


def captured_add_events(store, table: pa.Table) -> tuple:
    """The ``add_events.lua`` call a push of ``table`` sends (script, keys, arguments, per-key columns)."""
    from featurestore.online import redis_single

    sent, send = [], redis_single.evalsha
    redis_single.evalsha = lambda call: (sent.append(call), send(call))[1]
    try:
        store.push("payments", table, to="online")
    finally:
        redis_single.evalsha = send
    return next(call for call in sent if call[0] == "add_events")


if __name__ == "__main__":
    main()
