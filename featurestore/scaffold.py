"""`featurestore init`: a small working repo to start from, with its own walkthrough.

Source data lives in ``sources/`` (yours); ``data/`` is the store's own (history, registry,
embedded Redis, runs) and is ignored by git.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError

CONFIG = """\
project: {project}
# Only these modules are imported when the repo is loaded.
modules: [features.py]
# data_dir: data                 # Delta tables, registry, models, embedded Redis files; or s3://bucket/prefix
#                                 (storage_options: {{AWS_ENDPOINT_URL: ...}}; this machine's own files: local_dir)
# online_store: {{url: redis://localhost:6379}}   # default: embedded; REDIS_URL overrides
"""

FEATURES = """\
from datetime import timedelta

from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)

driver_stats_source = FileSource(path="sources/driver_stats.parquet", timestamp_field="event_timestamp")

driver_stats = FeatureView(
    name="driver_stats",
    entities=[driver],
    source=driver_stats_source,
    schema=[Field("conv_rate", Float64), Field("trips_today", Int64)],
    ttl=timedelta(days=1),
)

driver_activity = FeatureService(name="driver_activity", features=[driver_stats])
"""

README = """\
# {project}

A feature repo made by `featurestore init`. From this folder:

```bash
featurestore plan                          # what apply would record
featurestore apply                         # record the definitions in features.py
featurestore materialize-incremental       # compute the views: history (Delta) + online (Redis)
featurestore serve &                       # the feature server on http://127.0.0.1:6566 (docs at /docs)
curl -s localhost:6566/get-online-features -H 'content-type: application/json' \\
     -d '{{"features": ["driver_stats:conv_rate"], "entities": {{"driver_id": [1001, 1002]}}}}'
featurestore export --service driver_activity --entities sources/labels.parquet --out datasets/v1
python train.py                            # export, train and register from Python (the `train` extra)
```

`sources/` holds the example source data and labels; `data/` is the store's own (ignored by git).
"""

GITIGNORE = """\
# the store's own files (history, registry, embedded Redis, runs): rebuilt by `apply` + `materialize`
data/
datasets/
__pycache__/
"""

TRAIN = '''\
"""Export a point-in-time-correct training set for the labels, train a model on it, register it.

Needs the training extra: pip install 'featurestore[train]'."""

from featurestore import FeatureStore
from featurestore.training.trainer import TrainConfig, train

with FeatureStore(".") as store:
    manifest = store.export_training_dataset("sources/labels.parquet", "driver_activity", "datasets/v1")
    print(f"exported {manifest['row_count']} rows")
    run = train(TrainConfig(dataset="datasets/v1", epochs=2), store.config.data_dir / "runs", progress=False)
    version = store.model_registry().register("drivers", run)
    print(f"run {run.name} registered as drivers v{version}; promote it with: featurestore models promote drivers {version}")
'''


def scaffold(path: Path, project: str) -> None:
    if (path / "featurestore.yaml").exists():
        raise FeatureStoreError(f"{path} already holds a feature repo")
    (path / "sources").mkdir(parents=True, exist_ok=True)
    (path / "featurestore.yaml").write_text(CONFIG.format(project=project))
    (path / "features.py").write_text(FEATURES)
    (path / "README.md").write_text(README.format(project=project))
    (path / ".gitignore").write_text(GITIGNORE)
    (path / "train.py").write_text(TRAIN)
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=10)
    rows = [(d, start + timedelta(hours=h), 0.1 * h, h) for d in (1001, 1002) for h in range(10)]
    table = pa.table(
        {
            "driver_id": [r[0] for r in rows],
            "event_timestamp": pa.array([r[1] for r in rows], pa.timestamp("us", tz="UTC")),
            "conv_rate": [r[2] for r in rows],
            "trips_today": [r[3] for r in rows],
        }
    )
    pq.write_table(table, path / "sources" / "driver_stats.parquet")
    labels = pa.table(
        {  # what happened half an hour after each row: something to learn
            "driver_id": [r[0] for r in rows],
            "event_timestamp": pa.array([r[1] + timedelta(minutes=30) for r in rows], pa.timestamp("us", tz="UTC")),
            "label": [int(r[3] % 3 == 0) for r in rows],
        }
    )
    pq.write_table(labels, path / "sources" / "labels.parquet")
