"""History stores: every materialized row, for point-in-time joins and exports."""

from featurestore.offline.base import HISTORY_COLUMNS, PARTITION_COLUMN, OfflineStore, history_schema

__all__ = ["HISTORY_COLUMNS", "PARTITION_COLUMN", "OfflineStore", "history_schema"]
