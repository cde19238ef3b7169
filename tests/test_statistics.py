"""Feature statistics: exact figures equal a naive computation on random data, sketches within
their documented error, summaries merge like their union, and the history's statistics equal its
rows after materializations, pushes, compaction, re-runs and a failure between a commit and its
statistics."""

from __future__ import annotations

import math
import shutil
import threading
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featurestore import statistics as fs_stats
from featurestore.sources import connection
from featurestore.statistics import DAY, HOUR, RANK_ERROR, from_table, merged, summarize, summarize_column

from .test_aggregations import FEATURES, _frame

numbers = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(-1e6, 1e6),
    st.sampled_from([0.0, -0.0, 1.0, math.inf, -math.inf]),
)


def _naive(values: list[float | None]) -> dict:
    present = [v for v in values if v is not None]
    real = [v for v in present if not math.isnan(v)]
    finite = [v for v in real if math.isfinite(v)]
    try:
        mean = sum(finite) / len(finite) if finite else None
        stddev = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite)) if finite else None
    except OverflowError:  # (float64 sums past 1.8e308: neither side is comparable)
        mean = stddev = None
    return {
        "rows": len(values),
        "nulls": len(values) - len(present),
        "nans": len(present) - len(real),
        "min": min(real) if real else None,
        "max": max(real) if real else None,
        "finite": len(finite),
        "mean": mean,
        "stddev": stddev,
    }


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * max(1.0, abs(a), abs(b)))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.lists(numbers, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=4))
def test_number_summaries_are_exact_and_merge_like_their_union(values, cuts):
    naive = _naive(values)
    pieces = [values[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(values)], strict=True)]
    whole = summarize_column(pa.array(values, pa.float64()))
    folded = fs_stats.Summary("number")
    for piece in pieces:
        folded = folded.merge(summarize_column(pa.array(piece, pa.float64())))
    for s in (whole, folded):
        assert (s.rows, s.nulls, s.nans, s.finite) == (naive["rows"], naive["nulls"], naive["nans"], naive["finite"])
        assert s.min == naive["min"] and s.max == naive["max"]
        if naive["mean"] is not None and math.isfinite(naive["mean"]):
            assert _close(s.mean, naive["mean"]) and _close(s.stddev, naive["stddev"])
        assert s.sketch is None or s.sketch.n == naive["rows"] - naive["nulls"] - naive["nans"]


def test_quantiles_and_histograms_are_within_the_sketchs_rank_error():
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.lognormal(3, 1, 150_000), rng.normal(-50, 5, 50_000)])
    pieces = np.array_split(values, 37)
    s = fs_stats.Summary("number")
    for piece in pieces:
        s = s.merge(summarize_column(pa.array(piece)))
    ordered = np.sort(values)
    ranks = np.linspace(0.01, 0.99, 25)
    for rank, q in zip(ranks, s.quantiles(ranks), strict=True):
        true_rank = np.searchsorted(ordered, q, side="left") / len(values)
        assert abs(true_rank - rank) <= RANK_ERROR, (rank, q, true_rank)
    edges = list(np.quantile(values, [0.1, 0.3, 0.5, 0.9]))
    exact = np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)
    estimated = s.histogram(edges)
    assert sum(estimated) == pytest.approx(len(values))
    for got, want in zip(estimated, exact, strict=True):
        assert abs(got - want) <= 2 * RANK_ERROR * len(values)


def test_text_summaries_count_the_top_values():
    values = ["web"] * 500 + ["pos"] * 300 + [None] * 7 + [f"rare{i}" for i in range(40)]
    s = summarize_column(pa.array(values[:400])).merge(summarize_column(pa.array(values[400:])))
    assert (s.rows, s.nulls) == (len(values), 7)
    assert s.top(2) == [("web", 500), ("pos", 300)]  # exact below the sketch's map size
    assert s.counts(["web", "card"]) == [500, 0, 340]


def test_buckets_split_by_time_and_round_trip():
    t0 = datetime(2026, 3, 1, 23, 30, tzinfo=UTC)
    times = [t0, t0 + timedelta(minutes=20), t0 + timedelta(minutes=40), t0 + timedelta(hours=3)]
    table = pa.table({"t": times, "x": [1.0, 2.0, None, 4.0], "k": ["a", "b", "a", None]})
    hourly = from_table(summarize(table, ["x", "k"], "t", HOUR))
    assert [(at.hour, name, s.rows) for at, name, s in hourly] == [
        (23, "x", 2),
        (23, "k", 2),
        (0, "x", 1),
        (0, "k", 1),
        (2, "x", 1),
        (2, "k", 1),
    ]
    daily = merged(from_table(summarize(table, ["x"], "t", DAY)))
    assert daily["x"].rows == 4 and daily["x"].nulls == 1 and daily["x"].mean == pytest.approx(7 / 3)


# ---------------------------------------------------------------- the history's statistics


def _payments(n: int, seed: int, first_id: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    now = datetime.now(UTC).replace(microsecond=0)
    rows = [
        {
            "payment_id": first_id + i,
            "card_id": int(rng.integers(1, 20)),
            "amount": None if i % 11 == 0 else float(rng.choice([np.nan, *rng.normal(40, 9, 9)])),
            "kind": None if i % 13 == 0 else str(rng.choice(["web", "pos", "atm"])),
            "event_timestamp": now - timedelta(hours=float(rng.uniform(0, 70))),
        }
        for i in range(n)
    ]
    return _frame(rows)


def _history_naive(store, view: str) -> dict[tuple[datetime, str], dict]:
    """Per event day and column, the values of every row the history table holds."""
    store.flush()
    con = connection()
    layout = store.definitions.layout(view)
    schema = store.definitions.history_schema(store.definitions.view(view))
    store.offline_store.register(con, layout.history_table, "history", schema)
    rows = con.sql("SELECT * FROM history").to_arrow_table().to_pylist()
    out: dict[tuple[datetime, str], list] = {}
    for row in rows:
        day = fs_stats.bucket_start(row["event_timestamp"], DAY)
        for column in ("card_id", "payment_id", "amount", "kind"):
            out.setdefault((day, column), []).append(row[column])
        known_after = (row["created_timestamp"] - row["event_timestamp"]).total_seconds()
        out.setdefault((day, "_known_after_s"), []).append(known_after)  # how late each row was known
    return out


def _assert_statistics_equal_history(store, view: str = "activity") -> None:
    want = _history_naive(store, view)
    found: dict[tuple[datetime, str], fs_stats.Summary] = {}
    for day, name, s in store.statistics(view):
        found[(day, name)] = found[(day, name)].merge(s) if (day, name) in found else s
    assert set(found) == set(want)
    for key, values in want.items():
        s = found[key]
        assert (s.rows, s.nulls) == (len(values), sum(v is None for v in values)), key
        if key[1] in ("amount", "_known_after_s"):
            naive = _naive(values)
            assert (s.nans, s.min, s.max) == (naive["nans"], naive["min"], naive["max"]), key
            assert naive["mean"] is None or _close(s.mean, naive["mean"]), key
        if key[1] == "kind":
            counted = {k: sum(v == k for v in values) for k in {"web", "pos", "atm"}}
            assert dict(s.top()) == {k: n for k, n in counted.items() if n}, key


def test_history_statistics_equal_its_rows_after_pushes_reruns_and_compaction(make_store, storage):
    store = make_store(FEATURES, storage=storage)  # on disk, and on a real S3-compatible server
    store.push("payments", _payments(300, seed=1), to="offline")
    store.push("payments", _payments(200, seed=2, first_id=300), to="offline")
    store.push("payments", _payments(100, seed=1), to="offline")  # a retry: rows the history holds
    _assert_statistics_equal_history(store)
    store.materialize(None, datetime.now(UTC))  # from the push log: rows the history holds already
    store.compact()  # rows move between files: counted once
    _assert_statistics_equal_history(store)


def test_statistics_tables_compacted_past_their_bound_still_count_each_commit_once(make_store, monkeypatch):
    from featurestore.offline import statistics as commit_statistics

    monkeypatch.setattr(commit_statistics, "COMPACT_AFTER_FILES", 4)
    store = make_store(FEATURES)
    for seed in range(9):  # a catch-up after each: more statistics files than the bound, merged
        store.push("payments", _payments(30, seed=seed, first_id=1000 * seed), to="offline")
        store.flush()
        store.statistics("activity")
    table = store.definitions.layout("activity").history_table
    files = store.offline_store.statistics.tables.open(store.offline_store.statistics.uri(table), fresh=True)
    assert files is not None and len(files.file_uris()) <= 5
    _assert_statistics_equal_history(store)


def test_a_commit_whose_statistics_failed_is_covered_by_the_next_read(make_store, caplog):
    store = make_store(FEATURES)
    store.push("payments", _payments(150, seed=3), to="offline")
    _assert_statistics_equal_history(store)
    history = store.offline_store
    table = store.definitions.layout("activity").history_table
    blocker = history.location.path / "_statistics" / table
    shutil.rmtree(blocker)
    blocker.write_text("not a table")  # the statistics cannot be written: the commit still stands
    store.push("payments", _payments(150, seed=4, first_id=1000), to="offline")
    store.flush()
    assert history.statistics.idle(timeout=60)  # the background catch-up ran, and failed
    assert "statistics of activity not brought up to date" in caplog.text
    assert history.stats(table)["history_rows"] == 300
    blocker.unlink()
    _assert_statistics_equal_history(store)


def _uncovered_pushes(make_store, pushes: int):
    """A store whose history holds ``pushes`` pushes of 80 rows that its statistics do not cover:
    (store, its offline store, the history table)."""
    store = make_store(FEATURES)
    history = store.offline_store
    table = store.definitions.layout("activity").history_table
    for seed in range(pushes):
        store.push("payments", _payments(80, seed=seed, first_id=1000 * seed), to="offline")
        store.flush()
    history.statistics.drop(table)
    return store, history, table


def test_a_catch_up_after_a_vacuum_skips_the_files_gone_and_goes_on(make_store, caplog):
    """Statistics that had not caught up when a compaction's vacuum deleted the files of the
    commits they had yet to cover failed on each catch-up for good (the first missing file
    raised), so no later commit was ever summarized. The files gone go unsummarized, said in the
    log, and the commits after them are."""
    store, history, table = _uncovered_pushes(make_store, 3)  # (as if a process was killed after its commits)
    store.compact(vacuum_hours=0)  # the pushes' files merged away and deleted
    store.push("payments", _payments(50, seed=9, first_id=9000), to="offline")
    store.flush()
    history.statistics.catch_up(table)
    assert "is gone (vacuumed); its rows go unsummarized" in caplog.text
    summarized = sum(summary.rows for _, name, summary in store.statistics("activity") if name == "card_id")
    assert summarized == 50  # the commit after the vacuum


def test_catch_ups_at_once_count_each_commit_once(make_store):
    store, history, table = _uncovered_pushes(make_store, 4)  # two readers catch up at once
    threads = [threading.Thread(target=history.statistics.catch_up, args=(table,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _assert_statistics_equal_history(store)


_EXITS_WITHOUT_CLOSING = """
import sys, time
from pathlib import Path
from featurestore import FeatureStore
from featurestore.offline import statistics
from tests.test_statistics import _payments

statistics.SETTLE_SECONDS = 0.01
caught_up, marks = statistics.CommitStatistics.catch_up, Path(sys.argv[2])

def slow(self, name):  # a catch-up still under way when the script ends
    (marks / "started").touch()
    time.sleep(1.0)
    n = caught_up(self, name)
    (marks / "finished").touch()
    return n

statistics.CommitStatistics.catch_up = slow
store = FeatureStore(sys.argv[1])
store.push("payments", _payments(50, seed=1), to="offline")
store.flush()
while not (marks / "started").exists():
    time.sleep(0.01)
"""


def test_a_process_that_exits_without_closing_its_store_finishes_its_catch_up_first(make_store, tmp_path):
    """A script that never closes its store ends while its background catch-up runs: the
    catch-up finishes before the interpreter does. Before, the interpreter finalized under it:
    on S3 a native read then aborted the process (a Ray driver's exit code -6 in CI)."""
    import subprocess
    import sys
    from pathlib import Path

    store = make_store(FEATURES)
    marks = tmp_path / "marks"
    marks.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _EXITS_WITHOUT_CLOSING, str(store.config.repo_path), str(marks)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (marks / "started").exists() and (marks / "finished").exists()
    _assert_statistics_equal_history(store)
