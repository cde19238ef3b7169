"""featurestore: one Python definition per feature, materialized to a Delta history store and Redis."""

from featurestore.definitions import (
    Aggregation,
    Entity,
    FeatureService,
    FeatureView,
    Field,
    FileSource,
    PushSource,
    SqlSource,
    StreamSource,
)
from featurestore.feature_store import FeatureStore

__version__ = "0.1.0"

__all__ = [
    "Aggregation",
    "Entity",
    "FeatureService",
    "FeatureStore",
    "FeatureView",
    "Field",
    "FileSource",
    "PushSource",
    "SqlSource",
    "StreamSource",
    "__version__",
]
