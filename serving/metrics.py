"""Prometheus metrics of one app: requests by endpoint and status, latency, online-store errors,
feature-log outcomes, and per-view freshness at scrape time."""

from __future__ import annotations

import asyncio
import bisect
import os
import time

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from featurestore.object_requests import METER


class Metrics:
    """Prometheus metrics for one app (its own registry, so tests can build many apps).

    With several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set, as ``featurestore serve
    --workers N`` does) every worker writes its samples to that folder and a scrape of any worker
    reports the sum over all of them."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{prefix}_requests_total",
            "Requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{prefix}_request_seconds",
            "Request latency by endpoint.",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
        )
        self.redis_errors = Counter(
            f"{prefix}_redis_errors_total", "Online store (Redis) errors.", registry=self.registry
        )
        self.feature_log = Counter(
            f"{prefix}_feature_log_total",
            "Feature log: rows logged or dropped (past the buffer's bound "
            "while flushes fail), and failed flushes, per log.",
            ["log", "outcome"],
            registry=self.registry,
        )
        self.object_requests = Counter(
            f"{prefix}_object_requests_total",
            "Object-storage requests by the kind S3 bills (GET, HEAD, PUT, POST, LIST, DELETE), and "
            "Delta log operations (delta snapshot, delta commit), made by this app's processes.",
            ["kind"],
            registry=self.registry,
        )
        self.object_bytes = Counter(
            f"{prefix}_object_bytes_total",
            "Bytes sent to and received from object storage.",
            ["direction"],
            registry=self.registry,
        )
        self._objects_counted = METER.snapshot()  # this app counts what its process requests from now on
        self._children: dict[tuple[str, int], tuple] = {}
        self._pending: dict[tuple[str, int], list[float]] = {}  # request durations not yet in Prometheus
        self._flush_scheduled = False

    def feature_log_counts(self, name: str):
        """The ``count`` callback of a ``FeatureLogger`` named ``name``: its outcomes as metrics."""
        return lambda outcome, n: self.feature_log.labels(name, outcome.replace(" ", "_")).inc(n)

    def observe(self, endpoint: str, status: int, started: float) -> None:
        """Count a request. Kept in a plain dict and handed to Prometheus in bulk within
        ``FLUSH_SECONDS`` (and at each scrape): a Counter and a Histogram update per request
        cost ~5 µs of a lookup's ~80."""
        durations = self._pending.setdefault((endpoint, status), [])
        durations.append(time.perf_counter() - started)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)
            except RuntimeError:  # no event loop: at once
                self.flush()
        elif len(durations) >= MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        """Hand the requests counted since the last flush to Prometheus."""
        self._flush_scheduled = False
        self._count_object_requests()
        pending, self._pending = self._pending, {}
        for key, durations in pending.items():
            endpoint, status = key
            children = self._children.get(key)
            if children is None:  # label lookups take a lock; do them once per (endpoint, status)
                children = self._children[key] = (
                    self.requests.labels(endpoint, str(status)),
                    self.latency.labels(endpoint),
                )
            children[0].inc(len(durations))
            _observe_all(children[1], durations)

    def _count_object_requests(self) -> None:
        """Hand the object requests this process made since the last flush to Prometheus."""
        now = METER.snapshot()
        for kind, total in now.items():
            n = total - self._objects_counted.get(kind, 0)
            if not n:
                continue
            if kind.startswith("bytes "):
                self.object_bytes.labels(kind.split()[1]).inc(n)
            else:
                self.object_requests.labels(kind).inc(n)
        self._objects_counted = now

    def response(
        self,
        newest_events: dict[str, int] | None = None,
        drift: list[dict] | None = None,
        behind: dict[str, bool] | None = None,
    ) -> Response:
        """The metrics text; ``newest_events`` (view -> newest event time online, µs) adds per-view
        freshness, ``drift`` (``featurestore.drift.read_drift``) each feature's last measured drift,
        ``behind`` (``featurestore.catalog.online_behind``) whether each view's online store lacks history."""
        self.flush()
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        body = generate_latest(registry)
        families: list[GaugeMetricFamily] = []
        if newest_events:
            now = time.time()
            freshness = GaugeMetricFamily(
                f"{self.prefix}_view_freshness_seconds",
                "Age of the newest event written online, per view.",
                labels=["view"],
            )
            for view, us in sorted(newest_events.items()):
                freshness.add_metric([view], max(0.0, now - us / 1e6))
            families.append(freshness)
        if behind:
            lacking = GaugeMetricFamily(
                f"{self.prefix}_view_online_behind",
                "1 while the online store lacks rows of the view's history (a crash between the stores, an "
                "offline-only push, a changed layout, an emptied or replaced Redis): run featurestore materialize.",
                labels=["view"],
            )
            for view, is_behind in sorted(behind.items()):
                lacking.add_metric([view], float(is_behind))
            families.append(lacking)
        if families:
            extra = CollectorRegistry()
            extra.register(_Fixed(families))
            body += generate_latest(extra)
        if drift:
            body += generate_latest(_drift_registry(self.prefix, drift))
        return Response(body, media_type="text/plain; version=0.0.4")


def _drift_registry(prefix: str, reports: list[dict]) -> CollectorRegistry:
    """Services' drift (training vs served) and views' (recent event days vs the days before)."""
    families = []
    for kind, name, compared in (
        ("service", "feature", "training vs served"),
        ("view", "view_feature", "recent vs before"),
    ):
        metrics = {
            "psi": GaugeMetricFamily(
                f"{prefix}_{name}_drift_psi",
                f"Population stability index, {compared} (featurestore monitor).",
                labels=[kind, "feature"],
            ),
            "js_distance": GaugeMetricFamily(
                f"{prefix}_{name}_drift_js_distance", f"Jensen-Shannon distance, {compared}.", labels=[kind, "feature"]
            ),
            "flagged": GaugeMetricFamily(
                f"{prefix}_{name}_drifted",
                "1 when the feature's PSI passed the monitor's threshold.",
                labels=[kind, "feature"],
            ),
        }
        for report in reports:
            if report.get("kind", "service") != kind:
                continue
            for feature in report.get("features", []):
                for key, family in metrics.items():
                    value = feature.get(key)
                    if value is not None:
                        family.add_metric([report[kind], feature["name"]], float(value))
        families += list(metrics.values())
    registry = CollectorRegistry()
    registry.register(_Fixed(families))
    return registry


FLUSH_SECONDS = 1.0  # how far request metrics may lag (a scrape also flushes its own worker's)
MAX_PENDING = 10_000  # requests of one (endpoint, status) counted before a flush, whatever the time


def _observe_all(histogram: Histogram, durations: list[float]) -> None:
    """``histogram.observe(d)`` for each duration, as one update per bucket: bucket counts by
    bisection, then prometheus_client's value objects (its ``_sum`` and ``_buckets``, which a
    worker writes to its multiprocess files) incremented once each."""
    if not _BULK_HISTOGRAMS:
        for d in durations:
            histogram.observe(d)
        return
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    for d in durations:
        counts[bisect.bisect_left(bounds, d)] += 1  # the first bound >= d, as observe() picks it
    histogram._sum.inc(sum(durations))
    for bucket, count in zip(histogram._buckets, counts):
        if count:
            bucket.inc(count)


# prometheus_client has no bulk observe: the counts go to the value objects it keeps for one
# (private; tests/test_feature_server.py checks they match observe's); any other layout, one by one
_BULK_HISTOGRAMS = {"_upper_bounds", "_sum", "_buckets"} <= set(vars(Histogram("probe", "probe", registry=None)))


class _Fixed:
    """A collector of metric families computed at scrape time."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)
