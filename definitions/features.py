"""Card-payment fraud features: one definition each, materialized to history and Redis.

Raw events arrive through push sources (the demo pushes history in bulk, then replays
held-out transactions one by one); per-card and per-merchant activity are windowed
aggregations, exact at any moment offline and online.
"""

from datetime import timedelta

from featurestore import Aggregation, Entity, FeatureService, FeatureView, Field, PushSource
from featurestore.types import Float64, Int32, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64, description="A payment card.")
merchant = Entity(
    name="merchant", join_keys=["merchant_id"], value_type=Int64, description="A merchant accepting cards."
)

transactions = PushSource(
    name="transactions",
    schema=[
        Field("transaction_id", Int64),
        Field("card_id", Int64),
        Field("merchant_id", Int64),
        Field("amount", Float64),
        Field("event_timestamp", UnixTimestamp),
    ],
)

card_profiles = PushSource(
    name="card_profiles",
    schema=[
        Field("card_id", Int64),
        Field("credit_limit", Float64),
        Field("account_age_days", Int32),
        Field("home_country", String),
        Field("event_timestamp", UnixTimestamp),
    ],
)

card_profile = FeatureView(
    name="card_profile",
    entities=[card],
    source=card_profiles,
    schema=[Field("credit_limit", Float64), Field("account_age_days", Int32), Field("home_country", String)],
    description="Slowly changing card attributes.",
    owner="risk-team",
)

# Windowed aggregations: the value at time t counts the card's payments in (t - window, t],
# offline at each training row's time and online at the moment of the lookup. Each payment
# updates the online windows as it is pushed (once per transaction_id, however often retried).
card_activity = FeatureView(
    name="card_activity",
    entities=[card],
    source=transactions,
    event_id="transaction_id",
    schema=[Field("transaction_id", Int64), Field("amount", Float64)],
    aggregations=[
        Aggregation("count", timedelta(hours=1), name="txn_count_1h"),
        Aggregation("count", timedelta(hours=24), name="txn_count_24h"),
        Aggregation("sum", timedelta(hours=24), "amount"),
        Aggregation("mean", timedelta(days=7), "amount", name="amount_avg_7d"),
        Aggregation("max", timedelta(days=7), "amount"),
    ],
    description="Per-card activity over trailing 1 h / 24 h / 7 d windows.",
    owner="risk-team",
)

merchant_risk = FeatureView(
    name="merchant_risk",
    entities=[merchant],
    source=transactions,
    event_id="transaction_id",
    schema=[Field("transaction_id", Int64), Field("amount", Float64)],
    aggregations=[
        Aggregation("count", timedelta(hours=24), name="merchant_txn_count_24h"),
        Aggregation("mean", timedelta(days=7), "amount", name="merchant_amount_avg_7d"),
    ],
    description="Merchant traffic and ticket size: fraud clusters at a few merchants.",
    owner="risk-team",
)

fraud_model_v1 = FeatureService(
    name="fraud_model_v1",
    features=[card_profile, card_activity, merchant_risk],
    description="Features of the fraud classifier.",
)
