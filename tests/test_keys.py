"""One canonical, injective entity-key encoding on every path, by declared type (issue #10 item 4)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore.errors import RequestError

from .conftest import examples

NOW = datetime.now(UTC).replace(microsecond=0)
TS = pa.timestamp("us", tz="UTC")
WHEN = datetime(2024, 5, 1, 12, 30, 0, 123456, tzinfo=UTC)

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
    return pa.table(
        {**columns, "ts": pa.array([NOW - timedelta(hours=1)] * n, TS), "x": pa.array(range(1, n + 1), pa.int64())}
    )


@pytest.fixture
def store(make_store):
    return make_store(
        DEFS,
        {
            "by_bytes": _table(b=pa.array([b"k1", b"\xff\x00"], pa.binary())),
            "by_float": _table(f=pa.array([1.0, 0.1], pa.float64())),
            "by_time": _table(t=pa.array([WHEN], TS)),
            # the old encoding joined these two into the same Redis key
            "by_pair": _table(s1=pa.array(["a\x1fs2=b", "a"]), s2=pa.array(["c", "b\x1fs2=c"])),
            "by_text": _table(s=pa.array(["1", "01", "}{%"])),
        },
    )


def test_every_key_type_is_found_online_as_offline(store):
    report = store.materialize(None, NOW)
    assert all(v.rejected_rows == 0 for v in report.views)
    get = lambda rows, ref: store.get_online_features(rows, features=[ref]).to_dict()["x"]  # noqa: E731
    assert get({"b": [b"k1", b"\xff\x00", "k1"]}, "by_bytes:x") == [1, 2, 1]
    assert get({"f": [1.0, 1, 0.1]}, "by_float:x") == [1, 1, 2]
    assert get({"t": [WHEN, WHEN.replace(tzinfo=None)]}, "by_time:x") == [1, 1]
    assert get({"s1": ["a\x1fs2=b", "a"], "s2": ["c", "b\x1fs2=c"]}, "by_pair:x") == [1, 2]
    assert get({"s": ["1", "01", "}{%"]}, "by_text:x") == [1, 2, 3]


def test_a_key_of_the_wrong_type_is_an_error_online_and_offline(store):
    store.materialize(None, NOW)
    # online, unambiguous conversions are made as Feast makes them (issue #12): 1 is "1", not "01"
    assert store.get_online_features({"s": [1, "1"]}, features=["by_text:x"]).to_dict()["x"] == [1, 1]
    with pytest.raises(RequestError, match="join key 's' takes String"):
        store.get_online_features({"s": [1.5]}, features=["by_text:x"])
    with pytest.raises(RequestError, match="join key 's' is String but the entity rows give int64"):
        store.get_historical_features(
            pd.DataFrame({"s": [1], "event_timestamp": [NOW]}), features=["by_text:x"]
        ).to_df()
    with pytest.raises(
        RequestError, match="join key 't' takes UnixTimestamp"
    ):  # (ISO 8601 text is taken: REST sends no datetimes)
        store.get_online_features({"t": ["the first of May"]}, features=["by_time:x"])


PUSHED = """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import *

pair = Entity(name="pair", join_keys=["s", "b"], value_type={"s": String, "b": Bytes})
real = Entity(name="real", join_keys=["f"], value_type=Float64)
rows = PushSource(name="rows", schema=[Field("s", String), Field("b", Bytes), Field("f", Float64), Field("v", Float64),
                                       Field("arr", Array(Float64)), Field("event_timestamp", UnixTimestamp)])
by_pair = FeatureView(name="by_pair", entities=[pair], source=rows, schema=[Field("v", Float64), Field("arr", Array(Float64))])
by_real = FeatureView(name="by_real", entities=[real], source=rows, schema=[Field("v", Float64)])
"""


@pytest.fixture(scope="module")
def pushed_store(tmp_path_factory, redis_url):
    from featurestore import FeatureStore

    from .conftest import write_repo

    store = FeatureStore(write_repo(tmp_path_factory.mktemp("keys"), PUSHED, url=redis_url))
    store.apply()
    yield store
    store.close()


def _same(a, b) -> bool:
    nan = lambda x: [("NaN" if isinstance(v, float) and v != v else v) for v in x] if isinstance(x, list) else x  # noqa: E731
    return nan(a) == nan(b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


_examples = iter(range(10**9))


def test_random_keys_values_and_corrections_agree_online_and_offline(pushed_store):
    """Property (issue #10): random composite string/bytes keys (separators, braces, non-UTF-8),
    float keys, arrays with NaN and infinities, equal event times and reverting corrections:
    online equals offline equals the last write of the newest event time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none())
    text = st.text(alphabet=st.sampled_from(["a", "\x1f", "=", "{", "}", "%", "ü", "1"]), max_size=4)
    push = st.fixed_dictionaries(
        {
            "key": st.integers(0, 2),
            "minute": st.integers(0, 2),
            "v": floats,
            "arr": st.one_of(st.none(), st.lists(floats, max_size=3)),
        }
    )

    @settings(
        max_examples=examples(25),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        keys=st.lists(
            st.tuples(text, st.binary(max_size=3), st.floats(-1e6, 1e6)), min_size=3, max_size=3, unique=True
        ),
        pushes=st.lists(push, min_size=1, max_size=6),
    )
    def check(keys, pushes):
        tag = next(_examples)
        keys = [(f"{tag}|{s}", bytes([tag % 256]) + b, float(tag) * 1e7 + f) for s, b, f in keys]
        if len({k[2] for k in keys}) < 3:
            return
        base = NOW - timedelta(hours=1)
        by_pair: dict = {}  # (s, b) -> (time, v, arr) of the newest event, later pushes winning ties
        by_real: dict = {}  # f -> the same (keys may share (s, b) and differ in f: other entities)
        for p in pushes:  # one push per row: later pushes are later writes
            s, b, f = keys[p["key"]]
            ts = base + timedelta(minutes=p["minute"])
            pushed_store.push(
                "rows", {"s": [s], "b": [b], "f": [f], "v": [p["v"]], "arr": [p["arr"]], "event_timestamp": [ts]}
            )
            for expected, entity in ((by_pair, (s, b)), (by_real, f)):
                if entity not in expected or ts >= expected[entity][0]:
                    expected[entity] = (ts, p["v"], p["arr"])
        pairs, reals = list(by_pair), list(by_real)
        online = pushed_store.get_online_features(
            {"s": [k[0] for k in pairs], "b": [k[1] for k in pairs]}, features=["by_pair:v", "by_pair:arr"]
        ).to_dict()
        offline = (
            pushed_store.get_historical_features(
                pd.DataFrame(
                    {"s": [k[0] for k in pairs], "b": [k[1] for k in pairs], "event_timestamp": [NOW] * len(pairs)}
                ),
                features=["by_pair:v", "by_pair:arr"],
            )
            .to_arrow()
            .to_pylist()
        )
        for j, pair in enumerate(pairs):
            _, v, arr = by_pair[pair]
            assert _same(online["v"][j], v) and _same(offline[j]["v"], v), (pair, online["v"][j], offline[j]["v"], v)
            assert _same(online["arr"][j], arr) and _same(offline[j]["arr"], arr), (
                pair,
                online["arr"][j],
                offline[j]["arr"],
                arr,
            )
        real = pushed_store.get_online_features({"f": reals}, features=["by_real:v"]).to_dict()["v"]
        for j, f in enumerate(reals):
            assert _same(real[j], by_real[f][1]), (f, real[j], by_real[f][1])

    check()


@settings(max_examples=examples(300), deadline=None)
@given(
    st.one_of(
        st.tuples(
            st.just("String"), st.text(alphabet=st.sampled_from(["a", "\x1f", "=", "{", "}", "%", "ü", "7", "B"]))
        ),
        st.tuples(st.just("Int64"), st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("Int32"), st.integers(-(2**31), 2**31 - 1)),
        st.tuples(st.just("Float64"), st.floats(allow_nan=False)),
        st.tuples(st.just("Bytes"), st.binary(max_size=8)),
        st.tuples(st.just("Bool"), st.booleans()),
        st.tuples(st.just("UnixTimestamp"), st.datetimes(timezones=st.just(UTC))),
    )
)
def test_a_key_text_reads_back_as_its_value(typed):
    """``featurestore capacity`` reads entities back from their Redis keys: ``key_value`` inverts
    ``key_text`` for every key type (escaped separators and braces included)."""
    from featurestore.online.codec import key_text, key_value

    type_name, value = typed
    back = key_value(key_text(value, type_name), type_name)
    assert back == (value + 0.0 if type_name == "Float64" else value) and type(back) is type(value)


def test_key_texts_shaped_like_stored_names_are_entities_to_dropping_layouts_and_capacity(make_store):
    """An entity's key text may read like the name of a view's values or events under another
    layout (``x:by_text#old``, ``y:ev:by_text#old|ids``): it is still an entity's hash.
    ``drop_old_layouts`` keeps it (it deleted the first: its key's last ``:`` part named an
    earlier layout) and capacity samples it as an entity, not as an earlier layout's events."""
    from featurestore import capacity

    texts = ["x:by_text#old", "y:ev:by_text#old|ids", "z}:ev:by_text#old"]
    only_text = DEFS.split("by_bytes =")[0] + 'by_text = view("by_text", ["s"], [String])\n'
    store = make_store(only_text, {"by_text": _table(s=pa.array(texts))})
    store.materialize(None, NOW)
    store.drop_old_layouts()
    assert store.get_online_features({"s": texts}, features=["by_text:x"]).to_dict()["x"] == [1, 2, 3]
    measured = capacity.measure(store.online_store, store.definitions, store.config.project, probe=False)
    assert measured.earlier_event_keys == 0 and measured.sampled == len(texts)
