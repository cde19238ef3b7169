"""The same definitions as tests/test_feature_server.py's DEFS, written for Feast (its own registry)."""

from datetime import timedelta

from feast import Entity, FeatureService, FeatureView, Field, FileSource, PushSource, ValueType
from feast.types import Float64, String

card = Entity(name="card", join_keys=["card_id"], value_type=ValueType.INT64)
events = PushSource(name="events", batch_source=FileSource(path="events.parquet", timestamp_field="event_timestamp"))
spend = FeatureView(
    name="spend",
    entities=[card],
    ttl=timedelta(hours=1),
    source=events,
    schema=[Field(name="amount", dtype=Float64), Field(name="country", dtype=String)],
)
svc = FeatureService(name="svc", features=[spend[["amount"]]])
