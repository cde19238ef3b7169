"""Request-time (on-demand) features (issue #12): one function over request values and looked-up
features, applied identically to training rows (historical, export) and to lookups (SDK, REST)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pandas as pd
import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from featurestore.errors import RequestError
from serving.feature_server import create_app

NOW = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)

DEFS = """
import pyarrow.compute as pc
from featurestore import (Entity, FeatureService, FeatureView, Field, PushSource, RequestSource,
                          on_demand_feature_view)
from featurestore.types import Bool, Float64, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
events = PushSource(name="events", schema=[Field("card_id", Int64), Field("avg_amount", Float64), Field("country", String),
                                           Field("event_timestamp", UnixTimestamp)])
stats = FeatureView(name="stats", entities=[card], source=events, schema=[Field("avg_amount", Float64), Field("country", String)])
payment = RequestSource(name="payment", schema=[Field("amount", Float64)])

@on_demand_feature_view(sources=[stats[["avg_amount"]], payment], schema=[Field("amount_ratio", Float64), Field("large", Bool)])
def payment_vs_usual(inputs):
    ratio = pc.divide(inputs["amount"], inputs["avg_amount"])
    return {"amount_ratio": ratio, "large": pc.greater(ratio, 3.0)}

svc = FeatureService(name="svc", features=[stats[["country"]], payment_vs_usual])
"""


@pytest.fixture
def store(make_store):
    s = make_store(DEFS)
    s.push(
        "events",
        {
            "card_id": [1, 2, 3],
            "avg_amount": [10.0, 4.0, None],
            "country": ["FR", "DE", "US"],
            "event_timestamp": [NOW] * 3,
        },
        to="online_and_offline",
    )
    return s


def test_online_and_offline_compute_the_same_values(store):
    amounts = [50.0, 2.0, 7.0, 1.0]
    online = store.get_online_features(
        {"card_id": [1, 2, 3, 4], "amount": amounts},
        features=["stats:country", "payment_vs_usual:amount_ratio", "payment_vs_usual:large"],
    )
    assert online.feature_names == ["card_id", "country", "amount_ratio", "large"]
    assert online.to_dict()["amount_ratio"] == [5.0, 0.5, None, None] and online.to_dict()["large"] == [
        True,
        False,
        None,
        None,
    ]
    assert online.statuses[2] == ["PRESENT", "PRESENT", "NULL_VALUE", "NULL_VALUE"]
    rows = pd.DataFrame(
        {"card_id": [1, 2, 3, 4], "event_timestamp": [NOW + timedelta(seconds=1)] * 4, "amount": amounts}
    )
    offline = store.get_historical_features(rows, feature_service="svc").to_arrow()
    assert offline.column_names == ["card_id", "event_timestamp", "amount", "country", "amount_ratio", "large"]
    assert offline["amount_ratio"].to_pylist() == online.to_dict()["amount_ratio"]
    assert offline["large"].to_pylist() == online.to_dict()["large"]


def test_random_requests_agree_bit_for_bit(store):
    rng = random.Random(7)
    cards = [rng.choice([1, 2, 3, 9]) for _ in range(200)]
    amounts = [rng.choice([None, 0.0, -1.5, rng.uniform(0, 1e6), float("inf")]) for _ in cards]
    online = store.get_online_features(
        {"card_id": cards, "amount": amounts}, features=["payment_vs_usual:amount_ratio"]
    ).to_dict()
    rows = pd.DataFrame(
        {
            "card_id": cards,
            "event_timestamp": [NOW + timedelta(seconds=1)] * len(cards),
            "amount": pd.array(amounts, dtype="Float64"),
        }
    )
    offline = store.get_historical_features(rows, features=["payment_vs_usual:amount_ratio"]).to_arrow()
    assert offline["amount_ratio"].to_pylist() == online["amount_ratio"]


def test_request_fields_are_required_and_the_server_serves_them(store):
    with pytest.raises(RequestError, match="request field 'amount'"):
        store.get_online_features({"card_id": [1]}, features=["payment_vs_usual:amount_ratio"])
    rows = pd.DataFrame({"card_id": [1], "event_timestamp": [NOW]})
    with pytest.raises(RequestError, match=r"request field\(s\) \['amount'\]"):
        store.get_historical_features(rows, features=["payment_vs_usual:amount_ratio"]).to_arrow()
    with TestClient(create_app(store.config.repo_path)) as client:
        body = client.post(
            "/get-online-features",
            json={"feature_service": "svc", "entities": {"card_id": [1, 2], "amount": [30.0, 4.0]}},
        ).json()
        assert body["metadata"]["feature_names"] == ["card_id", "country", "amount_ratio", "large"]
        assert body["results"][2]["values"] == [3.0, 1.0] and body["results"][3]["values"] == [False, False]
        missing = client.post("/get-online-features", json={"feature_service": "svc", "entities": {"card_id": [1]}})
        assert missing.status_code == 422 and "amount" in missing.json()["detail"]


def test_exports_carry_on_demand_features(store, tmp_path):
    rows = pa.table(
        {
            "card_id": [1, 2],
            "event_timestamp": pa.array([NOW + timedelta(seconds=1)] * 2, pa.timestamp("us", tz="UTC")),
            "amount": [20.0, 20.0],
        }
    )
    manifest = store.export_training_dataset(rows, "svc", tmp_path / "ds")
    assert "payment_vs_usual" in manifest["definition_hashes"]
    assert pd.read_parquet(tmp_path / "ds" / "data-00000.parquet")["amount_ratio"].tolist() == [2.0, 5.0]


def test_the_consistency_check_covers_request_time_features(store):
    """The feature server logs the request fields with the served vector, so the check recomputes
    the on-demand features offline from the same inputs (as known at serving time)."""
    from featurestore.consistency import check_service_log

    with TestClient(create_app(store.config.repo_path, log_features=True)) as client:
        for amounts in ([30.0, 4.0, 1.0], [12.5, None, 3.0]):
            body = {"feature_service": "svc", "entities": {"card_id": [1, 2, 3], "amount": amounts}}
            assert client.post("/get-online-features", json=body).status_code == 200
    report = check_service_log(store, "svc")
    assert report.rows == 6 and report.feature_match == {"country": 1.0, "amount_ratio": 1.0, "large": 1.0}, (
        report.mismatches
    )


EDGE_DEFS = """
import pyarrow.compute as pc
from featurestore import Entity, FeatureView, Field, PushSource, RequestSource, on_demand_feature_view
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
events = PushSource(name="events", schema=[Field("card_id", Int64), Field("limit", Int64), Field("avg_amount", Float64),
                                           Field("event_timestamp", UnixTimestamp)])
stats = FeatureView(name="stats", entities=[card], source=events, schema=[Field("limit", Int64), Field("avg_amount", Float64)])
req = RequestSource(name="req", schema=[Field("count", Int64), Field("amount", Float64)])

@on_demand_feature_view(sources=[stats, req], schema=[Field("per_count", Int64), Field("plus", Float64)])
def over_the_whole_view(inputs):
    return {"per_count": pc.divide(inputs["limit"], inputs["count"]), "plus": pc.add(inputs["amount"], inputs["avg_amount"])}
"""


def test_on_demand_edge_cases_behave_alike_on_both_paths(make_store):
    """Three things an independent check found: a view over a whole FeatureView was refused
    (``Field`` objects taken for feature names); an integer division by zero raised a raw
    ``ArrowInvalid``; a NaN request field in a pandas entity_df became null offline, NaN online."""
    import math

    from featurestore.errors import OnDemandError

    store = make_store(EDGE_DEFS)  # applies: the whole-view source is accepted
    store.push(
        "events",
        {"card_id": [1], "limit": [100], "avg_amount": [2.0], "event_timestamp": [NOW]},
        to="online_and_offline",
    )
    refs = ["over_the_whole_view:per_count", "over_the_whole_view:plus"]
    rows = pd.DataFrame(
        {"card_id": [1], "event_timestamp": [NOW + timedelta(seconds=1)], "count": [4], "amount": [math.nan]}
    )
    offline = store.get_historical_features(rows, features=refs).to_arrow().to_pylist()[0]
    online = store.get_online_features({"card_id": [1], "count": [4], "amount": [math.nan]}, features=refs).to_dict()
    assert offline["per_count"] == online["per_count"][0] == 25
    assert math.isnan(offline["plus"]) and math.isnan(online["plus"][0])
    for lookup in (
        lambda: store.get_historical_features(rows.assign(count=[0]), features=refs).to_arrow(),
        lambda: store.get_online_features({"card_id": [1], "count": [0], "amount": [1.0]}, features=refs),
    ):
        with pytest.raises(
            OnDemandError, match=r"on-demand view 'over_the_whole_view' .*raised ArrowInvalid: .*divide by zero"
        ):
            lookup()


CONVERSION_DEFS = """
from featurestore import Entity, FeatureView, Field, PushSource, RequestSource, on_demand_feature_view
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
events = PushSource(name="events", schema=[Field("card_id", Int64), Field("avg", Float64), Field("event_timestamp", UnixTimestamp)])
stats = FeatureView(name="stats", entities=[card], source=events, schema=[Field("avg", Float64)])
req = RequestSource(name="req", schema=[Field("n", Int64), Field("x", Float64)])

@on_demand_feature_view(sources=[stats, req], schema=[Field("half", Int64), Field("scaled", Float64)])
def halves(inputs):
    n = inputs["n"].to_pylist()
    return {"half": [None if v is None else v / 2 for v in n], "scaled": [a * b for a, b in zip(n, inputs["x"].to_pylist())]}
"""


def test_request_fields_and_outputs_convert_alike_on_both_paths_or_fail_alike(make_store):
    """Values given as lists were built by ``pa.array(values, type)``, which makes 1.5 an Int64 1
    and True a Float64 1.0: online a request field of 1.5 answered as if 1, while offline (an
    Arrow column, cast) refused it; a function's 1.5 for an Int64 output was served as 1 on both.
    Both paths now convert by the rule pushes follow, and fail alike."""
    from featurestore.errors import OnDemandError

    store = make_store(CONVERSION_DEFS)
    store.push("events", {"card_id": [1], "avg": [2.0], "event_timestamp": [NOW]})
    refs = ["halves:half", "halves:scaled"]

    def both(n, x):
        rows = pd.DataFrame({"card_id": [1], "event_timestamp": [NOW + timedelta(seconds=1)], "n": [n], "x": [x]})
        return (
            lambda: store.get_online_features({"card_id": [1], "n": [n], "x": [x]}, features=refs).to_dict(),
            lambda: store.get_historical_features(rows, features=refs).to_arrow().to_pydict(),
        )

    online, offline = (call() for call in both(4, 0.5))
    assert online["half"] == offline["half"] == [2] and online["scaled"] == offline["scaled"] == [2.0]
    for n, x, error, message in [
        (1.5, 1.0, RequestError, "request field 'n' does not convert to Int64"),
        (True, 1.0, RequestError, "request field 'n' holds bool values"),
        (4, True, RequestError, "request field 'x' holds bool values"),
        (3, 1.0, OnDemandError, "output 'half' does not convert to Int64"),  # (the function's 1.5)
    ]:
        for call in both(n, x):
            with pytest.raises(error, match=message):
                call()
