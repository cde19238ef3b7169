"""Run by Feast 0.67's own Python, in its own environment: Feast's SDK with the `remote` online
store pointed at our feature server. Prints one JSON line of what it saw."""

import json
import sys
from datetime import UTC, datetime, timedelta

import pandas as pd
from feast import FeatureStore
from feast.data_source import PushMode

store = FeatureStore(repo_path=sys.argv[1])
now = datetime.now(UTC) - timedelta(seconds=30)
seen = {}

store.write_to_online_store(
    "spend",
    pd.DataFrame({"card_id": [1, 2], "amount": [10.5, 20.0], "country": ["FR", "DE"], "event_timestamp": [now, now]}),
)
rows = [{"card_id": 1}, {"card_id": 2}, {"card_id": 99}]
seen["list"] = store.get_online_features(features=["spend:amount", "spend:country"], entity_rows=rows).to_dict()
seen["service"] = store.get_online_features(features=store.get_feature_service("svc"), entity_rows=rows).to_dict()
store.push(
    "events",
    pd.DataFrame({"card_id": [3], "amount": [7.0], "country": ["US"], "event_timestamp": [now]}),
    to=PushMode.ONLINE,
)
seen["pushed"] = store.get_online_features(features=["spend:amount"], entity_rows=[{"card_id": 3}]).to_dict()
try:
    store.get_online_features(features=["spend:nope"], entity_rows=rows)
except Exception as exc:  # noqa: BLE001 - what the client raises is the point
    seen["error"] = {"type": type(exc).__name__, "message": str(exc)}
print(json.dumps(seen, default=str))
