"""featurestore: one Python definition per feature, materialized to a Delta history store and Redis."""

from featurestore.definitions import (
    Aggregation,
    Entity,
    FeatureService,
    FeatureView,
    Field,
    FileSource,
    OnDemandFeatureView,
    PushSource,
    RequestSource,
    SqlSource,
    StreamSource,
    on_demand_feature_view,
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
    "OnDemandFeatureView",
    "PushSource",
    "RequestSource",
    "SqlSource",
    "StreamSource",
    "__version__",
    "on_demand_feature_view",
]
