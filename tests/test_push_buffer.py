"""Pushes go to history through a durable buffer: nothing lost on a crash, nothing appended twice."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from featurestore.sources import open_push_log

from .test_aggregations import FEATURES, _frame

NOW = datetime.now(UTC).replace(microsecond=0)


def _payment(i: int, card: int = 1) -> dict:
    return {
        "payment_id": i,
        "card_id": card,
        "amount": float(i),
        "kind": "web",
        "event_timestamp": NOW - timedelta(minutes=i),
    }


def _counts(store, cards=(1,)):
    entity_df = pd.DataFrame({"card_id": list(cards), "event_timestamp": [NOW] * len(cards)})
    offline = store.get_historical_features(entity_df, features=["activity:count_1h"]).to_df()["count_1h"].tolist()
    online = store.get_online_features({"card_id": list(cards)}, features=["activity:count_1h"], at=NOW).to_dict()[
        "count_1h"
    ]
    return offline, online


def test_a_push_is_durable_before_history_commits_and_reads_see_it(make_store):
    store = make_store(FEATURES)
    store.apply()
    store.push("payments", _frame([_payment(1), _payment(2)]), to="online_and_offline")
    assert store.push_buffer.targets() == ["log:payments"]  # on disk, not yet in Delta
    (record,) = store.push_buffer.records("log:payments")  # one record (one sync) for the log and the view
    parts = dict(record.parts)
    assert sorted(parts) == ["log:payments", "view:activity"] and [t.num_rows for t in parts.values()] == [2, 2]
    assert store.offline_store.version("activity") is None
    assert _counts(store) == ([2], [2])  # a read of history commits what is buffered first
    assert store.push_buffer.targets() == []


def test_a_crash_between_buffer_and_redis_is_repaired_by_the_next_flush(make_store, monkeypatch):
    store = make_store(FEATURES)
    store.apply()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed after the buffer write")

    monkeypatch.setattr(store.online_store, "write_events", crash)
    with pytest.raises(KeyboardInterrupt):
        store.push("payments", _frame([_payment(3)]), to="online_and_offline")
    monkeypatch.undo()
    assert [r.pending for r in store.push_buffer.records("log:payments")] == [True]
    assert store.flush() >= 1  # re-sends the unconfirmed rows online, then commits them
    assert _counts(store) == ([1], [1])


def test_a_repeated_drain_appends_nothing_twice(make_store, tmp_path):
    store = make_store(FEATURES)
    store.apply()
    store.push("payments", _frame([_payment(4), _payment(5)]), to="offline")
    saved = tmp_path / "saved"
    shutil.copytree(store.push_buffer.root, saved)
    store.flush()
    shutil.rmtree(store.push_buffer.root)
    shutil.copytree(saved, store.push_buffer.root)  # as if the drain crashed after its commits
    store.flush()
    log = open_push_log(store.config.push_logs, "payments").to_pyarrow_table()
    assert sorted(log["payment_id"].to_pylist()) == [4, 5]
    assert _counts(store)[0] == [2]


def test_a_drain_repeated_with_new_records_beside_it_appends_each_record_once(make_store, tmp_path):
    """A drain that crashed after its Delta commit and before deleting its journals, then new
    pushes, then a drain: the log skipped a drain only when it held the drain's newest record, so
    the old records went in again beside the new ones (41 of 1,050 events twice). The log now
    leaves out every record it holds, whatever else the drain carries."""
    store = make_store(FEATURES)
    store.push("payments", _frame([_payment(i) for i in range(10, 14)]), to="offline")
    saved = tmp_path / "saved"
    shutil.copytree(store.push_buffer.root, saved)
    store.flush()
    shutil.rmtree(store.push_buffer.root)
    shutil.copytree(saved, store.push_buffer.root)  # the drain committed, then died before deleting its journals
    from featurestore import FeatureStore

    with FeatureStore(store.config.repo_path, store.config) as restarted:
        restarted.push("payments", _frame([_payment(i) for i in range(14, 16)]), to="offline")  # new events, no retry
        restarted.flush()
    log = open_push_log(store.config.push_logs, "payments").to_pyarrow_table()
    assert sorted(log["payment_id"].to_pylist()) == list(range(10, 16))
    assert _counts(store)[0] == [6]


def test_buffered_rows_commit_when_the_bounds_are_reached(make_store):
    store = make_store(FEATURES)
    store.apply()
    store.push_buffer.max_rows = 3
    store.push("payments", _frame([_payment(6), _payment(7)]))
    assert store.offline_store.version("activity") is None
    store.push("payments", _frame([_payment(8)]))  # 3 rows buffered: committed after this push, in the background
    store.push_buffer.wait_background()
    assert store.offline_store.version("activity") is not None and store.push_buffer.targets() == []


def test_compaction_merges_small_files_and_keeps_history(make_store, tmp_path):
    store = make_store(FEATURES)
    store.push_buffer.max_rows = 1  # every push commits: many small files
    for i in range(10, 16):
        store.push("payments", _frame([_payment(i)]), to="offline")
        store.push_buffer.wait_background()
    before = _counts(store)[0]
    assert store.offline_store.file_count("activity") >= 6
    report = store.compact(["activity"])
    dates = {
        (NOW - timedelta(minutes=i)).date() for i in range(10, 16)
    }  # one file per event-date partition (2 just after midnight)
    assert report["activity"]["files_after"] == len(dates) < report["activity"]["files_before"]
    assert _counts(store)[0] == before


def test_automatic_compaction_vacuums_and_a_vacuumed_export_says_why_it_cannot_reproduce(make_store, tmp_path):
    """Issue #8: compaction was automatic but vacuum only a command, so replaced files piled up.
    With ``vacuum_after_hours``, each automatic compaction deletes what earlier ones replaced;
    reproducing an export whose version lost its files is a clear error, not a DuckDB IO error."""
    import subprocess
    import sys

    store = make_store(
        FEATURES
        + 'from featurestore import FeatureService\nsvc = FeatureService(name="svc", features=[activity[["count_1h"]]])\n'
    )
    store.config = dataclasses.replace(
        store.config, offline=dataclasses.replace(store.config.offline, compact_after_files=3, vacuum_after_hours=0)
    )
    store.push_buffer.max_rows = 1  # every push commits a file
    for i in range(20, 24):
        store.push("payments", _frame([_payment(i)]), to="offline")
        store.push_buffer.wait_background()
    store.export_training_dataset(pd.DataFrame({"card_id": [1], "event_timestamp": [NOW]}), "svc", tmp_path / "v1")
    for i in range(24, 32):  # more compactions, each deleting what the earlier ones replaced
        store.push("payments", _frame([_payment(i)]), to="offline")
        store.push_buffer.wait_background()
    table_dir = store.offline_store.table_path("activity")
    assert (
        len(list(table_dir.rglob("*.parquet"))) <= store.offline_store.file_count("activity") + 3
    )  # no pile of old files
    assert _counts(store)[0] == [12]  # every pushed row still in the history
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "featurestore.cli",
            "export",
            "--repo",
            str(store.config.repo_path),
            "--from-manifest",
            str(tmp_path / "v1" / "manifest.json"),
            "--out",
            str(tmp_path / "v2"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "REDIS_URL": store.config.online.url},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        "lost" in result.stderr
        and "to a vacuum" in result.stderr
        and "export again from the current version" in result.stderr
    )


def test_a_push_writes_redis_while_its_record_is_synced_and_returns_once_both_are_done(make_store, monkeypatch):
    """Issue #8: the one-event push to both stores paid its fsync and its Redis write one after
    the other (p99 over the 2 ms goal). They now overlap, and the push still returns durable."""
    from featurestore.offline.buffer import lanes as buffer_module

    store = make_store(FEATURES)
    store.apply()
    store.push("payments", _frame([_payment(1)]), to="offline")  # the journal exists: a push makes one sync
    happened: list[str] = []
    real_sync, real_write = os.fdatasync, store.online_store.write_events

    def slow_sync(fd):
        happened.append("sync starts")
        time.sleep(0.2)  # long enough that the online write finishes first if they overlap
        real_sync(fd)
        happened.append("sync ends")

    def write_events(*args, **kwargs):
        happened.append("redis write")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(buffer_module.os, "fdatasync", slow_sync)
    monkeypatch.setattr(store.online_store, "write_events", write_events)
    store.push("payments", _frame([_payment(2)]), to="online_and_offline")
    happened.append("push returned")
    assert happened == ["sync starts", "redis write", "sync ends", "push returned"]
    assert [r.pending for r in store.push_buffer.records("log:payments")] == [False, False]  # no drain re-sends them
    assert len(store.push_buffer.files("log:payments")) == 1  # one journal for both pushes


def test_a_record_torn_by_a_killed_writer_is_set_aside_and_the_rest_commits(make_store, caplog):
    """A writer killed mid-write leaves its journal ending in a record cut short. No push
    returned with it and Redis never got its rows: the records before it commit, the file is
    kept for inspection, and the next push starts a new journal."""
    store = make_store(FEATURES)
    store.apply()
    for i in (1, 2):
        store.push("payments", _frame([_payment(i)]), to="offline")
    (journal,) = store.push_buffer.files("log:payments")
    from featurestore.offline.buffer import MAGIC, RECORD

    data, end, sizes = journal.read_bytes(), 0, []
    while data[end : end + 4] == MAGIC:  # past the two records
        sizes.append(RECORD.size + RECORD.unpack_from(data, end)[1])
        end += sizes[-1]
    first_record = data[: sizes[0]]
    with open(journal, "r+b") as f:  # a third record, cut short where its writer died
        f.seek(end)
        f.write(first_record[: len(first_record) // 2])
    with caplog.at_level("WARNING", logger="featurestore.offline.buffer"):
        assert store.flush() == 4  # 2 rows, each to the log and the view
    assert _counts(store)[0] == [2]
    assert store.push_buffer.targets() == [] and journal.with_name(journal.name + ".torn").exists()
    assert "torn record" in caplog.text and "the 2 records before it commit" in caplog.text
    store.push("payments", _frame([_payment(3)]), to="offline")  # its journal was drained: a new one
    assert [r.rows for r in store.push_buffer.records("log:payments")] == [1] and _counts(store)[0] == [3]


def test_segments_written_by_the_previous_version_still_commit(make_store):
    """Buffers from before journals held a segment file per push and lane, its state in its name;
    an upgrade must not strand them (a pending one is re-sent online)."""
    import pyarrow.ipc as ipc

    store = make_store(FEATURES)
    store.apply()
    store.push("payments", _frame([_payment(1)]), to="offline")  # not online: only a re-send puts it there
    (record,) = store.push_buffer.records("log:payments")
    for path in store.push_buffer.files("log:payments"):
        path.unlink()
    for target, rows in record.parts:
        state = "pending" if target.startswith("view:") else "ready"
        folder = store.push_buffer.root / target.replace(":", "__")
        folder.mkdir(parents=True, exist_ok=True)
        with ipc.new_file(folder / f"{record.seq:020d}-1-1.{state}.arrow", rows.schema) as writer:
            writer.write_table(rows)
    assert store.push_buffer.targets() == ["log:payments", "view:activity"]
    assert store.flush() == 2
    assert _counts(store) == ([1], [1]) and store.push_buffer.targets() == []
    log = open_push_log(store.config.push_logs, "payments").to_pyarrow_table()
    assert log["payment_id"].to_pylist() == [1]


def test_concurrent_pushes_to_both_stores_each_land_once(make_store):
    """More pushing threads than online-write helpers, and drains committing records whose
    online write is still in flight: each event lands once in both stores, no push fails."""
    from concurrent.futures import ThreadPoolExecutor

    store = make_store(FEATURES)
    store.apply()
    store.push_buffer.max_rows = 3  # drains run beside pushes whose Redis write is in flight
    with ThreadPoolExecutor(12) as pool:
        list(pool.map(lambda i: store.push("payments", _frame([_payment(i % 50 + 1)])), range(12 * 5)))
    assert _counts(store) == ([50], [50])  # event ids 1..50 within the hour, each once (10 pushed twice)


def test_a_journal_replaced_while_a_push_is_in_flight_is_not_written_through_a_reused_descriptor(
    make_store, monkeypatch
):
    """A push in flight still writes to its journal after its Redis write (clearing its pending
    flag). If a drain deletes that journal meanwhile and another push starts a new one, the
    old file must stay open until then: its descriptor number, closed and reused by the new
    journal, had the late write land in the new journal's records (here: a retry's flag)."""
    import threading

    store = make_store(FEATURES)
    store.apply()
    store.push("payments", _frame([_payment(1)]), to="offline")  # the first record: the in-flight one is second
    started, resume = _held(monkeypatch, store.online_store, "write_events")
    in_flight = threading.Thread(target=lambda: store.push("payments", _frame([_payment(2)]), to="online_and_offline"))
    in_flight.start()
    assert started.wait(10)
    monkeypatch.delattr(store.online_store, "write_events")  # the drain's re-send writes at once
    assert store.flush() == 4  # the journal is drained and deleted (the pending record re-sent online)
    for _ in range(
        2
    ):  # a new journal: a first attempt, then its retry (a record flagged as one), as large as the first two
        store.push("payments", _frame([_payment(3)]), to="offline", idempotency_key="retried")
    assert [r.retry for r in store.push_buffer.records("log:payments")] == [False, True]
    resume.set()
    in_flight.join(10)
    assert [r.retry for r in store.push_buffer.records("log:payments")] == [False, True]


def test_pushes_do_not_wait_for_the_delta_commit_of_what_they_buffered(make_store, monkeypatch):
    """A push that finds the buffer due used to commit it to Delta itself, holding the lane's lock
    meanwhile (~0.6 s for 5 s of pushes: every push of the lane waited). The commit now runs on
    a background thread and holds writers only while it takes the journals."""
    import threading

    store = make_store(FEATURES)
    store.apply()
    store.push_buffer.max_rows = 2
    committing, release = _held(monkeypatch, store.offline_store, "append")
    store.push("payments", _frame([_payment(1), _payment(2)]))  # due: the commit starts and is held
    assert committing.wait(10)
    later = threading.Thread(target=lambda: [store.push("payments", _frame([_payment(i)])) for i in (3, 4, 5)])
    later.start()
    later.join(10)
    assert not later.is_alive()  # three more pushes went through while the commit was held
    release.set()
    store.push_buffer.wait_background()
    assert _counts(store) == ([5], [5])


def _held(monkeypatch, owner, name: str):
    """Patch ``owner.name`` to wait, once called, until released: ``(called, release)`` events."""
    import threading

    called, release = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args, **kwargs):
        called.set()
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return called, release


def test_due_counts_rows_across_journals_and_looks(tmp_path):
    """Whether a lane is due counted every record header of every journal at each look (a third
    of the committing thread's time under a push stream); it now reads on from where the last
    look stopped. The count must stay exact: across looks, processes' journals and drains."""
    import subprocess
    import sys

    import pyarrow as pa

    from featurestore.offline.buffer import PushBuffer

    rows = lambda n: pa.table({"x": list(range(n))})  # noqa: E731
    buffer = PushBuffer(tmp_path, max_rows=10, max_seconds=3600)
    buffer.append("view:a", rows(3))
    assert not buffer.due("view:a") and buffer._buffered["view:a"] == 3
    buffer.append("view:a", rows(4))
    assert not buffer.due("view:a") and buffer._buffered["view:a"] == 7
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import pyarrow as pa; from featurestore.offline.buffer import PushBuffer; "
            f"PushBuffer({str(tmp_path)!r}).append('view:a', pa.table({{'x': [1, 2]}}))",
        ],
        check=True,
    )
    assert not buffer.due("view:a") and buffer._buffered["view:a"] == 9  # another process's journal
    buffer.append("view:a", rows(1))
    assert buffer.due("view:a")
    assert buffer.drain("view:a", lambda *_: None) == 10
    buffer.append("view:a", rows(2))  # a new journal (the old ones are gone, their counts with them)
    assert not buffer.due("view:a") and buffer._buffered["view:a"] == 2
    buffer.close()
