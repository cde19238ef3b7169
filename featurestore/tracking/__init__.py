"""Experiment tracking: runs with params, tags, an append-only metric store, content-addressed
artifacts, downsampled curves, comparison, and lineage from a model back to Delta versions.

One module per job: ``metric_store`` (records on disk), ``runs`` (a run's folder, listing,
comparison, curves), ``lttb`` (downsampling), ``artifacts`` (files named by their hash),
``lineage`` (model → run → dataset → definitions → tables).
"""

from featurestore.tracking.artifacts import ArtifactStore
from featurestore.tracking.lttb import lttb
from featurestore.tracking.metric_store import MetricWriter, read_metrics
from featurestore.tracking.runs import Run, compare, curve, flat_params, list_runs, plot_compare, read_run, set_tags

__all__ = [
    "ArtifactStore",
    "MetricWriter",
    "Run",
    "compare",
    "curve",
    "flat_params",
    "list_runs",
    "lttb",
    "plot_compare",
    "read_metrics",
    "read_run",
    "set_tags",
]
