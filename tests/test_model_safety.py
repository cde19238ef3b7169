"""A model file is data, not code: loading one never runs a pickle payload (issue #11)."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from featurestore.errors import FeatureStoreError
from featurestore.training.model_registry import MODEL_FILES, ModelRegistry


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the file proves the code ran


def test_a_pickle_payload_in_model_pt_does_not_run(tmp_path):
    folder = tmp_path / "models" / "fraud" / "1"
    folder.mkdir(parents=True)
    marker = tmp_path / "pwned"
    weights = folder / "model.pt"
    weights.write_bytes(pickle.dumps({"state_dict": Payload(str(marker)), "config": {}}))
    # the attacker controls the folder, so the card's hash matches the forged file
    (folder / "card.json").write_text(json.dumps({"weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}))
    (folder / "preprocessing.json").write_text("{}")
    (tmp_path / "models" / "fraud" / "aliases.json").write_text(json.dumps({"production": 1}))
    registry = ModelRegistry(tmp_path / "models", tmp_path / "registry" / "models.json")
    # the ledger lives outside the models folder: a forged version is refused before it is read
    with pytest.raises(FeatureStoreError, match="not in the registry's ledger"):
        registry.load("fraud", "production")
    # even with the ledger forged too, weights are read as data only
    ledger = {"fraud": {"1": {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in MODEL_FILES}}}
    registry.ledger.parent.mkdir()
    registry.ledger.write_text(json.dumps(ledger))
    with pytest.raises(Exception, match="(?i)weights only|unpickl|unsupported"):
        registry.load("fraud", "production")
    assert not marker.exists()


def test_the_feature_log_buffer_is_bounded_when_its_store_is_down(tmp_path):
    """Issue #11: with the log directory unwritable, memory grew without bound and p99 rose 14x."""
    import pyarrow as pa

    from featurestore.feature_logging import FeatureLogger

    blocked = tmp_path / "log"
    blocked.write_text("a file where the Delta table should be")
    logger = FeatureLogger(blocked, pa.schema([("x", pa.int64())]), flush_interval=3600, max_buffered_rows=100)
    for i in range(1000):
        logger.log({"x": [i, i]})
    assert logger.flush() == 0 and logger.failed_flushes == 1
    assert logger._rows <= 100 and logger.dropped_rows >= 1900
    blocked.unlink()  # the store comes back: the newest rows are written
    assert logger.flush() == 100
    logger.close()


def test_the_feature_log_loses_only_past_its_bound_says_so_and_recovers_promptly(tmp_path, caplog):
    """The log's folder unwritable for a while under load: rows beyond the 100k bound were lost
    (expected), failed flushes backed off to 60 s so rows kept dropping after the folder was
    writable again, and nothing said so. Now: every row is logged or counted dropped, drops are
    logged and counted for ``/metrics``, and flushing resumes within a second."""
    import logging
    import time

    import pyarrow as pa

    from featurestore.feature_logging import FeatureLogger, read_log

    blocked = tmp_path / "log"
    blocked.write_text("a file where the Delta table should be")
    counts: dict[str, int] = {}
    logger = FeatureLogger(
        blocked,
        pa.schema([("x", pa.int64())]),
        flush_interval=0.05,
        max_buffered_rows=1000,
        count=lambda outcome, n: counts.__setitem__(outcome, counts.get(outcome, 0) + n),
    )
    served = 0
    with caplog.at_level(logging.WARNING, logger="featurestore.feature_logging"):
        deadline = time.monotonic() + 1.0  # an outage of a second, under load
        while time.monotonic() < deadline:
            logger.log({"x": list(range(served, served + 50))})
            served += 50
            time.sleep(0.002)
        assert counts.get("failed flush", 0) >= 3  # kept trying, no long backoff
        blocked.unlink()  # writable again: rows flow within a few intervals
        recovered = time.monotonic()
        while logger.logged_rows == 0 and time.monotonic() - recovered < 5:
            time.sleep(0.01)
        assert logger.logged_rows > 0 and time.monotonic() - recovered < 2
        for _ in range(20):
            logger.log({"x": list(range(served, served + 50))})
            served += 50
        logger.close()
    assert logger.logged_rows + logger.dropped_rows == served
    assert logger.dropped_rows == served - 1000 - 20 * 50 and counts["dropped"] == logger.dropped_rows
    assert read_log(blocked).num_rows == logger.logged_rows == counts["logged"]
    assert any("dropped" in r.message for r in caplog.records) and any(
        "flush failed" in r.message for r in caplog.records
    )
    assert any("written again" in r.message for r in caplog.records)


def test_a_feature_log_flushed_every_second_stays_a_few_files(make_store, monkeypatch):
    """A server flushes its feature log every second, a Delta commit and a file each: 86,400
    files a day, every read of the log (``check-consistency``, ``monitor``, the UI) slower day
    after day. The logger now merges them every ``COMPACT_EVERY`` flushes, beside another
    process's appends (a lock they share), and ``compact`` merges every log; each row reads back
    once."""
    import multiprocessing

    import pyarrow as pa
    from deltalake import DeltaTable

    from featurestore import feature_logging
    from featurestore.feature_logging import FeatureLogger, read_log

    store = make_store(
        "from featurestore import Entity\nfrom featurestore.types import Int64\n"
        'card = Entity(name="card", join_keys=["card_id"], value_type=Int64)\n'
    )
    path = feature_logging.log_path(store.config.data_dir, "service:svc")
    schema = pa.schema([("x", pa.int64())])
    monkeypatch.setattr(feature_logging, "COMPACT_EVERY", 10)
    spawn = multiprocessing.get_context("spawn")  # (deltalake's runtime does not survive a fork)
    appending = spawn.Event()
    other = spawn.Process(target=_log_from_another_worker, args=(path, schema, appending))
    other.start()  # a second server worker appending to the same log meanwhile
    assert appending.wait(60)
    logger = FeatureLogger(path, schema, flush_interval=3600)
    for i in range(25):
        logger.log({"x": [i, i + 1000]})
        assert logger.flush() == 2
    other.join(60)
    assert other.exitcode == 0
    logger.close()
    expected = sorted([i for i in range(25)] + [i + 1000 for i in range(25)] + list(range(5000, 5200)))
    assert sorted(read_log(path)["x"].to_pylist()) == expected
    assert len(DeltaTable(str(path)).file_uris()) < 25 + 100  # (merged while both appended)

    monkeypatch.setattr(feature_logging, "VACUUM_HOURS", 0)
    (report,) = store.compact_feature_logs().values()
    assert report["files_after"] == 1 < report["files_before"] and report["files_vacuumed"] > 0
    assert len(list(path.glob("*.parquet"))) == 1 and sorted(read_log(path)["x"].to_pylist()) == expected


def _log_from_another_worker(path, schema, appending) -> None:
    from featurestore.feature_logging import FeatureLogger

    logger = FeatureLogger(path, schema, flush_interval=3600)
    for i in range(100):
        logger.log({"x": [5000 + 2 * i, 5001 + 2 * i]})
        logger.flush()
        appending.set()
    logger.close()


def test_a_feature_logs_columns_follow_the_definitions_and_no_value_is_cast(tmp_path, caplog):
    """After an apply changed a served feature's type (Int64 to Float64), a server's log kept the
    columns it started with: Delta cast what it appended (1.5 logged as 1, a wrong value for
    ``check-consistency``) or refused it (text: every row past the bound lost). A server's log now
    follows the definitions it serves under (``FollowedLog``), a logger whose columns changed type
    starts the log anew (the log so far moved aside), and a logger still on the older columns
    (another worker not reloaded yet) never casts: its rows wait."""
    import logging

    import pyarrow as pa

    from featurestore.feature_logging import FeatureLogger, FollowedLog, read_log

    path = tmp_path / "log"
    ints, floats = pa.schema([("amount", pa.int64())]), pa.schema([("amount", pa.float64())])
    followed = FollowedLog(path)
    first = followed.logger("definitions v1", lambda: ints)
    first.log({"amount": [1, 2]})
    assert first.flush() == 2 and followed.logger("definitions v1", lambda: floats) is first  # (same definitions)
    stale = FeatureLogger(path, ints, flush_interval=3600)  # another worker, on v1 still
    stale.log({"amount": [3]})
    assert stale.flush() == 1
    with caplog.at_level(logging.WARNING, logger="featurestore.feature_logging"):
        now = followed.logger("definitions v2", lambda: floats)
        now.log({"amount": [1.5]})
        assert now is not first and now.flush() == 1
        stale.log({"amount": [4]})
        assert stale.flush() == 0 and stale.failed_flushes == 1  # not cast into the new log
    assert read_log(path)["amount"].to_pylist() == [1.5]
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("log.until-")]
    assert sorted(read_log(aside)["amount"].to_pylist()) == [1, 2, 3]
    assert "columns ['amount'] changed type" in caplog.text and "wait until this server reloads" in caplog.text
    followed.close()
    stale._stop.set()
