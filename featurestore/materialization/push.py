"""``push``: rows arriving at run time, written with the same rules as materialization.

Pushed rows are appended to the push source's Delta log (when going offline), so views
with a transformation over the source pick them up at the next materialization; views
that read the source as is are written to the stores at once, through the same
``Materializer.write_view`` path (same typing, identity, tie-break and compare-and-set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import write_deltalake

from featurestore.errors import BadRowsError, RequestError
from featurestore.materialization.engine import Materializer
from featurestore.sources import connection, push_log_path

if TYPE_CHECKING:
    from featurestore.feature_store import FeatureStore

TARGETS = ("online", "offline", "online_and_offline")


def _as_table(df: Any) -> pa.Table:
    if isinstance(df, pa.Table):
        return df
    if isinstance(df, dict):
        return pa.table(df)
    return pa.Table.from_pandas(df, preserve_index=False)


def push(store: "FeatureStore", source_name: str, df: Any, to: str = "online_and_offline") -> int:
    if to not in TARGETS:
        raise RequestError(f"`to` must be one of {list(TARGETS)}, not {to!r}")
    defs = store.definitions
    source = defs.push_source(source_name)
    try:
        table = _as_table(df)
    except Exception as exc:
        raise RequestError(f"push rows must be a DataFrame, Arrow table or {{column: [values]}} dict: {exc}") from exc
    if table.num_rows == 0:
        return 0
    expected = [f.name for f in source.schema]
    missing = [c for c in expected if c not in table.column_names]
    if missing:
        raise RequestError(f"push to {source_name!r} lacks column(s) {missing}; its schema is {expected}")
    columns = []
    for f in source.schema:
        try:
            columns.append(table[f.name].cast(f.dtype.arrow))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise RequestError(f"push column {f.name!r} does not convert to {f.dtype!r}: {exc}") from exc
    table = pa.table(columns, names=expected)
    materializer = Materializer(store)
    for view in defs.feature_views.values():
        if getattr(view.source, "name", None) != source_name or view.transformation is not None:
            continue
        con = connection()
        con.register("view_rows", table)
        try:
            materializer.write_view(con, view, start=None, end=None, online="online" in to, offline="offline" in to, on_bad_rows="fail")
        except BadRowsError as exc:
            raise RequestError(str(exc)) from exc
    if "offline" in to:  # after the views accepted the rows, so a rejected push leaves no trace
        write_deltalake(str(push_log_path(store.config.data_dir, source_name)), table, mode="append")
    return table.num_rows
