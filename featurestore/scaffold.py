"""`featurestore init`: a small working repo to start from."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from featurestore.errors import FeatureStoreError

CONFIG = """\
project: {project}
# Only these modules are imported when the repo is loaded.
modules: [features.py]
# data_dir: data                 # Delta tables, registry, embedded Redis files
# online_store: {{url: redis://localhost:6379}}   # default: embedded; REDIS_URL overrides
"""

FEATURES = '''\
from datetime import timedelta

from featurestore import Entity, FeatureService, FeatureView, Field, FileSource
from featurestore.types import Float64, Int64

driver = Entity(name="driver", join_keys=["driver_id"], value_type=Int64)

driver_stats_source = FileSource(path="data/driver_stats.parquet", timestamp_field="event_timestamp")

driver_stats = FeatureView(
    name="driver_stats",
    entities=[driver],
    source=driver_stats_source,
    schema=[Field("conv_rate", Float64), Field("trips_today", Int64)],
    ttl=timedelta(days=1),
)

driver_activity = FeatureService(name="driver_activity", features=[driver_stats])
'''


def scaffold(path: Path, project: str) -> None:
    if (path / "featurestore.yaml").exists():
        raise FeatureStoreError(f"{path} already holds a feature repo")
    (path / "data").mkdir(parents=True, exist_ok=True)
    (path / "featurestore.yaml").write_text(CONFIG.format(project=project))
    (path / "features.py").write_text(FEATURES)
    start = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=10)
    rows = [(d, start + timedelta(hours=h), 0.1 * h, h) for d in (1001, 1002) for h in range(10)]
    table = pa.table(
        {
            "driver_id": [r[0] for r in rows],
            "event_timestamp": pa.array([r[1] for r in rows], pa.timestamp("us", tz="UTC")),
            "conv_rate": [r[2] for r in rows],
            "trips_today": [r[3] for r in rows],
        }
    )
    pq.write_table(table, path / "data" / "driver_stats.parquet")
