"""What Feast's clients send and expect (issue #12): request defaults, response shape, SDK signatures."""

from __future__ import annotations

from datetime import UTC, timedelta

import pandas as pd
import pytest

from .test_feature_server import NOW, client, push  # noqa: F401 - the fixture


def test_feature_service_with_an_empty_feature_list(client):  # noqa: F811
    """Feast's request model defaults `features` to [], so generated clients send it with a service."""
    push(client, [1], [3.5], [NOW - timedelta(minutes=1)])
    response = client.post(
        "/get-online-features", json={"feature_service": "svc", "features": [], "entities": {"card_id": [1]}}
    )
    assert response.status_code == 200 and response.json()["results"][1]["values"] == [3.5]


def test_missing_values_carry_feasts_1970_timestamp(client):  # noqa: F811
    body = client.post(
        "/get-online-features", json={"features": ["spend:amount"], "entities": {"card_id": [404]}}
    ).json()
    assert body["results"][0]["event_timestamps"] == ["1970-01-01T00:00:00Z"]
    assert body["results"][1]["event_timestamps"] == ["1970-01-01T00:00:00Z"] and body["results"][1]["statuses"] == [
        "NOT_FOUND"
    ]


def test_duplicate_feature_refs_are_an_error(client):  # noqa: F811
    response = client.post(
        "/get-online-features", json={"features": ["spend:amount", "spend:amount"], "entities": {"card_id": [1]}}
    )
    assert response.status_code == 422 and "twice" in response.json()["detail"]


def test_push_without_to_writes_online_only_as_feast_does(client, tmp_path):  # noqa: F811
    from featurestore import FeatureStore

    assert push(client, [5], [9.0], [NOW - timedelta(minutes=1)]).status_code == 200
    store = FeatureStore(tmp_path / "repo")
    assert store.get_online_features([{"card_id": 5}], features=["spend:amount"]).to_dict()["amount"] == [9.0]
    offline = store.get_historical_features(
        pd.DataFrame({"card_id": [5], "event_timestamp": [NOW]}), features=["spend:amount"]
    ).to_df()
    assert offline["amount"].isna().all()  # history was not asked for
    store.close()


def test_sdk_takes_feasts_signatures(client, tmp_path):  # noqa: F811
    from featurestore import FeatureStore

    push(client, [6], [1.25], [NOW - timedelta(minutes=1)])
    store = FeatureStore(tmp_path / "repo")
    positional = store.get_online_features(["spend:amount"], [{"card_id": 6}])  # Feast: (features, entity_rows)
    assert positional.to_dict() == {"card_id": [6], "amount": [1.25]}  # Feast's to_dict: column -> values
    by_service = store.get_online_features(features=store.get_feature_service("svc"), entity_rows=[{"card_id": 6}])
    assert by_service.to_dict() == {"card_id": [6], "amount": [1.25]}
    store.close()


def test_keys_are_coerced_by_declared_type_where_unambiguous(make_store):
    """Issue #12: Feast clients send "17" for an Int64 key (and 17 for a String key); those were 422."""
    from datetime import datetime

    from featurestore.errors import RequestError

    defs = """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, Int64, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64)
src = PushSource(name="src", schema=[Field("card_id", Int64), Field("v", Float64), Field("event_timestamp", UnixTimestamp)])
view = FeatureView(name="view", entities=[card], source=src, schema=[Field("v", Float64)])
"""
    store = make_store(defs)
    store.push("src", {"card_id": [17], "v": [1.5], "event_timestamp": [datetime.now(UTC)]})
    got = store.get_online_features({"card_id": [17, "17", 17.0, "-3"]}, features=["view:v"])
    assert got.to_dict() == {"card_id": [17, 17, 17, -3], "v": [1.5, 1.5, 1.5, None]}
    assert store.get_online_features({"card_id": [2**64]}, features=["view:v"]).statuses[1] == [
        "NOT_FOUND"
    ]  # no such entity
    for bad in ("017", "17a", 17.5, True, "1e3"):
        with pytest.raises(RequestError, match="takes Int64"):
            store.get_online_features({"card_id": [bad]}, features=["view:v"])


def test_write_to_online_store_and_epoch_timestamps(client):  # noqa: F811 - the fixture
    """Issue #12: Feast's SDK `write_to_online_store` (and `push` through its remote store) call
    POST /write-to-online-store: it was a 404. Epoch-second timestamps were a 422."""
    epoch = int(NOW.timestamp()) - 60
    written = client.post(
        "/write-to-online-store",
        json={
            "feature_view_name": "spend",
            "allow_registry_cache": True,
            "df": {
                "card_id": [41, 42],
                "amount": [4.5, 9.0],
                "country": ["FR", "DE"],
                "event_timestamp": [epoch, epoch],
            },
        },
    )
    assert written.status_code == 200 and written.json() == {"written_rows": 2}
    body = client.post(
        "/get-online-features", json={"features": ["spend:amount"], "entities": {"card_id": [41, 42]}}
    ).json()
    assert body["results"][1]["values"] == [4.5, 9.0] and body["results"][1]["statuses"] == ["PRESENT", "PRESENT"]
    pushed = client.post(
        "/push",
        json={
            "push_source_name": "events",
            "df": {"card_id": [43], "amount": [1.0], "country": ["FR"], "event_timestamp": [epoch + 0.5]},
        },
    )
    assert pushed.status_code == 200
    for bad in (
        {"feature_view_name": "nope", "df": {"card_id": [1]}},
        {"feature_view_name": "spend", "df": {"card_id": [1]}},
        {
            "feature_view_name": "spend",
            "df": {"card_id": [1], "amount": [1.0], "country": ["x"], "event_timestamp": [True]},
        },
    ):
        answer = client.post("/write-to-online-store", json=bad)
        assert answer.status_code in (404, 422), answer.text


def test_errors_in_feasts_shape_when_asked(tmp_path, redis_url, monkeypatch):
    """Issue #12: Feast's client logged "Invalid error detail" for our {"detail": ...} bodies.
    With `server: {errors: feast}` they are Feast's detail, which its SDK raises as a typed error
    (tests/test_feast_clients.py runs Feast's own client against it)."""
    import json

    from fastapi.testclient import TestClient

    from serving.feature_server import create_app

    from .conftest import write_repo
    from .test_feature_server import DEFS

    monkeypatch.delenv("REDIS_URL", raising=False)
    root = write_repo(tmp_path / "repo", DEFS, url=redis_url)
    (root / "featurestore.yaml").write_text((root / "featurestore.yaml").read_text() + "server: {errors: feast}\n")
    from featurestore import FeatureStore

    with FeatureStore(root) as store:
        store.apply()
    with TestClient(create_app(root)) as c:
        answer = c.post("/get-online-features", json={"features": ["nope:x"], "entities": {"card_id": [1]}})
        detail = json.loads(answer.json())  # a JSON string holding the detail, as Feast's server sends
        assert answer.status_code == 404 and detail["module"] == "feast.errors"
        assert detail["class"] == "FeastObjectNotFoundException" and "nope" in detail["message"]
        bad = c.post("/push", json={"push_source_name": "events", "df": {"card_id": ["x"]}})
        assert json.loads(bad.json())["class"] == "FeastError"


def test_pushed_epoch_milliseconds_and_version_metadata_as_feast(client, tmp_path):  # noqa: F811
    """Pushes with epoch-millisecond timestamps got 422 ("date value out of range") where Feast takes
    them; ``include_feature_view_version_metadata`` was ignored."""
    when = NOW - timedelta(minutes=2)
    millis = int(when.timestamp() * 1000)
    for card, stamp in ((31, millis), (32, millis * 1000), (33, int(when.timestamp())), (34, millis * 1_000_000)):
        response = client.post(
            "/push",
            json={
                "push_source_name": "events",
                "df": {"card_id": [card], "amount": [1.5], "country": ["FR"], "event_timestamp": [stamp]},
            },
        )
        assert response.status_code == 200, response.text
    body = client.post(
        "/get-online-features",
        json={
            "features": ["spend:amount"],
            "entities": {"card_id": [31, 32, 33, 34]},
            "include_feature_view_version_metadata": True,
        },
    ).json()
    assert body["results"][1]["values"] == [1.5] * 4
    stamps = body["results"][1]["event_timestamps"]
    assert (
        stamps[0]
        == stamps[1]
        == stamps[3]
        == when.replace(microsecond=(when.microsecond // 1000) * 1000).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    )
    assert body["metadata"]["feature_view_metadata"] == [{"name": "spend", "version": 1}]
    plain = client.post(
        "/get-online-features", json={"features": ["spend:amount"], "entities": {"card_id": [31]}}
    ).json()
    assert "feature_view_metadata" not in plain["metadata"]


def test_timestamp_join_keys_over_rest(make_store):
    """Timestamp join keys could not be looked up over REST: ISO with an offset, ``Z``, a space
    separator and epoch µs all got 422 (only a Python datetime was taken)."""
    from datetime import datetime

    from fastapi.testclient import TestClient

    from serving.feature_server import create_app

    defs = """
from featurestore import Entity, FeatureView, Field, PushSource
from featurestore.types import Float64, UnixTimestamp
day = Entity(name="day", join_keys=["day"], value_type=UnixTimestamp)
src = PushSource(name="days", schema=[Field("day", UnixTimestamp), Field("total", Float64), Field("event_timestamp", UnixTimestamp)])
daily = FeatureView(name="daily", entities=[day], source=src, schema=[Field("total", Float64)])
"""
    store = make_store(defs)
    day = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    store.push("days", {"day": [day], "total": [42.0], "event_timestamp": [NOW - timedelta(minutes=1)]}, to="online")
    micros = int(day.timestamp()) * 1_000_000
    with TestClient(create_app(store.config.repo_path)) as c:
        keys = [
            "2024-05-01T12:00:00Z",
            "2024-05-01T14:00:00+02:00",
            "2024-05-01 12:00:00",
            micros,
            int(day.timestamp()),
            "nope",
        ]
        for key in keys[:-1]:
            body = c.post("/get-online-features", json={"features": ["daily:total"], "entities": {"day": [key]}})
            assert body.status_code == 200 and body.json()["results"][1]["values"] == [42.0], (key, body.text)
        bad = c.post("/get-online-features", json={"features": ["daily:total"], "entities": {"day": ["nope"]}})
        assert bad.status_code == 422 and "UnixTimestamp" in bad.json()["detail"]
