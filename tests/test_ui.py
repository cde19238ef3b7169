"""The web UI (issue #16): its API on a real pipeline, and every page in headless Chromium.

One small fraud pipeline is built once (apply, push, materialize, export, two training runs,
a registered and promoted model, logged lookups and a recorded consistency check); the UI
runs as a real server process; Debian's Chromium, driven by Playwright, opens each page,
searches, compares two runs and follows lineage, and saves screenshots to
``$FEATURESTORE_SCREENSHOTS`` (default: the test's temp folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from featurestore import FeatureStore
from featurestore.auth import hash_key
from featurestore.consistency import check_service_log, record_check
from featurestore.demo.generate import generate, label_rows
from featurestore.statistics import from_table, merged

from .conftest import demo_repo, free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "fsk_ui-test-key"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    torch = pytest.importorskip("torch")  # noqa: F841  (the test extra has it)
    from featurestore.training.trainer import TrainConfig, train
    from serving.feature_server import create_app

    root = tmp_path_factory.mktemp("ui")
    with demo_repo(root) as repo, FeatureStore(repo) as store:
        data = generate(n_cards=200, days=8, seed=5)
        store.apply()
        store.push("card_profiles", data.profiles)
        store.push("transactions", data.transactions.drop_columns(["label"]), to="online_and_offline")
        store.flush()
        store.materialize_incremental()
        dataset = root / "data" / "datasets" / "v1"
        store.export_training_dataset(label_rows(data.transactions), "fraud_model_v1", dataset)
        runs = [
            train(
                TrainConfig(dataset=str(dataset), request_inputs=["amount"], epochs=1, batch_size=64, learning_rate=lr),
                root / "data" / "runs",
                progress=False,
            )
            for lr in (2e-3, 5e-3)
        ]
        registry = store.model_registry()
        version = registry.register("fraud", runs[1])
        registry.promote("fraud", version, "production")
        with TestClient(create_app(repo, log_features=True)) as client:  # logged lookups, then a real check
            for card in range(1, 40):
                client.post(
                    "/get-online-features",
                    json={
                        "feature_service": "fraud_model_v1",
                        "entities": {"card_id": [card], "merchant_id": [card % 7]},
                    },
                )
        record_check(check_service_log(store, "fraud_model_v1"), store.config.data_dir, "service:fraud_model_v1")
        env = {k: os.environ[k] for k in ("FEATURESTORE_DATA_DIR", "REDIS_URL")}
        yield {"repo": repo, "env": env, "runs": runs, "store": store, "dataset": dataset}


def _serve(pipeline, extra_env: dict[str, str] | None = None):
    port = free_port()
    env = {**os.environ, **pipeline["env"], **(extra_env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "featurestore", "ui", "--repo", str(pipeline["repo"]), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"UI server exited: {process.stderr.read()[-3000:]}")
        try:
            httpx.get(url + "/ui/static/app.js", timeout=1)
            return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    pytest.fail("UI server did not start")


@pytest.fixture(scope="module")
def server(pipeline):
    process, url = _serve(pipeline)
    yield url
    process.terminate()
    process.wait(10)


def test_api_answers_catalogue_runs_curves_lineage(pipeline, server):
    api = server + "/ui/api"
    catalog = httpx.get(api + "/catalog").json()
    views = {v["name"]: v for v in catalog["views"]}
    assert set(views) >= {"card_activity", "card_profile", "merchant_risk"}
    windows = {f["name"]: f.get("window_seconds") for f in views["card_activity"]["features"]}
    assert windows["txn_count_1h"] == 3600 and windows["amount_avg_7d"] == 7 * 86400
    assert [v["name"] for v in httpx.get(api + "/catalog", params={"q": "merchant_amount"}).json()["views"]] == [
        "merchant_risk"
    ]

    view = httpx.get(api + "/views/card_activity").json()
    assert view["status"]["history_rows"] > 0 and view["status"]["online_age_seconds"] is not None
    assert view["consistency"] and view["consistency"][-1]["over_time"]
    # the view's values, from its statistics: downsampled by merging days, so the counts still add up
    stats = httpx.get(api + "/views/card_profile/statistics", params={"points": 3}).json()
    table = pipeline["store"].definitions.layout("card_profile").history_table
    stored = pipeline["store"].offline_store.stats(table)["history_rows"]
    for feature in stats["features"]:
        assert len(feature["over_time"]) <= 3 and sum(b["rows"] for b in feature["over_time"]) == stored
        assert feature["summary"]["rows"] == stored
    (served,) = stats["served"]
    assert served["service"] == "fraud_model_v1" and sum(b["lookups"] for b in served["over_time"]) == 39
    # the training set's distribution, beside the dataset: exact counts, one summary per column
    manifest = json.loads((pipeline["dataset"] / "manifest.json").read_text())
    trained = merged(from_table(pq.read_table(pipeline["dataset"] / manifest["statistics"])))
    data = pq.read_table(pipeline["dataset"] / "data-00000.parquet")
    for column in ("credit_limit", "home_country", "card_id"):
        assert (trained[column].rows, trained[column].nulls) == (data.num_rows, data[column].null_count)
    assert trained["credit_limit"].max == pc.max(data["credit_limit"]).as_py()
    assert httpx.get(api + "/views/no_such_view/statistics").status_code == 404
    assert httpx.get(api + "/views/card_profile/statistics", params={"points": 0}).status_code == 422

    listed = subprocess.run(  # the CLI at 80 columns: whole run ids, the chosen columns
        [
            sys.executable,
            "-m",
            "featurestore",
            "runs",
            "list",
            "--repo",
            str(pipeline["repo"]),
            "--param",
            "config.learning_rate",
            "--metric",
            "val_auc",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **pipeline["env"], "COLUMNS": "80"},
    )
    assert listed.returncode == 0, listed.stderr
    assert all(p.name in listed.stdout for p in pipeline["runs"]) and "0.005" in listed.stdout, listed.stdout
    runs = httpx.get(api + "/runs").json()["runs"]
    assert {r["id"] for r in runs} == {p.name for p in pipeline["runs"]} and all(
        r["status"] == "finished" for r in runs
    )
    a, b = (p.name for p in pipeline["runs"])
    compared = httpx.get(api + "/compare", params=[("runs", a), ("runs", b)]).json()
    assert "config.learning_rate" in compared["differs"]
    line = httpx.get(api + f"/runs/{a}/curve", params={"metric": "train_loss", "points": 20}).json()
    assert len(line["steps"]) == min(20, line["points"]) and line["points"] > 20

    lineage = httpx.get(api + "/models/fraud/1/lineage").json()
    assert lineage["run"]["id"] == b and lineage["run"]["exists"] and lineage["dataset"]["ok"]
    assert all(d["current"] and d["registry_version"] == 1 for d in lineage["definitions"])
    # the view page's values hash is the one the model trained on (the definition hash covers metadata too)
    assert all(views[d["view"]]["values_hash"] == d["hash"] != views[d["view"]]["hash"] for d in lineage["definitions"])
    assert {t["view"] for t in lineage["tables"]} == {"card_activity", "card_profile", "merchant_risk"}
    sha = lineage["model"]["files"]["model.pt"]
    blob = httpx.get(api + f"/artifacts/{sha}")
    assert hashlib.sha256(blob.content).hexdigest() == sha  # anyone can verify a model by its name
    assert httpx.get(api + f"/artifacts/{sha}/verify").json()["ok"]

    # bad input is a clear 4xx, never a 500 or a file outside the stores
    assert httpx.get(api + "/runs/..%2F..%2Fetc").status_code in (404, 422)
    assert httpx.get(api + "/artifacts/not-a-hash").status_code == 422
    assert httpx.get(api + "/models/fraud/9/lineage").status_code == 404
    assert httpx.get(api + "/compare", params={"runs": a}).status_code == 422


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM:
        pytest.skip("no Chromium here: `apt-get install chromium` (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("FEATURESTORE_SCREENSHOTS", tmp_path / "screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_every_page_in_a_real_browser(pipeline, server, browser, shots):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(90_000)  # a loaded 2-core CI machine: waits end when the page is drawn, rarely later
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))

    # catalogue, then search
    page.goto(server + "/ui/")
    page.wait_for_selector("main[data-page=catalog]")
    assert page.locator("tr[data-view]").count() == 3
    page.screenshot(path=str(shots / "catalogue.png"), full_page=True)
    page.fill("#search", "merchant")
    assert page.locator("tr[data-view]").count() == 1 and page.locator("tr[data-view=merchant_risk]").is_visible()

    # a view: freshness cards and the consistency chart
    page.click("tr[data-view=merchant_risk] a")
    page.wait_for_selector("main[data-page=view]")
    assert "history rows" in page.inner_text("#status") and "ago" in page.inner_text("#status")
    assert page.locator(".chart polyline").count() >= 1
    # what the values are: each feature's histogram (history beside served) and its days
    features = page.locator("section.feature")
    assert features.count() >= 1
    first = features.nth(0)
    assert first.locator(".chart rect[data-series^=history]").count() >= 2
    assert first.locator(".chart[data-title$='null rate'] text.axis").count() == 2  # both axes named
    assert page.locator("[data-service=fraud_model_v1] .chart[data-title$='NOT_FOUND rate'] polyline").count() == 1
    assert page.locator("#freshness .chart polyline").count() == 2  # freshness over time: median and p99
    page.screenshot(path=str(shots / "view.png"), full_page=True)
    page.goto(server + "/ui/#/views/card_profile")  # a view served as stored: served values on the same bins
    page.wait_for_selector("main[data-page=view]")
    assert page.locator("section.feature .chart rect[data-series^='served by fraud_model_v1']").count() >= 2
    assert page.locator("section.feature .chart rect[data-series^='training set of fraud v1']").count() >= 2
    page.screenshot(path=str(shots / "view-served.png"), full_page=True)

    # a feature's own page, from the catalogue's search
    page.goto(server + "/ui/#/?q=merchant")
    page.wait_for_selector("main[data-page=catalog]")
    page.click("tr[data-view=merchant_risk] a.feature-link >> nth=0")
    page.wait_for_selector("main[data-page=feature]")
    assert page.locator("section.feature .chart rect").count() >= 2
    page.screenshot(path=str(shots / "feature.png"), full_page=True)

    # runs: select two, compare: differing parameter first, curves overlaid
    page.goto(server + "/ui/#/runs")
    page.wait_for_selector("main[data-page=runs]")
    assert page.locator("tr[data-run]").count() == 2
    assert "took" in page.inner_text("main") and " s" in page.inner_text("tr[data-run] >> nth=0")  # durations
    page.goto(server + "/ui/#/runs?params=config.learning_rate,config.batch_size")  # columns people choose
    page.wait_for_selector("td[data-param='config.learning_rate']")
    rates = sorted(float(t) for t in page.locator("td[data-param='config.learning_rate']").all_inner_texts())
    assert rates == [2e-3, 5e-3] and page.locator("td[data-param='config.batch_size']").all_inner_texts() == ["64"] * 2
    for box in page.locator("input[type=checkbox][data-run]").all():
        box.check()
    page.click("#compare")
    page.wait_for_selector("main[data-page=compare]")
    assert "config.learning_rate" in page.inner_text("tr.differs >> nth=0")
    assert page.locator("td.best").count() >= 1  # the best run marked on each metric that says which way is better
    loss = page.locator(".chart[data-title=train_loss] polyline")
    assert loss.count() == 2 and all(int(p.get_attribute("data-points")) > 3 for p in loss.all())
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    for axis in ("samples", "epoch", "wall_time"):  # the same curves against what runs of other batch sizes share
        page.select_option("#x-axis", axis)
        page.wait_for_selector(f".charts[data-x={axis}]")
        assert page.locator(".chart[data-title=train_loss] polyline").count() == 2, axis

    # models → lineage → the run that trained it
    page.goto(server + "/ui/#/models")
    page.wait_for_selector("main[data-page=models]")
    assert "production" in page.inner_text("tr[data-model='fraud:1']")
    page.click("tr[data-model='fraud:1'] a.lineage")
    page.wait_for_selector("main[data-page=lineage]")
    assert "✓" in page.inner_text("[data-hop=dataset]") and "unchanged" in page.inner_text(
        "[data-hop='feature definitions']"
    )
    page.screenshot(path=str(shots / "lineage.png"), full_page=True)
    page.click("#run-link")
    page.wait_for_selector("main[data-page=run]")
    assert page.locator(".chart[data-title=val_auc] circle").count() >= 1
    assert pipeline["runs"][1].name in page.inner_text("h1")
    page.screenshot(path=str(shots / "run.png"), full_page=True)

    page.goto(server + "/ui/#/consistency")
    page.wait_for_selector("main[data-page=consistency]")
    assert page.locator(".chart circle").count() >= 1  # one recorded check: one point
    page.screenshot(path=str(shots / "consistency.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_with_auth_on_every_route_needs_a_key_and_the_browser_signs_in(pipeline, browser, shots):
    keys = json.dumps([{"name": "ui", "sha256": hash_key(KEY), "scopes": ["read"]}])
    process, url = _serve(pipeline, {"FEATURESTORE_API_KEYS": keys})
    try:
        for path in (
            "/ui/",
            "/ui/static/app.js",
            "/ui/api/catalog",
            "/ui/api/runs",
            "/ui/api/models/fraud/1/lineage",
            "/docs",
        ):
            assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + "/ui/api/catalog", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # a cookie is taken on GET only: a page elsewhere cannot make a signed-in browser write
        assert httpx.post(url + "/ui/api/catalog", headers={"Cookie": f"featurestore_key={KEY}"}).status_code == 401

        page = browser.new_page()
        page.set_default_timeout(90_000)
        page.goto(url + "/ui/")
        page.wait_for_selector("#login")
        page.fill("#key", KEY)
        page.click("#login button")
        page.wait_for_selector("main[data-page=catalog]")
        assert page.locator("tr[data-view=card_activity]").count() == 1
        page.screenshot(path=str(shots / "signed-in.png"))
        page.close()
    finally:
        process.terminate()
        process.wait(10)


def test_a_definition_changed_since_training_shows_in_lineage(pipeline, server):
    """Last in the module (it changes the repo): apply a changed window; the model's lineage names the view."""
    repo = pipeline["repo"]
    source = (repo / "features.py").read_text()
    changed = source.replace(
        'Aggregation("count", timedelta(hours=24), name="merchant_txn_count_24h")',
        'Aggregation("count", timedelta(hours=12), name="merchant_txn_count_24h")',
    )
    assert changed != source
    (repo / "features.py").write_text(changed)
    with FeatureStore(repo) as store:
        store.apply(force=True)
    lineage = httpx.get(server + "/ui/api/models/fraud/1/lineage").json()
    by_view = {d["view"]: d for d in lineage["definitions"]}
    assert not by_view["merchant_risk"]["current"] and by_view["merchant_risk"]["registry_version"] == 1
    assert by_view["card_activity"]["current"] and by_view["card_profile"]["current"]


def test_the_feature_server_serves_the_ui_under_its_keys(pipeline, monkeypatch):
    """`featurestore serve --ui`: the same pages and API under /ui of the feature server, behind its keys."""
    from serving.feature_server import create_app

    with TestClient(create_app(pipeline["repo"], ui=True)) as client:
        assert client.get("/ui/").status_code == 200 and "app.js" in client.get("/ui/").text
        assert {v["name"] for v in client.get("/ui/api/catalog").json()["views"]} >= {"card_activity"}
    monkeypatch.setenv(
        "FEATURESTORE_API_KEYS", json.dumps([{"name": "ui", "sha256": hash_key(KEY), "scopes": ["read"]}])
    )
    with TestClient(create_app(pipeline["repo"], ui=True)) as client:
        assert client.get("/ui/api/catalog").status_code == 401
        assert client.get("/ui/api/catalog", headers={"X-API-Key": KEY}).status_code == 200
        assert client.get("/ui/api/runs", headers={"Cookie": f"featurestore_key={KEY}"}).status_code == 200
