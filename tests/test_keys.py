"""One canonical, injective entity-key encoding on every path, by declared type (issue #10 item 4)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pandas as pd
import pyarrow as pa
import pytest

from featurestore.errors import RequestError

NOW = datetime.now(timezone.utc).replace(microsecond=0)
TS = pa.timestamp("us", tz="UTC")
WHEN = datetime(2024, 5, 1, 12, 30, 0, 123456, tzinfo=timezone.utc)

DEFS = """
from featurestore import Entity, FeatureView, Field, FileSource
from featurestore.types import *

def view(name, keys, types):
    entity = Entity(name=name, join_keys=keys, value_type=dict(zip(keys, types)))
    return FeatureView(name=name, entities=[entity], source=FileSource(path=f"data/{name}.parquet", timestamp_field="ts"),
                       schema=[Field("x", Int64)])

by_bytes = view("by_bytes", ["b"], [Bytes])
by_float = view("by_float", ["f"], [Float64])
by_time = view("by_time", ["t"], [UnixTimestamp])
by_pair = view("by_pair", ["s1", "s2"], [String, String])
by_text = view("by_text", ["s"], [String])
"""


def _table(**columns) -> pa.Table:
    n = len(next(iter(columns.values())))
    return pa.table({**columns, "ts": pa.array([NOW - timedelta(hours=1)] * n, TS), "x": pa.array(range(1, n + 1), pa.int64())})


@pytest.fixture
def store(make_store):
    return make_store(DEFS, {
        "by_bytes": _table(b=pa.array([b"k1", b"\xff\x00"], pa.binary())),
        "by_float": _table(f=pa.array([1.0, 0.1], pa.float64())),
        "by_time": _table(t=pa.array([WHEN], TS)),
        # the old encoding joined these two into the same Redis key
        "by_pair": _table(s1=pa.array(["a\x1fs2=b", "a"]), s2=pa.array(["c", "b\x1fs2=c"])),
        "by_text": _table(s=pa.array(["1", "01", "}{%"])),
    })


def test_every_key_type_is_found_online_as_offline(store):
    report = store.materialize(None, NOW)
    assert all(v.rejected_rows == 0 for v in report.views)
    get = lambda rows, ref: store.get_online_features(rows, features=[ref]).to_values()["x"]  # noqa: E731
    assert get({"b": [b"k1", b"\xff\x00", "k1"]}, "by_bytes:x") == [1, 2, 1]
    assert get({"f": [1.0, 1, 0.1]}, "by_float:x") == [1, 1, 2]
    assert get({"t": [WHEN, WHEN.replace(tzinfo=None)]}, "by_time:x") == [1, 1]
    assert get({"s1": ["a\x1fs2=b", "a"], "s2": ["c", "b\x1fs2=c"]}, "by_pair:x") == [1, 2]
    assert get({"s": ["1", "01", "}{%"]}, "by_text:x") == [1, 2, 3]


def test_a_key_of_the_wrong_type_is_an_error_online_and_offline(store):
    store.materialize(None, NOW)
    with pytest.raises(RequestError, match="join key 's' takes String"):
        store.get_online_features({"s": [1]}, features=["by_text:x"])
    with pytest.raises(RequestError, match="join key 's' is String but the entity rows give int64"):
        store.get_historical_features(pd.DataFrame({"s": [1], "event_timestamp": [NOW]}), features=["by_text:x"]).to_df()
    with pytest.raises(RequestError, match="join key 't' takes UnixTimestamp"):
        store.get_online_features({"t": ["2024-05-01"]}, features=["by_time:x"])
