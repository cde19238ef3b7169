"""``FeatureStore``: the Python API, a thin façade over the registry, stores and retrieval modules."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from featurestore.aggregation import tiles
from featurestore.config import RepoConfig
from featurestore.definitions import Entity, FeatureService, FeatureView
from featurestore.errors import ConflictError, DefinitionError, FeatureStoreError, OnlineStoreUnavailable
from featurestore.files import private_dir
from featurestore.materialization.pushed_entities import Due, PushedEntities
from featurestore.registry import Definitions, Plan, RegistryStore, load_definitions, make_plan
from featurestore.registry.layout import ViewLayout
from featurestore.registry.snapshot import value_hash
from featurestore.registry.validation import validate
from featurestore.storage import Location

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

    from featurestore.materialization.engine import MaterializationReport, Materializer
    from featurestore.materialization.push import PushTarget
    from featurestore.offline.buffer import PushBuffer
    from featurestore.offline.delta import DeltaOfflineStore
    from featurestore.online.base import Compacted, OnlineStore, Sealer
    from featurestore.retrieval.historical import AsOf, JoinBuilder, RetrievalJob
    from featurestore.retrieval.online import OnlineReader, OnlineResponse
    from featurestore.statistics import Summary
    from featurestore.tracking.artifacts import ArtifactStore
    from featurestore.tracking.run_sync import RunMirror
    from featurestore.training.model_registry import ModelRegistry


APPLY_ATTEMPTS = 20  # plans made again when other applies keep coming first
UNFILLED_RECHECK_S = 5.0  # how often views waiting for a resend are looked up again (another process may send it)
log = logging.getLogger(__name__)


class FeatureStore:
    """A feature repo: its definitions, applied registry, offline and online stores."""

    def __init__(self, repo_path: str | Path = ".", config: RepoConfig | None = None):
        self.config = config or RepoConfig.load(repo_path)
        local = [where.path for where in (self.config.offline.location, self.config.registry) if where.is_local]
        for folder in {self.config.data_dir, *local}:
            private_dir(folder)  # history, registry, buffers, models, runs: this user's alone
        self.registry = RegistryStore(self.config.registry)
        self._definitions: Definitions | None = None
        self._offline: DeltaOfflineStore | None = None
        self._online: OnlineStore | None = None
        self._reader: OnlineReader | None = None
        self._buffer: PushBuffer | None = None
        self._pushed = PushedEntities()  # what pushes wrote to aggregated views, packed once their tiles end
        self._unapplied: dict[str, str] | None = None
        self._unfilled: tuple[float, frozenset[str]] | None = None  # (when read, views) for ``unfilled_views``

    # ------------------------------------------------------------ definitions

    @property
    def definitions(self) -> Definitions:
        """The repo's definitions, loaded and validated once (raises DefinitionError)."""
        if self._definitions is None:
            defs, problems = load_definitions(self.config)
            problems += validate(defs, self.config)
            if problems:
                raise DefinitionError(problems)
            # each view reads and writes the history version the registry applied (see ``registry.plan``)
            self._definitions = defs.with_versions(self.registry.current().get("history_versions", {}))
        return self._definitions

    def layout(self, view: str) -> ViewLayout:
        """Where the applied version of a view keeps its rows: history table, online field."""
        return self.definitions.layout(view)

    @property
    def unapplied(self) -> dict[str, str]:
        """Definitions in the code that differ from the applied registry: ``{name: what}``.

        Materialize, push, lookups and exports refuse to use them: values are always computed
        and served under definitions that were reviewed (``plan``) and recorded (``apply``)."""
        if self._unapplied is None:
            self._unapplied = {}
            for change in self.plan().changes:
                if change.action != "remove":
                    what = "never applied" if change.action == "add" else f"changed: {', '.join(change.attributes)}"
                    self._unapplied[change.name] = f"{change.kind.replace('_', ' ')} {change.name!r} ({what})"
        return self._unapplied

    def require_applied(self, names: Iterable[str] | None = None) -> None:
        """Raise unless the named definitions (default: all) are as applied."""
        unapplied = self.unapplied
        found = [
            unapplied[n] for n in dict.fromkeys(unapplied if names is None else names) if n in unapplied
        ]  # each once
        if found:
            raise FeatureStoreError(
                f"the code's definitions differ from the applied registry: {'; '.join(found)}. "
                "Review with `featurestore plan`, then record them with `featurestore apply`"
            )

    def _used_by(
        self,
        views: Iterable[str] = (),
        features: Sequence[str] | None = None,
        feature_service: str | FeatureService | None = None,
    ) -> list[str]:
        """Every definition a request depends on: its service, views, their entities and sources."""
        names = list(views)
        if feature_service is not None:
            service = self.definitions.service(
                feature_service if isinstance(feature_service, str) else feature_service.name
            )
            names.append(service.name)
            features = service.feature_refs()
        names += [ref.split(":")[0] for ref in features or [] if isinstance(ref, str)]
        for name in list(names):
            odfv = self.definitions.on_demand_feature_views.get(name)
            if odfv is not None:
                names += [r.split(":")[0] for r in odfv.input_refs]
        for name in list(names):
            view = self.definitions.feature_views.get(name)
            if view is not None:
                names += [e.name for e in view.entities] + [getattr(view.source, "name", "")]
        return names

    def plan(self) -> Plan:
        """What ``apply`` would change, without changing anything."""
        key_types = {v: {k: t.name for k, t in keys.items()} for v, keys in self.definitions.key_types.items()}
        return make_plan(self.registry.current(), self.definitions.specs(), key_types)

    def apply(self, force: bool = False) -> Plan:
        """Persist the definitions; removing a view (and deleting its data) needs ``force``.

        Against the registry version it was planned on: if another apply (another machine) came
        first, the plan is made again on what it recorded, so neither is lost."""
        for _ in range(APPLY_ATTEMPTS):
            plan = self._apply_plan(force)
            try:
                if plan.empty:
                    return plan
                self.registry.apply(
                    plan.objects,
                    expected_version=plan.base_version,
                    history_versions=plan.history_versions,
                    key_types=plan.key_types,
                )
                break
            except ConflictError:
                continue
        else:
            raise FeatureStoreError(f"{APPLY_ATTEMPTS} other applies came first, one after another; try again")
        self._unapplied = self._unfilled = None
        self._definitions = self.definitions.with_versions(plan.history_versions)
        for change in plan.changes:
            if change.deletes_data:
                self.offline_store.drop(change.name)
                self.online_store.drop_view(change.name)
                self.registry.drop_watermark(change.name)
        return plan

    def _apply_plan(self, force: bool) -> Plan:
        plan = self.plan()
        if plan.deletes_data and not force:
            removed = [c.name for c in plan.changes if c.deletes_data]
            raise FeatureStoreError(
                f"applying would remove feature view(s) {removed} and delete their stored data; "
                "re-run with --force (apply(force=True)) to confirm"
            )
        return plan

    def list_entities(self) -> list[Entity]:
        return list(self.definitions.entities.values())

    def list_feature_views(self) -> list[FeatureView]:
        return list(self.definitions.feature_views.values())

    def list_feature_services(self) -> list[FeatureService]:
        return list(self.definitions.feature_services.values())

    def get_feature_view(self, name: str) -> FeatureView:
        return self.definitions.view(name)

    def get_feature_service(self, name: str) -> FeatureService:
        return self.definitions.service(name)

    def definition_hashes(self, views: Iterable[str]) -> dict[str, str]:
        """Per view, a hash of what determines its values (not its description, owner or tags):
        manifests and model cards record it, so metadata edits never make a model or dataset stale."""
        return {v: value_hash(self.definitions.spec_of(v)) for v in views}

    def model_registry(self) -> ModelRegistry:
        """The model registry; promotions are announced to every inference server over Redis."""
        from featurestore.training.model_registry import MODELS_CHANNEL, ModelRegistry

        def announce(name: str, version: int, stage: str) -> None:
            self.online_store.publish(MODELS_CHANNEL, f"{name}:{version}:{stage}")

        models, ledger = self.config.data.child("models"), self.config.registry.child("models.json")
        return ModelRegistry(models, ledger, announce, self.artifacts())

    def runs_folder(self, run_id: str | None = None, checkpoints: bool = False) -> Path:
        """This machine's folder of training runs. With the durable state on object storage, the
        runs there (all, or ``run_id``'s; their checkpoints if asked) are pulled into it first."""
        if (mirror := self._run_mirror()) is not None:
            mirror.pull(run_id, checkpoints)
        return self.config.data_dir / "runs"

    def publish_run(self, run_id: str) -> None:
        """With the durable state on object storage, copy what changed in the run there (a no-op on disk)."""
        if (mirror := self._run_mirror()) is not None:
            mirror.publish(run_id)

    def _run_mirror(self) -> RunMirror | None:
        from featurestore.tracking.run_sync import RunMirror

        data = self.config.data
        return None if data.is_local else RunMirror(data.child("runs"), self.config.data_dir / "runs")

    def artifacts(self) -> ArtifactStore:
        """Content-addressed files of runs and models (``<data_dir>/artifacts/<sha256>``)."""
        from featurestore.tracking.artifacts import ArtifactStore

        return ArtifactStore(self.config.data.child("artifacts"))

    # ------------------------------------------------------------ stores

    @property
    def offline_store(self) -> DeltaOfflineStore:
        if self._offline is None:
            from featurestore.offline.delta import DeltaOfflineStore
            from featurestore.offline.file_cache import FileCache

            offline, cache = self.config.offline, None
            if not offline.location.is_local and offline.cache_mb:  # data files of S3 kept on local disk
                cache = FileCache(self.config.data_dir / "cache" / "history", offline.cache_mb << 20)
            self._offline = DeltaOfflineStore(offline.location, cache, offline.statistics)
        return self._offline

    @property
    def online_store(self) -> OnlineStore:
        if self._online is None:
            from featurestore.online.base import open_online_store

            self._online = open_online_store(self.config.online_store_settings)
            _warn_if_evicting(self._online)
        return self._online

    @property
    def online_reader(self) -> OnlineReader:
        """Reads lookups from the online store (what the servers call too); it remembers heavy entities."""
        if self._reader is None:
            from featurestore.retrieval.online import OnlineReader

            self._reader = OnlineReader(self.online_store)
        return self._reader

    @property
    def unfilled_views(self) -> frozenset[str]:
        """Aggregated views whose events online were written under another layout than the one
        read now (an upgrade that changed it, or a definition change since their last
        materialize): Redis holds under this one only the events pushed since, so lookups answer
        their aggregates NOT_FOUND, not from those alone, until ``featurestore materialize``
        re-sends the history. From the watermarks: read once, then every few seconds while any
        view waits (``recheck_unfilled``)."""
        if self._unfilled is None or (self._unfilled[1] and time.monotonic() - self._unfilled[0] > UNFILLED_RECHECK_S):
            self.recheck_unfilled()
        assert self._unfilled is not None
        return self._unfilled[1]

    def recheck_unfilled(self) -> frozenset[str]:
        """Read ``unfilled_views`` again from the watermarks (a server does it off its event loop);
        logs each view that waits, with what to run. Watermarks out of reach: the views known."""
        before = self._unfilled[1] if self._unfilled is not None else frozenset()
        try:
            marks = self.registry.watermarks()
        except Exception as exc:  # (object storage unreachable, a damaged file: lookups go on)
            log.warning("cannot read the watermarks to find views waiting for a resend: %s", exc)
            self._unfilled = (time.monotonic(), before)
            return before
        unfilled = frozenset(
            name
            for name, view in self.definitions.feature_views.items()
            if view.aggregations
            and view.online
            and name in marks
            and marks[name].online_layout not in (None, self.layout(name).storage_id)
        )
        for name in sorted(unfilled - before):
            log.warning(
                "view %r: its events online were written under layout %s, this featurestore reads layout %s "
                "(an upgrade or a changed definition); its aggregates read NOT_FOUND until "
                "`featurestore materialize` re-sends its history (then, once every server reads layout %s, "
                "`featurestore compact --drop-old-layouts` frees what layout %s holds)",
                name,
                marks[name].online_layout,
                self.layout(name).storage_id,
                self.layout(name).storage_id,
                marks[name].online_layout,
            )
        self._unfilled = (time.monotonic(), unfilled)
        return unfilled

    def share_online(self, other: FeatureStore) -> None:
        """Read and write through ``other``'s online store and reader (its open connections, the
        heavy entities it knows), and pack what its pushes wrote: a server's registry reload swaps
        definitions, not connections."""
        self._online, self._reader, self._pushed = other._online, other._reader, other._pushed

    @property
    def push_buffer(self) -> PushBuffer:
        """Durable buffer of pushed history rows, committed to Delta in batches (see ``flush``)."""
        if self._buffer is None:
            from featurestore.offline.buffer import PushBuffer

            self._buffer = PushBuffer(
                self.config.data_dir / "buffer",
                self.config.offline.buffer_max_rows,
                self.config.offline.buffer_max_seconds,
            )
        return self._buffer

    def materializer(self, progress: bool = False) -> Materializer:
        """The write engine over this repo's applied definitions and stores."""
        from featurestore.materialization.engine import Materializer

        distributed = None
        if self.config.offline.engine == "ray":  # materialize and backfill fan out to the cluster; pushes stay local
            from featurestore.materialization.ray_engine import RayEngine

            config = self.config
            distributed = RayEngine(
                self.definitions,
                self.registry,
                config.offline.location,
                # the running server's address (an embedded one too: tasks connect to it)
                dataclasses.replace(config.online_store_settings, url=self.online_store.url),
                config.repo_path,
                config.push_logs,
                config.future_tolerance,
                config.online.event_retention,
                config.online.expire_after_ttl,
                address=config.ray.address,
                partitions=config.ray.partitions,
                progress=progress,
            )
        return Materializer(
            self.definitions, self.registry, self.offline_store, self.online_store, self.config, progress, distributed
        )

    def flush(self) -> int:
        """Commit every buffered push to the history store now; returns the rows committed."""
        from featurestore.materialization.push import flush

        return flush(self.materializer(), self.push_buffer)

    def compact(self, views: Sequence[str] | None = None, vacuum_hours: int | None = None) -> dict[str, dict]:
        """Merge each view's small history files; with ``vacuum_hours``, also delete files only versions
        older than that use (exports from those versions then no longer reproduce)."""
        self._commit_buffered()
        report = {}
        for name in views or list(self.definitions.feature_views):
            table = self.definitions.layout(name).history_table
            before = self.offline_store.file_count(table)
            metrics = self.offline_store.compact(table)
            removed = self.offline_store.vacuum(table, vacuum_hours) if vacuum_hours is not None else 0
            report[name] = {
                "files_before": before,
                "files_after": self.offline_store.file_count(table),
                "files_removed": metrics.get("numFilesRemoved", 0),
                "files_vacuumed": removed,
            }
        return report

    def compact_feature_logs(self) -> dict[str, dict]:
        """Merge the small files of every feature log (a server writes one a second) and delete
        those merged away over a day ago (``feature_logging.compact_log``): ``{"feature log <path>": report}``."""
        from featurestore.feature_logging import compact_log, logs

        root = self.config.data_dir / "feature_logs"
        return {f"feature log {path.relative_to(root)}": compact_log(path) for path in logs(self.config.data_dir)}

    def drop_old_layouts(
        self, views: Sequence[str] | None = None, progress: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        """Delete what each view holds online under a layout other than the one read now (what an
        upgrade or a definition change left behind, which lookups no longer read and, for views
        without a ttl, nothing expires): ``{view: keys and fields deleted}``. Servers of an earlier
        version still read those: run it once every server runs this one."""
        return {
            name: self.online_store.drop_view(name, self.definitions.layout(name).online_field, progress)
            for name in views or list(self.definitions.feature_views)
            if self.definitions.feature_views[name].online
        }

    def pack_online(
        self, views: Sequence[str] | None = None, progress: Callable[[int], None] | None = None
    ) -> dict[str, Compacted]:
        """Pack the ended blocks of each aggregated view's online events that hold events streamed
        one by one, and store the summaries of their ended tiles (a write does both for what it
        holds whole): ``{view: (blocks, events, summaries)}``."""
        report = {}
        for name in views or list(self.definitions.feature_views):
            view = self.definitions.feature_views[name]
            if view.is_aggregated:
                field, features, tile, sealer = self._packing(view)
                report[name] = self.online_store.pack_ended(field, features, tile, progress, sealer)
        return report

    def pack_online_entities(self, push_source_name: str, rows: pa.Table) -> dict[str, Compacted]:
        """``pack_online`` for the entities of ``rows`` (rows of a push source) only, in the
        aggregated views it feeds (bounded work, no scan): what ``pack_pushed`` does for pushes."""
        return {
            view.name: self._pack_written(Due(view.name, rows, since_us=None))
            for view in self.definitions.feature_views.values()
            if view.is_aggregated and view.online and getattr(view.source, "name", None) == push_source_name
            if all(k in rows.column_names for k in view.join_keys)
        }

    def pack_pushed(self, wait: bool = False) -> None:
        """Pack and summarize the ended tiles of the entities this process's pushes wrote, once the
        tile after theirs has ended too (``materialization.pushed_entities``), on a background
        thread; pushes call it, and so do a server's and a stream consumer's loops (a tile may end
        with no push after it). ``wait``: until that run has ended."""
        if self._pushed.any_due():  # (else, as after an offline push, Redis is not asked)
            try:
                self._pushed.pack_due(self._pack_written, self.online_store.pack_from())
            except OnlineStoreUnavailable as exc:  # (packing only saves memory and lookup time: a later call packs)
                log.warning("not packing what pushes wrote for now: %s", exc)
        if wait:
            self._pushed.wait()

    def _pack_written(self, due: Due) -> Compacted:
        """Pack and summarize the ended tiles of the entities ``due.keys`` in view ``due.view``."""
        import pyarrow as pa

        from featurestore.online.base import Compacted

        view = self.definitions.feature_views.get(due.view)
        if view is None or not (view.is_aggregated and view.online):  # (definitions reloaded since)
            return Compacted(0, 0, 0)
        schema = self.definitions.history_schema(view)
        keys = due.keys.select(view.join_keys).cast(pa.schema([schema.field(k) for k in view.join_keys]))
        field, features, tile, sealer = self._packing(view)
        return self.online_store.pack_entities(field, keys, view.join_keys, features, tile, sealer, due.since_us)

    def _packing(self, view: FeatureView) -> tuple[str, list, int, Sealer | None]:
        """What packing a view's online events takes: its online field, stored columns, tile µs and summarizer."""
        from featurestore.materialization.online_write import sealer
        from featurestore.online.codec import event_columns

        layout = self.definitions.layout(view)
        return (
            layout.online_field,
            event_columns(view),
            tiles.tile_us(view),
            sealer(view, layout.storage_id),
        )

    def statistics(
        self, view: str, since: datetime | None = None, until: datetime | None = None
    ) -> list[tuple[datetime, str, Summary]]:
        """(event day, column, summary) of the view's stored history (its current version), in
        ``[since, until)``; ``statistics.merged`` folds them into one summary per column."""
        self._commit_buffered()
        return self.offline_store.statistics.read(self.definitions.layout(view).history_table, since, until)

    def _commit_buffered(self) -> None:
        """Reads of history see every acknowledged push: commit what is buffered (any process's)."""
        if self.push_buffer.targets():
            self.flush()

    def close(self) -> None:
        if self._buffer is not None:
            try:
                self._commit_buffered()
            except OnlineStoreUnavailable as exc:  # durable in the buffer: the next flush commits them
                log.warning("buffered pushes stay in %s until the online store is back (%s)", self._buffer.root, exc)
            self._buffer.close()
        self._pushed.close()  # (its run in flight ends; what is not due yet is left to compact)
        if self._offline is not None:  # (statistics not caught up yet: the next catch-up's, anywhere)
            self._offline.statistics.stop()
        if self._online is not None:
            self._online.close()
            self._online = self._reader = None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ materialization

    def materialize(
        self,
        start: datetime | str | None,
        end: datetime | str | None,
        views: Sequence[str] | None = None,
        *,
        online: bool = True,
        offline: bool = True,
        on_bad_rows: Literal["reject", "fail"] = "reject",
        progress: bool = False,
        rebuild_online: bool = False,
    ) -> MaterializationReport:
        """Compute the views' rows with event time in [start, end) once and write both stores.

        ``rebuild_online``: also send the latest of the whole history online (refills an emptied Redis)."""
        from featurestore.config import parse_time

        selected = list(views) if views else list(self.definitions.feature_views)
        self.require_applied(self._used_by(selected))
        start, end = (parse_time(t) if t is not None else None for t in (start, end))
        if start is not None and end is not None and start >= end:
            raise FeatureStoreError(
                f"the window is empty: start {start.isoformat()} is not before end {end.isoformat()}"
            )
        self._commit_buffered()  # the push log and histories must hold every pushed row first
        if rebuild_online:  # "Redis may lack history rows": the next online write sends them all
            for name in selected:
                self.registry.set_watermark(name, online_synced=False)
        try:
            return self.materializer(progress).run(
                views, start=start, end=end, online=online, offline=offline, on_bad_rows=on_bad_rows
            )
        finally:
            self._unfilled = None  # (a resend may have filled some)

    def backfill(self, views: Sequence[str], progress: bool = False) -> MaterializationReport:
        """Recompute the views' whole history from their sources into their current version and
        re-send it online: what a new version or an added column needs (``plan`` says when)."""
        return self.materialize(None, None, views, progress=progress, rebuild_online=True)

    def materialize_offline(
        self, start: datetime | None, end: datetime | None, views: Sequence[str] | None = None, **kw: Any
    ) -> MaterializationReport:
        return self.materialize(start, end, views, online=False, **kw)

    def materialize_incremental(
        self, end: datetime | None = None, views: Sequence[str] | None = None, **kw: Any
    ) -> MaterializationReport:
        """Write every row not yet materialized (late arrivals included) up to ``end``.

        No start: the whole source is computed and only rows the history lacks (by identity)
        are new, so rows arriving late, whatever their event time, are never skipped."""
        return self.materialize(None, end, views, **kw)

    def push(
        self,
        push_source_name: str,
        df: pd.DataFrame | pa.Table | dict,
        to: PushTarget = "online_and_offline",
        idempotency_key: str | None = None,
        arrival: tuple[pa.Array, pa.Array] | None = None,
    ) -> int:
        """Validate rows against the push source and write them; returns the row count.

        Retrying a push? Pass the same ``idempotency_key`` each time: the rows are then kept once.
        (``arrival``: each row's ingest time and push id, for stream consumers: see ``push.push``.)"""
        from featurestore.materialization.push import push

        readers = [
            v.name
            for v in self.definitions.feature_views.values()
            if getattr(v.source, "name", None) == push_source_name
        ]
        self.require_applied([push_source_name, *self._used_by(readers)])
        written = self._pushed if self.config.online.pack_pushes else None
        n = push(self.materializer(), self.push_buffer, push_source_name, df, to, idempotency_key, arrival, written)
        self.pack_pushed()
        return n

    def append_to_stream(self, source_name: str, rows: Iterable[dict[str, Any]]) -> list[str]:
        """Append rows to a ``StreamSource``'s Redis Stream, as a producer does (``featurestore stream``
        consumes them); the way in when Redis is embedded and has no address to give a producer.
        Returns the entry ids."""
        from featurestore.definitions import StreamSource
        from featurestore.online.transport import UNAVAILABLE
        from featurestore.streaming import publish, stream_key

        source = self.definitions.push_source(source_name)
        if not isinstance(source, StreamSource):
            raise FeatureStoreError(f"{source_name!r} is a push source, not a StreamSource: write to it with push()")
        try:
            ids = publish(self.online_store.client, stream_key(self.config.project, source), list(rows))
        except UNAVAILABLE as exc:
            raise self.online_store.unavailable(exc) from exc
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    def write_to_online_store(self, feature_view_name: str, df: pd.DataFrame | pa.Table | dict) -> int:
        """Write a view's rows (join keys, event time, features) to the online store only, as Feast's
        ``write_to_online_store``: validated and ordered like every other write; history is not touched."""
        from featurestore.materialization.push import write_online_only

        self.require_applied(self._used_by([feature_view_name]))
        written = self._pushed if self.config.online.pack_pushes else None
        n = write_online_only(self.materializer(), self.definitions.view(feature_view_name), df, written)
        self.pack_pushed()
        return n

    # ------------------------------------------------------------ retrieval

    def get_historical_features(
        self,
        entity_df: Any,
        features: Sequence[str] | None = None,
        feature_service: str | FeatureService | None = None,
        full_feature_names: bool = False,
        as_of: AsOf = "event",
    ) -> RetrievalJob:
        """Point-in-time-correct features for each entity row (see ``retrieval.historical``)."""
        self.require_applied(self._used_by(features=features, feature_service=feature_service))
        self._commit_buffered()
        return self.join_engine()(
            self.definitions, self.offline_store, entity_df, features, feature_service, full_feature_names, as_of
        )

    def join_engine(self) -> JoinBuilder:
        """What builds point-in-time joins: the local DuckDB engine, or the Ray one (``offline_store.engine``)."""
        if self.config.offline.engine == "ray":
            import functools

            from featurestore.retrieval.ray_join import RayJoinJob

            return functools.partial(
                RayJoinJob.build, address=self.config.ray.address, partitions=self.config.ray.partitions
            )
        from featurestore.retrieval.historical import RetrievalJob

        return RetrievalJob.build

    def get_online_features(
        self,
        entity_rows: Sequence[dict[str, Any]] | dict[str, Sequence[Any]],
        features: Sequence[str] | None = None,
        feature_service: str | FeatureService | None = None,
        full_feature_names: bool = False,
        at: datetime | None = None,
        include_feature_view_version_metadata: bool = False,
    ) -> OnlineResponse:
        """Latest values per entity from the online store, with per-value statuses.

        Windowed aggregates and ttls are evaluated at ``at`` (default: now); a past ``at`` suits
        replays and backtests while the events are retained online (``online_store.event_retention``)."""
        from featurestore.retrieval.online import OnlineQuery

        if _feast_order(entity_rows, features):  # Feast's positional order: (features, entity_rows)
            entity_rows, features = features, entity_rows  # type: ignore[assignment]
        if isinstance(features, FeatureService):  # Feast's `features=service`
            features, feature_service = None, features
        if self.unapplied:  # (the hot path skips working out what the request uses when nothing is unapplied)
            self.require_applied(self._used_by(features=features, feature_service=feature_service))
        query = OnlineQuery.prepare(
            self.definitions,
            self.config.project,
            entity_rows,
            features,
            feature_service,
            full_feature_names,
            self.config.online.max_request_entities,
            now=at,
            unfilled=self.unfilled_views,
        )
        response = self.online_reader.read(query)
        if include_feature_view_version_metadata:  # (Feast's flag)
            response.feature_view_metadata = query.view_versions()
        return response

    def export_training_dataset(
        self, entity_df: Any, feature_service: str, path: str | Path, progress: bool = False
    ) -> dict:
        """Write a versioned training dataset (Parquet + manifest.json) and return the manifest."""
        from featurestore.retrieval.export import export_training_dataset

        self.require_applied(self._used_by(feature_service=feature_service))
        self._commit_buffered()
        return export_training_dataset(
            self.definitions,
            self.offline_store,
            entity_df,
            feature_service,
            self.location(path),
            registry_version=self.registry.current()["version"],
            progress=progress,
            join=self.join_engine(),
            scratch=self.config.data_dir / "scratch",
        )

    def reproduce_training_dataset(self, manifest: str | Path, path: str | Path, progress: bool = False) -> dict:
        """Re-run an export from its ``manifest.json`` into ``path``, under the definitions and table
        versions it was made with; raise if any byte differs."""
        from featurestore.retrieval.export import reproduce

        self._commit_buffered()
        return reproduce(
            self.definitions,
            self.registry,
            self.offline_store,
            self.location(manifest),
            self.location(path),
            progress=progress,
            join=self.join_engine(),
            scratch=self.config.data_dir / "scratch",
        )

    def location(self, where: str | Path) -> Location:
        """A path or ``s3://`` URL a user gave, reached with this repo's ``storage_options``."""
        return Location.parse(where, Path.cwd(), dict(self.config.storage_options))


def _feast_order(first: Any, second: Any) -> bool:
    """``get_online_features(["v:f"], [{"k": 1}])``: features first, as Feast's signature has them."""
    return (
        isinstance(first, (list, tuple))
        and bool(first)
        and all(isinstance(f, str) for f in first)
        and (
            isinstance(second, dict) or (isinstance(second, (list, tuple)) and all(isinstance(r, dict) for r in second))
        )
    )


def _warn_if_evicting(online: OnlineStore) -> None:
    """Say so when Redis may delete keys once full: a view's value would read NOT_FOUND, and an
    aggregate that lost its events key or its ids would count part of its window, or a retried
    event twice; nothing here could tell."""
    try:
        policy = online.eviction_policy()
    except Exception:  # (a Redis down now: the first real call says so)
        return
    if policy is not None:
        log.warning(
            "Redis at %s deletes keys once full (maxmemory-policy %s): lookups could miss values and "
            "aggregates count part of their windows; set `maxmemory-policy noeviction` (a full Redis then "
            "refuses writes, and materialization says so) and size it with `featurestore capacity`",
            online.url,
            policy,
        )
