"""``push``: rows arriving at run time, written with the same rules as materialization.

Views that read the source as is are written at once, typed in Arrow (``compute.pushed_rows``)
or, when a row needs explaining or a cast, through ``Materializer.write_view`` (same typing,
identity, tie-break, compare-and-set, event-id dedupe): Redis synchronously, history through
the durable ``PushBuffer``, committed to Delta in batches by ``flush`` (on a background thread once due). The raw rows also go to
the source's Delta log, so views with a transformation over the source see them at the next
materialization: the log's rows and the views' history rows of one push share one synced record.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc  # noqa: F401  (pa.ipc)
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from featurestore.definitions import FeatureView
from featurestore.errors import BadRowsError, ConflictError, RequestError
from featurestore.materialization.compute import pushed_rows
from featurestore.materialization.engine import Materializer, push_run_id
from featurestore.materialization.pushed_entities import PushedEntities
from featurestore.object_requests import count_delta
from featurestore.offline.buffer import APP_ID, PushBuffer
from featurestore.offline.compaction import compact
from featurestore.online.codec import datetime_to_micros, micros_to_datetime
from featurestore.sources import INGESTED_AT, PUSH_ID, connection, open_push_log
from featurestore.storage import Location
from featurestore.types import UnixTimestamp, as_declared

if TYPE_CHECKING:
    from featurestore.config import RepoConfig

logger = logging.getLogger("featurestore.push")

PushTarget = Literal["online", "offline", "online_and_offline"]
TARGETS: tuple[str, ...] = get_args(PushTarget)
TIMESTAMP = pa.timestamp("us", tz="UTC")


def _as_table(df: Any) -> pa.Table:
    if isinstance(df, pa.Table):
        return df
    if isinstance(df, dict):
        return pa.table(df)
    return pa.Table.from_pandas(df, preserve_index=False)


def push(
    materializer: Materializer,
    buffer: PushBuffer,
    source_name: str,
    df: Any,
    to: PushTarget = "online_and_offline",
    idempotency_key: str | None = None,
    arrival: tuple[pa.Array, pa.Array] | None = None,
    written: PushedEntities | None = None,
) -> int:
    """Validate rows against the push source and write them through ``materializer`` (history via
    ``buffer``); ``written`` notes the entities written to aggregated views online, to pack.

    A re-push of the same rows is a new fact (a correction reverted must win again), so a client
    that *retries* passes the same ``idempotency_key``: every attempt then takes the first
    attempt's ingest time, so the rows are identical to it and both stores keep them once.
    ``arrival``: each row's own ingest time and push id (a stream's entries carry them in their
    entry ids), so a redelivered row is the same row and every store keeps it once."""
    if to not in TARGETS:
        raise RequestError(f"`to` must be one of {list(TARGETS)}, not {to!r}")
    defs = materializer.defs
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
    columns = [as_declared(f.name, table[f.name], f.dtype) for f in source.schema]
    now = ingested = datetime.now(UTC)
    if idempotency_key is not None:
        ingested = _first_attempt(materializer, idempotency_key, pa.table(columns, names=expected), now)
    n, run_id = table.num_rows, push_run_id(ingested)
    if arrival is not None:  # (each row's run is its own ingest time: see compute)
        ingested_at, push_ids = arrival[0].cast(TIMESTAMP), arrival[1].cast(pa.int64())
    else:
        ingested_at, push_ids = _arrival(n, ingested, idempotency_key)
    table = pa.table([*columns, ingested_at, push_ids], names=[*expected, INGESTED_AT, PUSH_ID])
    typed: list[tuple[FeatureView, pa.Table]] = []  # views whose rows Arrow typed (the usual case)
    for view in defs.feature_views.values():
        if getattr(view.source, "name", None) != source_name or view.transformation is not None:
            continue
        rows = pushed_rows(
            table, view, defs.key_types[view.name], defs.history_schema(view), now, materializer.config.future_tolerance
        )
        if rows is not None:
            typed.append((view, rows))
            continue
        con = connection()  # something only the full check (a query) can type or explain
        con.register("view_rows", table)
        try:
            materializer.write_view(
                con,
                view,
                start=None,
                end=None,
                online="online" in to,
                offline="offline" in to,
                on_bad_rows="fail",
                buffer=buffer,
                run_id=run_id,
            )
        except BadRowsError as exc:
            raise RequestError(str(exc)) from exc
    online = [(view, rows) for view, rows in typed if "online" in to and view.online]
    if "online" not in to:  # history gains rows Redis lacks: the next materialization re-sends the view's history
        _mark_behind(materializer, [view for view, _ in typed if view.online and view.offline])

    def write_online() -> None:
        for view, rows in online:
            materializer.write_online(view, rows, now)

    if "offline" in to:  # after every view accepted the rows, so a rejected push leaves no trace
        # one record for the source's log and its views' history: one sync, not one per target
        layout = materializer.defs.layout
        parts = {f"view:{layout(view).history_table}": rows for view, rows in typed if view.offline}
        buffer.append_parts(
            f"log:{source_name}",
            {**parts, f"log:{source_name}": table},
            retry=ingested != now or arrival is not None,
            meanwhile=write_online if online else None,
        )
    else:
        write_online()
    if written is not None and "online" in to:  # (views that read the source as is, typed or explained)
        for view in defs.feature_views.values():
            if view.online and getattr(view.source, "name", None) == source_name and view.transformation is None:
                written.note(view, table, source.timestamp_field)
    if buffer.worth_looking():  # lanes past the bounds commit on the committing thread, not in this call
        buffer.in_background(lambda: flush(materializer, buffer, only_due=True))
    return table.num_rows


def _mark_behind(materializer: Materializer, views: list[FeatureView]) -> None:
    """Record that Redis may lack some of these views' history (before the rows are written: a
    crash in between only re-sends), unless already recorded."""
    marks = materializer.registry.watermarks()
    for view in views:
        if view.name in marks and marks[view.name].online_synced:
            materializer.registry.set_watermark(view.name, online_synced=False)


def write_online_only(
    materializer: Materializer, view: FeatureView, df: Any, written: PushedEntities | None = None
) -> int:
    """A view's rows straight to Redis (Feast's ``write_to_online_store``); returns the row count.
    ``written`` notes the entities written, if the view is aggregated, to pack."""
    if not view.online:
        raise RequestError(f"view {view.name!r} is not served online (online=False): there is nothing to write to")
    try:
        table = _as_table(df)
    except Exception as exc:
        raise RequestError(f"rows must be a DataFrame, Arrow table or {{column: [values]}} dict: {exc}") from exc
    needed = [*view.join_keys, view.source.timestamp_field, *(f.name for f in view.schema)]
    missing = [c for c in needed if c not in table.column_names]
    if missing:
        raise RequestError(f"rows for view {view.name!r} lack column(s) {missing}; it takes {needed}")
    created = view.source.created_timestamp_field
    declared = {
        **materializer.defs.key_types[view.name],
        view.source.timestamp_field: UnixTimestamp,
        **({created: UnixTimestamp} if created and created in table.column_names else {}),
        **{f.name: f.dtype for f in view.schema},
    }
    for name, dtype in declared.items():  # (as a push converts them: SQL's casts would round 1.5 to key 2)
        table = table.set_column(table.column_names.index(name), name, as_declared(name, table[name], dtype))
    now = datetime.now(UTC)
    rows = None
    if view.transformation is None and table.num_rows:  # typed in Arrow, as a push's rows: no query, no run to record
        ingested_at, push_ids = _arrival(table.num_rows, now)
        arrived = table.append_column(INGESTED_AT, ingested_at).append_column(PUSH_ID, push_ids)
        defs, config = materializer.defs, materializer.config
        rows = pushed_rows(
            arrived, view, defs.key_types[view.name], defs.history_schema(view), now, config.future_tolerance
        )
    if rows is not None:
        materializer.write_online(view, rows, now)
    else:  # something only the full check (a query) can type or explain
        con = connection()
        con.register("view_rows", table)
        try:
            materializer.write_view(con, view, start=None, end=None, online=True, offline=False, on_bad_rows="fail")
        except BadRowsError as exc:
            raise RequestError(str(exc)) from exc
    if written is not None:
        written.note(view, table, view.source.timestamp_field)
    return table.num_rows


def _arrival(n: int, ingested: datetime, idempotency_key: str | None = None) -> tuple[pa.Array, pa.Array]:
    """``n`` pushed rows' ingest time (their run: ``push_run_id``) and push ids."""
    times = pa.Array.from_buffers(TIMESTAMP, n, [None, pa.py_buffer(np.full(n, push_run_id(ingested), np.int64))])
    return times, _push_ids(n, idempotency_key, ingested)


def _push_ids(n: int, idempotency_key: str | None, ingested: datetime) -> pa.Array:
    """Consecutive 63-bit row ids from a random start, or for an idempotent push from one derived
    from its key and first attempt's time: every retry then writes the same rows."""
    if idempotency_key is None:
        start = secrets.randbits(63)
    else:
        seed = f"{idempotency_key}\0{datetime_to_micros(ingested)}".encode()
        start = int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big") >> 1
    ids = (np.uint64(start) + np.arange(n, dtype=np.uint64)) & np.uint64((1 << 63) - 1)
    return pa.array(ids.astype(np.int64))


IDEMPOTENCY_SECONDS = 24 * 3600  # how long a retry is recognised


def _first_attempt(materializer: Materializer, key: str, rows: pa.Table, now: datetime) -> datetime:
    if not key or len(key) > 200:
        raise RequestError("an idempotency key is 1 to 200 characters")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    fingerprint = hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:32]
    first_us, recorded = materializer.online.first_use(key, fingerprint, datetime_to_micros(now), IDEMPOTENCY_SECONDS)
    if recorded != fingerprint:
        raise ConflictError(f"idempotency key {key!r} was used for different rows; use a new key for new rows")
    return micros_to_datetime(first_us)


def flush(materializer: Materializer, buffer: PushBuffer, only_due: bool = False) -> int:
    """Commit buffered pushes to the history store (all, or those over the size/age bounds); returns rows.

    A lane names the history table (view version) its rows were computed for: rows of an older
    version go to that version's table, never to a newer one."""
    defs, offline, config = materializer.defs, materializer.offline, materializer.config
    current = {defs.layout(v).history_table: v for v in defs.feature_views.values()}

    def commit(target: str, rows: pa.Table, newest_seq: int, retried: bool) -> None:
        kind, name = target.split(":", 1)
        if kind == "log":
            _append_log(config.push_logs, name, rows, newest_seq, retried, buffer.writer_id())
            _compact_log_when_due(config, name)
            return
        offline.append(name, rows)
        if offline.file_count(name) > config.offline.compact_after_files:  # many small pushes: merge
            with _compaction(name):
                offline.compact(name)
                if config.offline.vacuum_after_hours is not None:  # and delete what compactions replaced long ago
                    offline.vacuum(name, config.offline.vacuum_after_hours)

    def logged(target: str) -> int:
        """The newest buffer record a push log holds (its Delta app transaction); -1 for history
        tables, whose appends dedupe by row identity."""
        kind, name = target.split(":", 1)
        log = open_push_log(config.push_logs, name) if kind == "log" else None
        if log is None:
            return -1
        # (APP_ID alone: what a local buffer recorded before buffers had ids of their own)
        return max(log.transaction_version(buffer.writer_id()) or -1, log.transaction_version(APP_ID) or -1)

    def resend(target: str, rows: pa.Table) -> None:
        view = current.get(target.split(":", 1)[1]) if target.startswith("view:") else None
        if view is not None and view.online:  # (None: an older version's rows, whose online layout is gone)
            materializer.write_online(view, conform(rows, defs.history_schema(view)), datetime.now(UTC))

    committed = 0
    for lane in buffer.targets():
        if only_due and not buffer.due(lane):
            continue
        kind, name = lane.split(":", 1)
        if kind == "view" and name.split("@")[0] not in defs.feature_views:
            continue  # the view was removed; its records stay for inspection
        committed += buffer.drain(lane, commit, resend, logged)
    return committed


def _not_logged(rows: pa.Table, log: DeltaTable | None) -> pa.Table:
    """Rows whose push id is neither earlier in ``rows`` nor in the log. A retry takes its first
    attempt's ingest time, so only log rows ingested since the oldest of ``rows`` are read."""
    con = connection()
    con.register("batch", rows)
    new = f"SELECT * FROM batch QUALIFY {PUSH_ID} IS NULL OR row_number() OVER (PARTITION BY {PUSH_ID}) = 1"
    if log is not None and PUSH_ID in [f.name for f in log.schema().fields]:
        con.register("log", log.to_pyarrow_dataset())
        oldest = pc.min(rows[INGESTED_AT])
        con.register("oldest", pa.table({"since": pa.array([oldest.as_py()], rows.schema.field(INGESTED_AT).type)}))
        new = (
            f"SELECT * FROM ({new}) WHERE {PUSH_ID} IS NULL OR {PUSH_ID} NOT IN "
            f"(SELECT {PUSH_ID} FROM log WHERE {INGESTED_AT} >= (SELECT since FROM oldest) AND {PUSH_ID} IS NOT NULL)"
        )
    return con.sql(new).to_arrow_table().cast(rows.schema)


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows written before columns were added, with those columns null."""
    if rows.schema.names == schema.names:
        return rows
    return pa.table(
        [rows[f.name] if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type) for f in schema],
        schema=schema,
    )


PUSH_LOG_CHECKPOINT_EVERY = 10  # commits


@contextlib.contextmanager
def _compaction(name: str) -> Iterator[None]:
    """A compaction after a drain's commit: when it fails (another machine compacted the same
    files at once), the commit stands and the files stay as they were until the next one."""
    try:
        yield
    except Exception as exc:
        logger.warning("compacting %s failed (%s); its files stay as they are until the next drain", name, exc)


def _compact_log_when_due(config: RepoConfig, source_name: str) -> None:
    """A push log's many small files (a drain commits one) merged, and those the merges replaced
    long enough ago deleted: every file a materialization reads is requests and a round trip on
    object storage."""
    log_table = open_push_log(config.push_logs, source_name)
    if log_table is None or len(log_table.file_uris()) <= config.offline.compact_after_files:
        return
    with _compaction(f"the push log of {source_name}"):
        compact(config.push_logs.child(source_name))
        if config.offline.vacuum_after_hours is not None:
            log_table.vacuum(
                retention_hours=config.offline.vacuum_after_hours, dry_run=False, enforce_retention_duration=False
            )


def _append_log(push_logs: Location, source_name: str, rows: pa.Table, seq: int, retried: bool, writer: str) -> None:
    """Append a drain's records to the push log, recording the newest (``seq``) as the log's Delta
    app transaction of this ``writer`` (the buffer): a drain repeated after a crash leaves out the
    records the log holds (``PushBuffer.drain``'s ``committed``). A retried push's rows only if no
    earlier attempt logged them (by push id). Appends of many writers commit side by side (blind
    appends do not conflict; delta-rs retries the commit on the newer version)."""
    log = open_push_log(push_logs, source_name)
    if retried:
        rows = _not_logged(rows, log)
    where = push_logs.child(source_name)
    count_delta("delta commit", where.is_local)
    write_deltalake(
        log if log is not None else where.url,  # the followed handle: no re-reading of the log to append
        rows,
        mode="append",
        schema_mode="merge",  # logs from before INGESTED_AT
        storage_options=None if log is not None else where.delta_options(),
        commit_properties=CommitProperties(app_transactions=[Transaction(writer, seq)]),
        # reading a writer's progress replays the log from its last checkpoint: kept short
        configuration={"delta.checkpointInterval": str(PUSH_LOG_CHECKPOINT_EVERY)} if log is None else None,
    )
