"""Seeded card-payment data with a planted fraud signal.

Normal cards spend a few times a day at ordinary merchants. A compromised card shows a
burst of large payments (relative to its credit limit) within an hour or two, mostly at a
handful of risky merchants: the burst shows in per-card windows (1 h counts, 24 h sums),
the size in the amount and its ratio to the limit, the merchants in merchant traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

TS = pa.timestamp("us", tz="UTC")
COUNTRIES = ["US", "FR", "DE", "GB", "BR", "IN"]


@dataclass
class DemoData:
    profiles: pa.Table  # card_id, credit_limit, account_age_days, home_country, event_timestamp
    transactions: pa.Table  # transaction_id, card_id, merchant_id, amount, event_timestamp, label


def generate(
    n_cards: int = 2000, n_merchants: int = 200, days: int = 30, seed: int = 7, end: datetime | None = None
) -> DemoData:
    rng = np.random.default_rng(seed)
    end = (end or datetime.now(UTC)).replace(microsecond=0)
    start = end - timedelta(days=days)
    start_us = int(start.timestamp() * 1e6)
    span_us = days * 86_400 * 10**6

    # profiles: one row before the period, a credit-limit change for some cards midway
    card_ids = np.arange(1, n_cards + 1, dtype=np.int64)
    limits = np.round(rng.lognormal(8.0, 0.5, n_cards), -1)
    ages = rng.integers(30, 3000, n_cards).astype(np.int32)
    countries = rng.choice(COUNTRIES, n_cards)
    changed = rng.random(n_cards) < 0.1
    profile_ts = np.concatenate(
        [np.full(n_cards, start_us - 86_400 * 10**6), start_us + rng.integers(0, span_us, changed.sum())]
    )
    profiles = pa.table(
        {
            "card_id": np.concatenate([card_ids, card_ids[changed]]),
            "credit_limit": np.concatenate([limits, limits[changed] * 1.5]),
            "account_age_days": np.concatenate([ages, ages[changed] + 10]),
            "home_country": np.concatenate([countries, countries[changed]]),
            "event_timestamp": pa.array(profile_ts, pa.int64()).cast(TS),
        }
    )

    # normal spending: a bit more than one payment per card per day
    n_normal = int(n_cards * days * 1.2)
    risky = rng.choice(np.arange(1, n_merchants + 1), max(1, n_merchants // 20), replace=False)
    normal_card = rng.integers(1, n_cards + 1, n_normal)
    normal_ts = start_us + rng.integers(0, span_us, n_normal)
    normal_merchant = rng.integers(1, n_merchants + 1, n_normal)
    normal_amount = np.round(rng.lognormal(3.5, 1.1, n_normal), 2)

    # fraud: ~5% of cards compromised once, each with a burst of 3-8 payments in up to 2 hours
    victims = rng.choice(card_ids, max(1, n_cards // 20), replace=False)
    bursts = rng.integers(3, 9, len(victims))
    f_card = np.repeat(victims, bursts)
    f_start = np.repeat(start_us + rng.integers(0, span_us - 3 * 3_600 * 10**6, len(victims)), bursts)
    f_ts = f_start + rng.integers(0, 2 * 3_600 * 10**6, len(f_card))
    f_merchant = np.where(
        rng.random(len(f_card)) < 0.7, rng.choice(risky, len(f_card)), rng.integers(1, n_merchants + 1, len(f_card))
    )
    f_amount = np.round(limits[f_card - 1] * rng.uniform(0.01, 0.25, len(f_card)), 2)

    order = np.argsort(np.concatenate([normal_ts, f_ts]), kind="stable")
    n = len(order)
    transactions = pa.table(
        {
            "transaction_id": np.arange(1, n + 1, dtype=np.int64),
            "card_id": np.concatenate([normal_card, f_card])[order],
            "merchant_id": np.concatenate([normal_merchant, f_merchant]).astype(np.int64)[order],
            "amount": np.concatenate([normal_amount, f_amount])[order],
            "event_timestamp": pa.array(np.concatenate([normal_ts, f_ts])[order], pa.int64()).cast(TS),
            "label": np.concatenate([np.zeros(n_normal, np.int32), np.ones(len(f_card), np.int32)])[order],
        }
    )
    return DemoData(profiles, transactions)


def label_rows(transactions: pa.Table) -> pa.Table:
    """Training rows: the moment just before each payment, so its own row never feeds its features."""
    import pyarrow.compute as pc

    before = pc.subtract(transactions["event_timestamp"].cast(pa.int64()), 1).cast(TS)
    return pa.table(
        {
            "transaction_id": transactions["transaction_id"],
            "card_id": transactions["card_id"],
            "merchant_id": transactions["merchant_id"],
            "amount": transactions["amount"],
            "event_timestamp": before,
            "label": transactions["label"],
        }
    )


def load_demo(store: FeatureStore, data: DemoData, dataset: Path) -> None:
    """The demo's data in ``store`` (applied, pushed, materialized) and its training set exported
    to ``dataset``: what benchmarks and tests that serve a model start from."""
    store.apply()
    store.push("card_profiles", data.profiles)
    store.push("transactions", data.transactions.drop_columns(["label"]), to="offline")
    store.materialize_incremental()
    store.export_training_dataset(label_rows(data.transactions), "fraud_model_v1", dataset)
