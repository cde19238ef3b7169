"""What Feast's clients send and expect (issue #12): request defaults, response shape, SDK signatures."""

from __future__ import annotations

from datetime import timedelta

import pandas as pd

from .test_feature_server import NOW, client, push  # noqa: F401 - the fixture


def test_feature_service_with_an_empty_feature_list(client):  # noqa: F811
    """Feast's request model defaults `features` to [], so generated clients send it with a service."""
    push(client, [1], [3.5], [NOW - timedelta(minutes=1)])
    response = client.post("/get-online-features", json={"feature_service": "svc", "features": [], "entities": {"card_id": [1]}})
    assert response.status_code == 200 and response.json()["results"][1]["values"] == [3.5]


def test_missing_values_carry_feasts_1970_timestamp(client):  # noqa: F811
    body = client.post("/get-online-features", json={"features": ["spend:amount"], "entities": {"card_id": [404]}}).json()
    assert body["results"][0]["event_timestamps"] == ["1970-01-01T00:00:00Z"]
    assert body["results"][1]["event_timestamps"] == ["1970-01-01T00:00:00Z"] and body["results"][1]["statuses"] == ["NOT_FOUND"]


def test_duplicate_feature_refs_are_an_error(client):  # noqa: F811
    response = client.post("/get-online-features", json={"features": ["spend:amount", "spend:amount"], "entities": {"card_id": [1]}})
    assert response.status_code == 422 and "twice" in response.json()["detail"]


def test_push_without_to_writes_online_only_as_feast_does(client, tmp_path):  # noqa: F811
    from featurestore import FeatureStore

    assert push(client, [5], [9.0], [NOW - timedelta(minutes=1)]).status_code == 200
    store = FeatureStore(tmp_path / "repo")
    assert store.get_online_features([{"card_id": 5}], features=["spend:amount"]).to_dict()["amount"] == [9.0]
    offline = store.get_historical_features(pd.DataFrame({"card_id": [5], "event_timestamp": [NOW]}), features=["spend:amount"]).to_df()
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
