"""Card-payment fraud features: one definition each, materialized to history and Redis.

Raw events arrive through push sources (the demo pushes history in bulk, then replays
held-out transactions); SQL transformations compute per-card and per-merchant activity
with DuckDB window functions at each transaction's time.
"""

from datetime import timedelta

from featurestore import Entity, FeatureService, FeatureView, Field, PushSource
from featurestore.types import Float64, Int32, Int64, String, UnixTimestamp

card = Entity(name="card", join_keys=["card_id"], value_type=Int64, description="A payment card.")
merchant = Entity(name="merchant", join_keys=["merchant_id"], value_type=Int64, description="A merchant accepting cards.")

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

# Windows end at (and include) each transaction, so a row describes the card right after it.
# Training labels are taken just before each transaction, so a row never feeds its own score.
card_activity = FeatureView(
    name="card_activity",
    entities=[card],
    source=transactions,
    ttl=timedelta(days=7),
    transformation="""
        SELECT card_id, event_timestamp,
            count(*) OVER w1h AS txn_count_1h,
            count(*) OVER w24h AS txn_count_24h,
            sum(amount) OVER w24h AS amount_sum_24h,
            avg(amount) OVER w7d AS amount_avg_7d,
            max(amount) OVER w7d AS amount_max_7d
        FROM source
        WINDOW
            w1h AS (PARTITION BY card_id ORDER BY event_timestamp RANGE BETWEEN INTERVAL 1 HOUR PRECEDING AND CURRENT ROW),
            w24h AS (PARTITION BY card_id ORDER BY event_timestamp RANGE BETWEEN INTERVAL 24 HOURS PRECEDING AND CURRENT ROW),
            w7d AS (PARTITION BY card_id ORDER BY event_timestamp RANGE BETWEEN INTERVAL 7 DAYS PRECEDING AND CURRENT ROW)
    """,
    schema=[
        Field("txn_count_1h", Int64),
        Field("txn_count_24h", Int64),
        Field("amount_sum_24h", Float64),
        Field("amount_avg_7d", Float64),
        Field("amount_max_7d", Float64),
    ],
    description="Per-card activity over trailing 1 h / 24 h / 7 d windows.",
    owner="risk-team",
)

merchant_risk = FeatureView(
    name="merchant_risk",
    entities=[merchant],
    source=transactions,
    ttl=timedelta(days=7),
    transformation="""
        SELECT merchant_id, event_timestamp,
            count(*) OVER w24h AS merchant_txn_count_24h,
            avg(amount) OVER w7d AS merchant_amount_avg_7d
        FROM source
        WINDOW
            w24h AS (PARTITION BY merchant_id ORDER BY event_timestamp RANGE BETWEEN INTERVAL 24 HOURS PRECEDING AND CURRENT ROW),
            w7d AS (PARTITION BY merchant_id ORDER BY event_timestamp RANGE BETWEEN INTERVAL 7 DAYS PRECEDING AND CURRENT ROW)
    """,
    schema=[Field("merchant_txn_count_24h", Int64), Field("merchant_amount_avg_7d", Float64)],
    description="Merchant traffic and ticket size: fraud clusters at a few merchants.",
    owner="risk-team",
)

fraud_model_v1 = FeatureService(
    name="fraud_model_v1",
    features=[card_profile, card_activity, merchant_risk],
    description="Features of the fraud classifier.",
)
