"""Drift between training and serving (issue #30): PSI and Jensen–Shannon distance equal hand-computed
cases, histograms equal a naive count on random data (nulls, NaN, ±inf, unseen categories), and
`featurestore monitor` flags exactly the feature whose served values were scaled."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from featurestore import FeatureStore
from featurestore.demo.generate import generate
from featurestore.drift import histograms, jensen_shannon, population_stability
from featurestore.feature_logging import log_path, read_log, served_statistics
from featurestore.statistics import merged

from .conftest import demo_repo, examples


def test_psi_and_js_distance_equal_hand_computed_values():
    # PSI: (0.25 - 0.5) ln(0.25 / 0.5) + (0.75 - 0.5) ln(0.75 / 0.5)
    assert math.isclose(
        population_stability(np.array([50, 50]), np.array([25, 75])), 0.25 * math.log(2) + 0.25 * math.log(1.5)
    )
    assert population_stability(np.array([3, 7]), np.array([30, 70])) == 0.0  # shares, not counts
    assert jensen_shannon(np.array([1, 0]), np.array([0, 1])) == 1.0  # disjoint
    assert jensen_shannon(np.array([2, 5, 3]), np.array([4, 10, 6])) == 0.0
    # m = (0.75, 0.25): KL(p||m) = 0.5 log2(2/3) + 0.5 log2(2), KL(q||m) = log2(4/3)
    divergence = (0.5 * math.log2(2 / 3) + 0.5 + math.log2(4 / 3)) / 2
    assert math.isclose(jensen_shannon(np.array([1, 1]), np.array([1, 0])), math.sqrt(divergence))


numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=64), st.integers(-5, 5).map(float))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(numbers, min_size=1, max_size=60), st.lists(numbers, max_size=60))
def test_numeric_histograms_count_every_value_once_in_its_decile(train, served):
    t, s = histograms(pa.array(train, pa.float64()), pa.array(served, pa.float64()))
    finite = np.array([v for v in train if v is not None and math.isfinite(v)])
    edges = np.unique(np.quantile(finite, np.linspace(0, 1, 11)[1:-1])) if finite.size else np.array([])

    def naive(values):  # bin i holds edges[i-1] < v <= ... as searchsorted(side="right"); NaN in the last
        counts = [0] * (len(edges) + 2)
        for v in values:
            if v is None:
                continue
            counts[-1 if math.isnan(v) else sum(1 for e in edges if v >= e)] += 1
        return counts

    assert t.tolist() == naive(train) and s.tolist() == naive(served)
    if t.sum() and t.tolist() == naive(train):
        assert population_stability(t, t) == 0.0


def test_text_histograms_put_unseen_categories_in_one_bin():
    t, s = histograms(pa.array(["a", "b", None, "a"]), pa.array(["b", "c", "d", None]))
    assert t.tolist() == [2, 1, 0] and s.tolist() == [0, 1, 2]


def test_monitor_flags_exactly_the_feature_served_scaled(tmp_path):
    from serving.feature_server import create_app

    with demo_repo(tmp_path) as repo, FeatureStore(repo) as store:
        data = generate(n_cards=200, n_merchants=20, days=8, seed=5)
        store.apply()
        store.push("card_profiles", data.profiles, to="online_and_offline")
        store.push("transactions", data.transactions.drop_columns(["label"]), to="online_and_offline")
        store.flush()
        store.materialize_incremental()
        cards = list(range(1, 201))
        merchants = [c % 20 + 1 for c in cards]
        now = datetime.now(UTC)
        entities = pa.table({"card_id": cards, "merchant_id": merchants, "event_timestamp": [now] * len(cards)})
        dataset = tmp_path / "dataset"
        store.export_training_dataset(entities, "fraud_model_v1", dataset)

        def serve() -> None:
            with TestClient(create_app(repo, log_features=True)) as client:
                body = {"feature_service": "fraud_model_v1", "entities": {"card_id": cards, "merchant_id": merchants}}
                assert client.post("/get-online-features", json=body).status_code == 200

        def monitor() -> subprocess.CompletedProcess:
            command = ["monitor", "--repo", str(repo), "--service", "fraud_model_v1", "--dataset", str(dataset)]
            return subprocess.run(
                [sys.executable, "-m", "featurestore", *command], capture_output=True, text=True, env=dict(os.environ)
            )

        serve()
        steady = monitor()
        assert steady.returncode == 0 and "0 of 10 features past PSI 0.2" in steady.stdout, (
            steady.stdout + steady.stderr
        )
        # every card's profile again, as it stands, but with its credit limit tripled
        aggregates = [("credit_limit", "max"), ("account_age_days", "max"), ("home_country", "max")]
        latest = data.profiles.group_by("card_id").aggregate(aggregates)  # (later profiles only grew)
        scaled = pa.table(
            {
                "card_id": latest["card_id"],
                "credit_limit": pc.multiply(latest["credit_limit_max"], 3.0),
                "account_age_days": latest["account_age_days_max"],
                "home_country": latest["home_country_max"],
                "event_timestamp": pa.array(
                    [datetime.now(UTC)] * latest.num_rows, data.profiles.schema.field("event_timestamp").type
                ),
            }
        )
        store.push("card_profiles", scaled, to="online")
        serve()
        drifted = monitor()
        with TestClient(create_app(repo)) as client:  # the recorded report, for an alert on ..._feature_drifted
            scraped = client.get("/metrics").text
        # the served log's statistics (per hour served) equal its rows
        logged = read_log(log_path(store.config.data_dir, "service:fraud_model_v1"))
        served = merged(served_statistics(store.config.data_dir, "service:fraud_model_v1"))
        assert served["credit_limit"].rows == logged.num_rows == 400
        assert served["credit_limit"].nulls == logged["credit_limit"].null_count
        assert served["credit_limit"].mean == pytest.approx(pc.mean(logged["credit_limit"]).as_py())
        statuses = logged["credit_limit__status"].to_pylist()
        assert dict(served["credit_limit__status"].top()) == {v: statuses.count(v) for v in set(statuses)}
    assert drifted.returncode == 1, drifted.stdout + drifted.stderr
    flagged = [line.split()[0] for line in drifted.stdout.splitlines() if line.endswith("<< drifted")]
    assert flagged == ["credit_limit"], drifted.stdout
    assert "1 of 10 features past PSI 0.2: credit_limit" in drifted.stdout
    prefix = "featurestore_feature_server_feature_drift"
    assert prefix + 'ed{feature="credit_limit",service="fraud_model_v1"} 1.0' in scraped
    assert prefix + 'ed{feature="home_country",service="fraud_model_v1"} 0.0' in scraped
    assert prefix + '_psi{feature="credit_limit",service="fraud_model_v1"} 0.7' in scraped


def test_since_reads_a_window_and_says_what_it_takes():
    from datetime import timedelta

    from featurestore.cli import _window
    from featurestore.errors import FeatureStoreError

    assert [_window(w) for w in ("30m", "6h", "1.5d", "2w")] == [
        timedelta(minutes=30),
        timedelta(hours=6),
        timedelta(days=1.5),
        timedelta(weeks=2),
    ]
    for bad in ("6", "h", "-1d", "1y", ""):
        with pytest.raises(FeatureStoreError, match="number and a unit"):
            _window(bad)


def _monitor(repo, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "featurestore", "monitor", "--repo", str(repo), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )


def test_a_view_whose_recent_days_moved_is_flagged_and_thresholds_are_per_view(make_store):
    from datetime import timedelta

    from serving.feature_server import create_app

    from .test_aggregations import FEATURES, _frame

    store = make_store(FEATURES)
    rng = np.random.default_rng(11)
    # the monitor compares whole UTC event days, so each day's burst lies within its UTC day, and
    # today's before now: at most an hour from midnight, less if the test runs just after it
    now = datetime.now(UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    midnight = today + timedelta(days=1)
    if midnight - now < timedelta(minutes=2):  # the day would end mid-test
        time.sleep((midnight - now).total_seconds() + 1)
        now, today = datetime.now(UTC), midnight
    burst = int(min(3600, max(1, (now - today).total_seconds())))

    def day(offset: int, n: int, scale: float, first_id: int) -> pa.Table:
        return _frame(
            [
                {
                    "payment_id": first_id + i,
                    "card_id": int(rng.integers(1, 50)),
                    "amount": float(rng.lognormal(3, 0.5)) * scale,
                    "kind": str(rng.choice(["web", "pos"])),
                    "event_timestamp": today - timedelta(days=offset) + timedelta(seconds=int(rng.integers(0, burst))),
                }
                for i in range(n)
            ]
        )

    for offset in range(1, 8):  # a steady week
        store.push("payments", day(offset, 400, 1.0, 1000 * offset), to="offline")
    store.push("payments", day(0, 400, 1.0, 0), to="offline")
    store.flush()
    steady = _monitor(store.config.repo_path, "--view", "activity", "--since", "1d")
    assert steady.returncode == 0, steady.stdout + steady.stderr
    assert "0 of 2 features past PSI 0.2" in steady.stdout
    store.push("payments", day(0, 1200, 3.0, 100_000), to="offline")  # today's amounts tripled
    store.flush()
    drifted = _monitor(store.config.repo_path, "--view", "activity", "--since", "1d", "--baseline", "7d")
    assert drifted.returncode == 1, drifted.stdout + drifted.stderr
    flagged = [line.split()[0] for line in drifted.stdout.splitlines() if line.endswith("<< drifted")]
    assert flagged == ["amount"], drifted.stdout
    with TestClient(create_app(store.config.repo_path)) as client:
        scraped = client.get("/metrics").text
    prefix = "featurestore_feature_server_view_feature_drifted"
    assert prefix + '{feature="amount",view="activity"} 1.0' in scraped
    assert prefix + '{feature="kind",view="activity"} 0.0' in scraped
    # a looser threshold for this view alone (monitoring: in featurestore.yaml)
    config = store.config.repo_path / "featurestore.yaml"
    config.write_text(config.read_text() + "monitoring: {thresholds: {activity: 50}}\n")
    loose = _monitor(store.config.repo_path, "--view", "activity", "--since", "1d")
    assert loose.returncode == 0 and "0 of 2 features past PSI 50" in loose.stdout, loose.stdout + loose.stderr
    bad = _monitor(store.config.repo_path, "--view", "activity", "--since", "soon")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "--since" in bad.stdout + bad.stderr
