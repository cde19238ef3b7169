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
