"""The ``featurestore`` command line."""

from __future__ import annotations

import json
import sys
import time
import typing
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from featurestore.definitions import StreamSource, window_label
from featurestore.errors import FeatureStoreError
from featurestore.launch import ServerLaunch


class _WrappingHelpCommand(typer.core.TyperCommand):
    """A command whose ``--help`` is click's plain layout, which wraps at any width: typer's rich
    table cut option names and their help at 80 columns (``--shard-group-s…``)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:  # (typer bundles its own click)
        mode, self.rich_markup_mode = self.rich_markup_mode, None
        try:
            super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode


class _App(typer.Typer):
    """A typer app whose commands' ``--help`` wraps (the command list keeps its rich panels)."""

    def command(self, *args: Any, **kwargs: Any) -> Any:
        return super().command(*args, cls=_WrappingHelpCommand, **kwargs)


app = _App(
    help="featurestore: one Python definition per feature, point-in-time-correct training data, Redis serving.",
    epilog=(
        "Examples:\n\n"
        "featurestore init my_repo && featurestore apply -r my_repo   (scaffold a repo, record its definitions)\n\n"
        "featurestore materialize-incremental -r my_repo   (write history and Redis)\n\n"
        "featurestore serve -r my_repo --workers 2   (the feature server; its docs at /docs)\n\n"
        "featurestore COMMAND --help   (what a command takes)"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# typer writes a type beside every option, "<bool>" for flags too (--help included): a flag takes no value
_display_type = typer.core.TyperOption.display_type_rich
typer.core.TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else _display_type(self, ctx)  # type: ignore[method-assign]
console = Console()
err_console = Console(stderr=True)

EngineOption = typer.Option(
    None, "--engine", help="Where the work runs: local (DuckDB) or ray; default offline_store.engine."
)
RayAddressOption = typer.Option(
    None, "--ray-address", help="The Ray cluster, host:port (default offline_store.ray_address)."
)
RepoOption = typer.Option(Path("."), "--repo", "-r", help="Feature repo folder (holds featurestore.yaml).")
LogLevelOption = typer.Option("info", help="Server log level: debug, info, warning, error.")
BroadcastHostOption = typer.Option(
    "127.0.0.1", help="This machine's address the weight broadcast group reaches it on (another host: its LAN address)."
)
AccessLogOption = typer.Option(True, help="Log every request (off saves a few µs per request).")
LogFormatOption = typer.Option(
    "text", help="Server log lines as text, or json (one object per line, for log shippers)."
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TlsCertOption = typer.Option(
    None, "--tls-cert", help="Serve HTTPS: the server's certificate chain, a PEM file (with --tls-key)."
)
TlsKeyOption = typer.Option(None, "--tls-key", help="The private key of --tls-cert, a PEM file.")
GUARDED_HTTP = "serving.protocol:GuardedHttpProtocol"  # uvicorn's protocol with a deadline for request heads


def _one_of(value: str, choices: Any, flag: str) -> Any:
    """``value`` if it is one of the ``Literal`` type ``choices``' values, else a CLI error line."""
    allowed = typing.get_args(choices)
    if value not in allowed:
        raise FeatureStoreError(f"{flag} is one of {', '.join(allowed)}, not {value!r}")
    return value


def _store(repo: Path, engine: str | None = None, ray_address: str | None = None):
    """The repo's store; ``--engine`` / ``--ray-address``, when given, win over featurestore.yaml."""
    from featurestore.config import RepoConfig
    from featurestore.feature_store import FeatureStore

    if engine is None and ray_address is None:
        return FeatureStore(repo)
    return FeatureStore(repo, RepoConfig.load(repo).with_engine(engine, ray_address))


def _parse_time(value: str | None) -> datetime | None:
    from featurestore.config import parse_time

    return parse_time(value) if value is not None else None


@app.command(rich_help_panel="Definitions")
def init(
    path: Path = typer.Argument(Path("feature_repo"), help="Folder to create."),
    project: str = typer.Option("my_project", help="Project name."),
) -> None:
    """Scaffold a feature repo with an example entity, source and view."""
    from featurestore.config import check_project_name
    from featurestore.scaffold import scaffold

    check_project_name(project, "--project: ")
    scaffold(path, project)
    console.print(
        f"Created feature repo in [bold]{path}[/]. Next: [cyan]featurestore --help[/] or [cyan]featurestore plan -r {path}[/]"
    )


@app.command(rich_help_panel="Definitions")
def plan(repo: Path = RepoOption) -> None:
    """Show what `apply` would change (added / changed / removed objects)."""
    store = _store(repo)
    console.print(store.plan().describe(), markup=False, soft_wrap=True)  # "[... needs --force]" is text, not markup
    store.recheck_unfilled()  # (logs each view whose events online wait for a resend, and what to run)


@app.command(rich_help_panel="Definitions")
def apply(
    repo: Path = RepoOption,
    force: bool = typer.Option(False, "--force", help="Allow removing views and deleting their data."),
) -> None:
    """Validate the definitions and record them in the registry."""
    store = _store(repo)
    result = store.apply(force=force)
    console.print(result.describe(), markup=False, soft_wrap=True)
    if not result.empty:
        console.print(f"Applied registry version {store.registry.current()['version']}.")
    store.recheck_unfilled()  # (logs each view whose events online wait for a resend, and what to run)
    store.close()


@app.command("list", rich_help_panel="Definitions")
def list_objects(repo: Path = RepoOption) -> None:
    """List entities, feature views, services and push/stream sources; flag edits not yet applied."""
    store = _store(repo)
    table = Table("kind", "name", "details")
    for e in store.list_entities():
        table.add_row("entity", e.name, "keys: " + ", ".join(e.join_keys))
    for v in store.list_feature_views():
        entities = ", ".join(e.name for e in v.entities)
        if v.is_aggregated:
            windows = ", ".join(dict.fromkeys(window_label(a.window) for a in v.aggregations))
            details = f"{len(v.features)} aggregates over {windows} windows, entities: {entities}"
        else:
            ttl = window_label(v.ttl) if v.ttl is not None else "none"
            details = f"{len(v.features)} features, ttl {ttl}, entities: {entities}"
        table.add_row("feature view", v.name, details)
    for o in store.definitions.on_demand_feature_views.values():
        inputs = [*o.input_refs, *(f"request:{f.name}" for f in o.request_fields)]
        table.add_row("on-demand view", o.name, f"{len(o.features)} features from {', '.join(inputs)}")
    for s in store.list_feature_services():
        table.add_row("feature service", s.name, f"{len(s.feature_refs())} features")
    for p in store.definitions.push_sources.values():
        kind = "stream source" if isinstance(p, StreamSource) else "push source"
        table.add_row(kind, p.name, "columns: " + ", ".join(f.name for f in p.schema))
    console.print(table)
    if store.unapplied:
        console.print("Not applied (the code differs from the registry; `featurestore plan` shows how):", markup=False)
        for what in store.unapplied.values():
            console.print(f"  {what}", markup=False, soft_wrap=True)


@app.command(rich_help_panel="Definitions")
def describe(
    name: str = typer.Argument(..., help="Name of an entity, view, service or push source."), repo: Path = RepoOption
) -> None:
    """Print an object's definition as the registry stores it."""
    store = _store(repo)
    for kind, objects in store.definitions.all().items():
        if name in objects:
            spec = objects[name].to_spec()
            applied = store.unapplied.get(name, "applied")
            version = {"history_version": store.layout(name).version} if kind == "feature_view" else {}
            console.print_json(
                json.dumps(
                    {"defined_at": str(objects[name].location), "registry": applied, **version, **spec}, default=str
                )
            )
            return
    raise FeatureStoreError(f"nothing named {name!r}; see `featurestore list`")


@app.command(rich_help_panel="Data")
def materialize(
    start: str = typer.Argument(..., help="Start of the event-time window (ISO 8601; naive = UTC)."),
    end: str = typer.Argument(..., help="End of the window, exclusive."),
    views: list[str] = typer.Option(None, "--view", "-v", help="Only these views (repeatable)."),
    fail_on_bad_rows: bool = typer.Option(False, help="Fail instead of sending bad source rows to the rejects table."),
    engine: str | None = EngineOption,
    ray_address: str | None = RayAddressOption,
    repo: Path = RepoOption,
) -> None:
    """Compute views over [START, END) and write the history store and Redis."""
    with _store(repo, engine, ray_address) as store:
        report = store.materialize(
            _parse_time(start),
            _parse_time(end),
            views or None,
            on_bad_rows="fail" if fail_on_bad_rows else "reject",
            progress=True,
        )
        console.print(report.describe(), markup=False, soft_wrap=True)


@app.command("materialize-incremental", rich_help_panel="Data")
def materialize_incremental(
    end: str | None = typer.Argument(None, help="Up to this time (default: now)."),
    views: list[str] = typer.Option(None, "--view", "-v", help="Only these views (repeatable)."),
    rebuild_online: bool = typer.Option(
        False,
        help="Also refill Redis from the history store (after Redis lost some keys; an emptied or replaced Redis is refilled anyway).",
    ),
    engine: str | None = EngineOption,
    ray_address: str | None = RayAddressOption,
    repo: Path = RepoOption,
) -> None:
    """Write every row not yet materialized, late arrivals included."""
    with _store(repo, engine, ray_address) as store:
        report = store.materialize_incremental(
            _parse_time(end), views or None, progress=True, rebuild_online=rebuild_online
        )
        console.print(report.describe(), markup=False, soft_wrap=True)


@app.command(rich_help_panel="Data")
def backfill(
    views: list[str] = typer.Argument(
        ..., help="Views to rebuild (what `plan` names after a new version or an added column)."
    ),
    engine: str | None = EngineOption,
    ray_address: str | None = RayAddressOption,
    repo: Path = RepoOption,
) -> None:
    """Recompute views' whole history from their sources into their current version, and refill Redis."""
    with _store(repo, engine, ray_address) as store:
        report = store.backfill(views, progress=True)
        console.print(report.describe(), markup=False, soft_wrap=True)
        for name in views:
            layout = store.layout(name)
            console.print(
                f"{name}: version v{layout.version} (history table {layout.history_table}) is complete",
                markup=False,
            )


@app.command(rich_help_panel="Data")
def stream(
    source: str = typer.Argument(..., help="A StreamSource's name."),
    to: str = typer.Option("online_and_offline", help="online, offline or online_and_offline."),
    batch: int = typer.Option(1000, help="Entries read (and pushed) per round trip."),
    consumer: str | None = typer.Option(None, help="Consumer name in the group (default: host-pid)."),
    claim_idle: float = typer.Option(
        30.0,
        min=0.1,
        help="Seconds an entry another consumer took may stay unacknowledged "
        "before this one takes it over (that consumer died).",
    ),
    until_idle: bool = typer.Option(False, help="Stop once the stream has nothing new (default: run until Ctrl-C)."),
    repo: Path = RepoOption,
) -> None:
    """Consume a stream source into both stores (at least once; retries never count twice), showing lag and throughput."""
    from rich.live import Live

    from featurestore.materialization.push import PushTarget
    from featurestore.streaming import StreamConsumer

    with _store(repo) as store:
        runner = StreamConsumer(
            store,
            source,
            consumer=consumer,
            batch=batch,
            to=_one_of(to, PushTarget, "--to"),
            claim_idle_ms=int(claim_idle * 1000),
        )
        console.print(f"consuming {runner.stream} as {runner.consumer} (group featurestore) → {to}")

        def line(stats) -> str:
            return (
                f"{stats.consumed:,} consumed  {stats.rate:,.0f}/s  pending {stats.pending:,}  "
                f"lag {stats.lag_ms / 1000:.1f}s  dead-lettered {stats.dead:,}"
            )

        with Live(console=console, transient=False, auto_refresh=False) as live:
            shown = [0.0]

            def progress(stats) -> None:
                if time.monotonic() - shown[0] > 0.5:
                    live.update(line(stats), refresh=True)
                    shown[0] = time.monotonic()

            try:
                stats = runner.run(until_idle=until_idle, on_progress=progress)
            except KeyboardInterrupt:
                stats = runner.stats
            live.update(line(stats), refresh=True)


@app.command(rich_help_panel="Data")
def compact(
    views: list[str] = typer.Option(None, "--view", "-v", help="Only these views (repeatable)."),
    vacuum_hours: int | None = typer.Option(
        None,
        help="Also delete files only versions older than this many hours use "
        "(exports from those versions can then no longer be reproduced).",
    ),
    drop_old_layouts: bool = typer.Option(
        False,
        "--drop-old-layouts",
        help="Also delete what views hold online under layouts no longer read (left by an upgrade or a "
        "definition change). Servers of an earlier version still read them: once every server runs this one.",
    ),
    repo: Path = RepoOption,
) -> None:
    """Merge small history files (pushes commit many); optionally vacuum old ones. Online, pack the
    ended blocks of aggregated views' events pushed a few at a time (a few bytes an event
    instead of ~100) and store their tiles' summaries, so no lookup pays for them (writes of
    whole tiles do both as they write).

    Pushes do the offline part on their own past offline_store.compact_after_files and
    vacuum_after_hours (featurestore.yaml), and the online part for what they wrote once its
    tiles end (online_store.pack_pushes); run this from a scheduler for what a stopped or
    overloaded process left. Without --view, also merge the servers' feature logs."""
    with _store(repo) as store:
        compacted = store.compact(views or None, vacuum_hours)
        if not views:  # (the servers' feature logs: a file a second each while serving)
            compacted |= store.compact_feature_logs()
        for name, r in compacted.items():
            console.print(
                f"{name}: {r['files_before']} → {r['files_after']} data files, {r['files_vacuumed']} vacuumed",
                markup=False,
            )
        from featurestore.progress import progress_bar

        bar = progress_bar("keys")
        with bar:
            task = bar.add_task("packing online events", total=None)
            packed = store.pack_online(views or None, lambda keys: bar.advance(task, keys))
        for name, done in packed.items():
            console.print(
                f"{name}: online, {done.events:,} events packed into {done.blocks:,} blocks, "
                f"{done.summaries:,} tile summaries stored",
                markup=False,
            )
        if drop_old_layouts:
            bar = progress_bar("keys")
            with bar:
                task = bar.add_task("deleting earlier layouts", total=None)
                dropped = store.drop_old_layouts(views or None, lambda keys: bar.advance(task, keys))
            for name, gone in dropped.items():
                console.print(f"{name}: online, {gone:,} keys and fields of earlier layouts deleted", markup=False)


@app.command(rich_help_panel="Data")
def export(
    out: str = typer.Option(..., "--out", "-o", help="Output folder or s3://bucket/prefix (Parquet + manifest.json)."),
    service: str | None = typer.Option(None, "--service", "-s", help="Feature service to export."),
    entities: Path | None = typer.Option(
        None, "--entities", "-e", help="Entity rows (Parquet) with keys and event_timestamp."
    ),
    from_manifest: str | None = typer.Option(
        None,
        "--from-manifest",
        help="Reproduce an earlier export byte for byte (its manifest.json, a path or s3:// URL).",
    ),
    engine: str | None = EngineOption,
    ray_address: str | None = RayAddressOption,
    repo: Path = RepoOption,
) -> None:
    """Export a point-in-time-correct training dataset, or reproduce one from its manifest."""
    store = _store(repo, engine, ray_address)
    if from_manifest is not None:
        manifest = store.reproduce_training_dataset(from_manifest, out, progress=True)
        console.print(f"Reproduced {manifest['row_count']} rows into {out}; data files match the manifest's SHA-256.")
        return
    if not service or not entities:
        raise FeatureStoreError("pass --service and --entities (or --from-manifest)")
    manifest = store.export_training_dataset(str(entities), service, out, progress=True)
    console.print(f"Exported {manifest['row_count']} rows to {out} (manifest {manifest['manifest_hash'][:12]}).")


@app.command(rich_help_panel="Serving")
def serve(
    repo: Path = RepoOption,
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(6566, help="Port (Feast's default).", min=1, max=65535),
    workers: int = typer.Option(
        1,
        min=1,
        help="Worker processes, each listening on its own socket (Linux); `kill -HUP` replaces them one by one.",
    ),
    log_features: bool = typer.Option(
        False, help="Log lookups by feature service (for `check-consistency --service`)."
    ),
    ui: bool = typer.Option(False, "--ui", help="Also serve the web UI under /ui (behind the same API keys)."),
    keep_alive: float = typer.Option(5.0, min=0.1, help="Seconds an idle keep-alive connection stays open."),
    log_level: str = LogLevelOption,
    access_log: bool = AccessLogOption,
    log_format: str = LogFormatOption,
    tls_cert: Path | None = TlsCertOption,
    tls_key: Path | None = TlsKeyOption,
) -> None:
    """Run the feature server (OpenAPI docs at /docs)."""
    _run_server(
        "serving.feature_server:app_factory",
        ServerLaunch(str(repo.resolve()), log_features=log_features, ui=ui),
        host,
        port,
        workers,
        log_level,
        access_log,
        log_format,
        keep_alive=keep_alive,
        tls=_tls(tls_cert, tls_key),
    )


@app.command(rich_help_panel="Serving")
def ui(
    repo: Path = RepoOption,
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8765, help="Port.", min=1, max=65535),
    log_level: str = LogLevelOption,
    tls_cert: Path | None = TlsCertOption,
    tls_key: Path | None = TlsKeyOption,
) -> None:
    """Run the web UI: catalogue, view freshness, runs and curves, models and lineage (at /ui/)."""
    _run_server(
        "serving.ui:app_factory",
        ServerLaunch(str(repo.resolve())),
        host,
        port,
        1,
        log_level,
        False,
        "text",
        what="serving the web UI of",
        path="/ui/",
        tls=_tls(tls_cert, tls_key),
    )


def _tls(cert: Path | None, key: Path | None) -> dict[str, Any]:
    """uvicorn's settings for ``--tls-cert`` / ``--tls-key`` (none: plain HTTP), loaded once here:
    a missing or mismatched file is an error line, not a traceback in every worker."""
    if cert is None and key is None:
        return {}
    if cert is None or key is None:
        raise FeatureStoreError("--tls-cert and --tls-key go together: the certificate chain and its private key")
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise FeatureStoreError(
            f"--tls-cert {cert} and --tls-key {key} do not load as a certificate chain and its key (PEM): {exc}"
        ) from None
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def _require_auth_off_loopback(host: str, config: Any) -> None:
    """Binding beyond loopback needs API keys, or an explicit ``server: {auth: off}``."""
    if host not in LOOPBACK and config.server.api_keys is None and not config.server.auth_off:
        raise FeatureStoreError(
            f"serving on {host} exposes every route without authentication; configure `server.auth.keys` "
            "(`featurestore api-key` prints an entry) or set `server: {auth: off}` to accept that"
        )


def _run_server(
    factory: str,
    launch: ServerLaunch,
    host: str,
    port: int,
    workers: int,
    log_level: str,
    access_log: bool,
    log_format: str = "text",
    what: str = "serving",
    path: str = "",
    keep_alive: float = 5.0,
    tls: dict[str, Any] | None = None,
) -> None:
    import os

    import uvicorn

    from featurestore import serve_workers

    _SERVING.append(what)
    serve_workers.raise_open_files_limit()
    repo = launch.repo_path
    store = _store(repo)
    _require_auth_off_loopback(host, store.config)
    store.require_applied()  # fail here, readably, rather than in every worker
    _ = store.online_store  # start the embedded Redis once, before the workers attach to it
    launch.export()
    if workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # /metrics sums every worker's samples
        import atexit
        import shutil
        import tempfile

        metrics_dir = tempfile.mkdtemp(prefix="featurestore-metrics-")
        atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    auth = (
        f"{len(store.config.server.api_keys)} API key(s)"
        if store.config.server.api_keys is not None
        else "no authentication"
    )
    started = (
        f"featurestore: {what} {repo.resolve()} (registry v{store.registry.current()['version']}) on "
        f"{'https' if tls else 'http'}://{host}:{port}{path} with {workers} worker(s), {auth}; docs at /docs"
    )
    if store.config.server.api_keys is not None and not tls and host not in LOOPBACK:
        started += (
            "\nnote: API keys cross the network in clear text: serve HTTPS (--tls-cert, --tls-key), or end TLS "
            "in front of this server"
        )
    from featurestore.logs import LOG_FORMATS, JsonFormatter, uvicorn_log_config

    if log_format not in LOG_FORMATS:
        raise FeatureStoreError(f"--log-format is one of {list(LOG_FORMATS)}, not {log_format!r}")
    if log_format == "json":
        import logging

        print(
            JsonFormatter().format(
                logging.makeLogRecord({"name": "featurestore", "levelname": "INFO", "msg": started})
            ),
            file=sys.stderr,
            flush=True,
        )
    else:
        err_console.print(started, markup=False, soft_wrap=True)
    options: dict[str, Any] = {
        "factory": True,
        "log_level": log_level,
        "access_log": access_log,
        "http": GUARDED_HTTP,
        "timeout_keep_alive": keep_alive,
        **({"log_config": uvicorn_log_config(log_format)} if log_format != "text" else {}),
        **(tls or {}),
    }
    if workers > 1 and serve_workers.supported():  # a listening socket per worker: connections spread evenly
        serve_workers.serve(factory, workers=workers, host=host, port=port, **options)
    else:
        uvicorn.run(factory, host=host, port=port, workers=workers, **options)


@app.command("capacity", rich_help_panel="Serving")
def capacity_command(
    entities: int | None = typer.Option(
        None, min=1, help="Entities to size for, of each entity key (default: about as many as Redis holds now)."
    ),
    events_per_entity: float | None = typer.Option(
        None, min=0, help="Events per entity in each aggregated view's window (default: as sampled)."
    ),
    node_memory: str = typer.Option("25GB", help="Data one Redis node may hold (its maxmemory): 25GB, 64GiB."),
    lookups_per_second: float = typer.Option(
        0, min=0, help="Load to size for: lookups of one entity a second (a request of k entities is k)."
    ),
    events_per_second: float = typer.Option(
        0, min=0, help="Load to size for: events a second written into aggregated views (pushes, streams)."
    ),
    sample: int = typer.Option(1000, min=1, help="Entities to sample."),
    probe_writes: bool = typer.Option(
        True, help="Time writes by writing the sampled events again under a scratch project (deleted after)."
    ),
    repo: Path = RepoOption,
) -> None:
    """What the online store costs for this repo, measured on a sample of its data: bytes per entity
    and per event by layout, Redis CPU per lookup and per event written, and the memory and
    nodes N entities and a load of lookups and writes need. Measure on a quiet moment: other
    clients' commands count too."""
    from featurestore import capacity

    node_bytes = capacity.parse_size(node_memory)
    if events_per_second and not probe_writes:
        raise FeatureStoreError("--events-per-second needs the cost of a write: leave out --no-probe-writes")
    with _store(repo) as store:
        measured = capacity.measure(store.online_store, store.definitions, store.config.project, sample, probe_writes)
    if not measured.sampled:
        raise FeatureStoreError("Redis holds no entities of this project yet: materialize or push some, then measure")
    report = measured.describe(entities, events_per_entity, node_bytes, lookups_per_second, events_per_second)
    console.print(report, markup=False, soft_wrap=True)


@app.command("api-key", rich_help_panel="Serving")
def api_key(
    name: str = typer.Option(..., help="Who uses the key (shown in logs and errors)."),
    scope: list[str] = typer.Option(
        ["read"], "--scope", help="read, push, push:<source>, materialize, track or admin (repeatable)."
    ),
) -> None:
    """Make a new API key: give the key to the client, put the printed entry under server.auth.keys."""
    from featurestore.auth import hash_key, new_key, parse_keys

    key = new_key()
    entry = {"name": name, "sha256": hash_key(key), "scopes": list(scope)}
    parse_keys([entry], "--scope")  # the same checks the servers apply
    console.print(f"key: {key}", markup=False)
    console.print("featurestore.yaml (server: auth: keys:), or FEATURESTORE_API_KEYS as a JSON list:", markup=False)
    console.print(f"  - {json.dumps(entry)}", markup=False, soft_wrap=True)


@app.command("serve-model", rich_help_panel="Serving")
def serve_model(
    repo: Path = RepoOption,
    model: str = typer.Option(..., help="Registered model name."),
    stage: str = typer.Option("production", help="Stage alias to serve (follows promotions)."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, help="Port.", min=1, max=65535),
    workers: int = typer.Option(
        1, min=1, help="Worker processes (replicas all follow promotions; `kill -HUP` replaces them one by one)."
    ),
    device: str = typer.Option("cpu", help="Where the model scores: cpu, cuda or auto (CUDA when present)."),
    source: str | None = typer.Option(
        None,
        help="A checkpoint engine started with --broadcast: take each promotion's weights from it in memory "
        "and flip to them in place (the key in FEATURESTORE_API_KEY authenticates this server).",
    ),
    broadcast_host: str = BroadcastHostOption,
    log_level: str = LogLevelOption,
    access_log: bool = AccessLogOption,
    log_format: str = LogFormatOption,
    tls_cert: Path | None = TlsCertOption,
    tls_key: Path | None = TlsKeyOption,
) -> None:
    """Run the inference server: POST /predict scores from online features."""
    from featurestore.training.distributed import pick_device

    pick_device(device)  # a clear error now rather than in every worker
    launch = ServerLaunch(
        str(repo.resolve()), model=model, stage=stage, device=device, source=source, broadcast_host=broadcast_host
    )
    _run_server(
        "serving.inference_server:app_factory",
        launch,
        host,
        port,
        workers,
        log_level,
        access_log,
        log_format,
        tls=_tls(tls_cert, tls_key),
    )


@app.command("train", rich_help_panel="Training and models")
def train_command(
    dataset: str = typer.Option(
        ..., "--dataset", "-d", help="Exported dataset: a folder or s3:// prefix with manifest.json (fetched once)."
    ),
    label: str = typer.Option("label", help="Label column."),
    task: str = typer.Option("classification", help="classification or regression."),
    request_input: list[str] = typer.Option(None, "--request-input", help="Request-time input column (repeatable)."),
    entity_key: list[str] = typer.Option(
        None, "--entity-key", help="Entity key learned as a hashed embedding table, e.g. card_id (repeatable)."
    ),
    entity_buckets: int = typer.Option(65_536, help="Rows of each entity-key embedding table."),
    epochs: int = typer.Option(4, help="Epochs."),
    batch_size: int = typer.Option(
        512, help="Rows per step over all ranks (the global batch: each rank trains on its share)."
    ),
    seed: int = typer.Option(0, help="Seeds weights, data order and each rank's share of the rows."),
    device: str = typer.Option("auto", help="auto (CUDA when present), cpu or cuda."),
    bf16: bool = typer.Option(False, help="bfloat16 autocast on CUDA."),
    nproc_per_node: int = typer.Option(
        1, help="Training processes on this machine (runs torchrun: gloo on CPU, NCCL on CUDA)."
    ),
    nnodes: int = typer.Option(1, help="Machines in the run (each runs this command with its --node-rank)."),
    node_rank: int = typer.Option(0, help="This machine's rank among --nnodes."),
    master_addr: str = typer.Option("127.0.0.1", help="Address of node 0 (with --nnodes > 1)."),
    master_port: int = typer.Option(29500, help="Port on node 0 (with --nnodes > 1).", min=1, max=65535),
    shard_group_size: int = typer.Option(
        1, help="Ranks sharing one sharded model replica (FSDP); the world is sync groups x this."
    ),
    sync_every: int = typer.Option(
        0,
        help="0: replicas in step every step (HSDP); H: average parameters across sync groups every H steps (local SGD).",
    ),
    sync_warmup_steps: int = typer.Option(
        0, help="With --sync-every: average gradients across sync groups every step for the first this-many steps."
    ),
    outer_optimizer: str = typer.Option(
        "average",
        help="With --sync-every, what each sync does: average the sync groups' parameters, or nesterov "
        "(DiLoCo's outer step: their averaged move since the last sync, applied with Nesterov momentum).",
    ),
    outer_lr: float = typer.Option(
        0.7, help="The nesterov outer optimizer's learning rate (1 with no momentum: average)."
    ),
    outer_momentum: float = typer.Option(0.9, help="The nesterov outer optimizer's momentum."),
    async_checkpoints: bool = typer.Option(
        True, help="Write sharded checkpoints in the background while training goes on (at most one in flight)."
    ),
    hold_parameters: bool = typer.Option(
        False,
        help="FSDP: keep each unit's gathered parameters from forward to backward instead of releasing them "
        "(more memory, one gather less); final.json records each rank's peak memory.",
    ),
    collective_timeout: float = typer.Option(
        300.0, help="Seconds a rank may take to join a collective before the run fails (a stopped or lost rank)."
    ),
    resume: str | None = typer.Option(
        None, help="Resume this run id from its last checkpoint (on any number of processes)."
    ),
    register: str | None = typer.Option(None, help="Register the trained model under this name."),
    repo: Path = RepoOption,
) -> None:
    """Train an MLP on an exported dataset, on one process or many; the run is tracked under <data_dir>/runs."""
    from featurestore.retrieval.export import fetch_dataset
    from featurestore.training.distributed import OuterOptimizer
    from featurestore.training.trainer import Task, TrainConfig, new_run_id

    store = _store(repo)
    config = TrainConfig(
        dataset=str(fetch_dataset(store.location(dataset), store.config.data_dir / "datasets")),
        label=label,
        task=_one_of(task, Task, "--task"),
        request_inputs=request_input or [],
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        device=device,
        bf16=bf16,
        shard_group_size=shard_group_size,
        sync_every=sync_every,
        sync_warmup_steps=sync_warmup_steps,
        outer_optimizer=_one_of(outer_optimizer, OuterOptimizer, "--outer-optimizer"),
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        async_checkpoints=async_checkpoints,
        hold_parameters=hold_parameters,
        collective_timeout_s=collective_timeout,
        entity_keys=entity_key or [],
        entity_buckets=entity_buckets,
    )
    runs = store.runs_folder(resume, checkpoints=True) if resume else store.config.data_dir / "runs"
    run_id = resume or new_run_id()
    try:
        run = _train(config, runs, run_id, resume, nproc_per_node, nnodes, node_rank, master_addr, master_port)
    finally:
        store.publish_run(run_id)  # done or not: a run resumes from its checkpoint on any machine
    if run is None:
        return
    console.print(f"run {run.name}: {json.loads((run / 'final.json').read_text())}")
    if register:
        console.print(f"registered {register} v{store.model_registry().register(register, run)}")


def _train(
    config: Any,
    runs: Path,
    run_id: str,
    resume: str | None,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> Path | None:
    """Train in this process, or in ``nproc_per_node`` torchrun ranks; the run's folder (None on a
    node other than 0 of several)."""
    import os
    import subprocess

    from featurestore.training.trainer import train

    world = nproc_per_node * nnodes
    if world > 1 and "WORLD_SIZE" not in os.environ:
        if world % config.shard_group_size:
            raise FeatureStoreError(f"{world} processes do not split into shard groups of {config.shard_group_size}")
        where = (
            ["--standalone"]
            if nnodes == 1
            else [
                "--nnodes",
                str(nnodes),
                "--node-rank",
                str(node_rank),
                "--master-addr",
                master_addr,
                "--master-port",
                str(master_port),
            ]
        )
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc_per_node),
            *where,
            "-m",
            "featurestore.training.launch",
            json.dumps(config.__dict__),
            str(runs),
            run_id,
            *(["--resume"] if resume else []),
        ]
        if subprocess.run(command).returncode != 0:
            raise FeatureStoreError(
                f"distributed training failed (run {run_id}); see the ranks' errors above, "
                f"resume it with --resume {run_id}"
            )
        return runs / run_id if node_rank == 0 else None
    return train(config, runs, resume=resume, run_id=run_id)


@app.command("checkpoint-engine", rich_help_panel="Serving")
def checkpoint_engine(
    model: str = typer.Option(..., help="Model name to distribute."),
    source: str | None = typer.Option(None, help="The trainer-side engine's URL; omit to BE the trainer-side engine."),
    upstream: str | None = typer.Option(
        None, help="Another replica's engine to fetch versions from first (a broadcast tree)."
    ),
    models_from: str | None = typer.Option(
        None,
        help="The source repo's data_dir on object storage (s3://bucket/prefix): versions are fetched from there "
        "before the source is asked (after the upstream, when it has them).",
    ),
    broadcast: bool = typer.Option(
        False,
        help="(source) Broadcast each promotion's weights in memory to the inference servers started "
        "with --source pointing here (bucketed over gloo, BLAKE3 per bucket, all or nothing).",
    ),
    broadcast_host: str = BroadcastHostOption,
    bucket_mb: int = typer.Option(64, min=1, help="(source, --broadcast) Broadcast bucket size in MB."),
    transport: str = typer.Option(
        "auto",
        help="(source, --broadcast) How buckets reach members: shared memory for members on this machine "
        "(auto: when every member of a round is), or over the network.",
    ),
    host: str = typer.Option("127.0.0.1", help="Interface to bind (elsewhere needs server.auth.keys, as for `serve`)."),
    port: int = typer.Option(8600, help="Port.", min=1, max=65535),
    repo: Path = RepoOption,
    tls_cert: Path | None = TlsCertOption,
    tls_key: Path | None = TlsKeyOption,
) -> None:
    """Serve this repo's model versions to replicas; with --source, also keep this repo's registry in step with it.

    With API keys configured every route needs the `read` scope; a replica presents the key in
    FEATURESTORE_API_KEY to its source and upstream, and an inference server to the source whose
    broadcasts it joins. An https:// source or upstream is trusted by the CAs in SSL_CERT_FILE when
    set, else the system's."""

    import uvicorn

    from featurestore.broadcast_rounds import Transport
    from featurestore.serve_workers import raise_open_files_limit

    _one_of(transport, Transport, "--transport")
    tls = _tls(tls_cert, tls_key)
    store = _store(repo)
    _require_auth_off_loopback(host, store.config)
    if models_from and not source:
        raise FeatureStoreError("--models-from is where a replica fetches versions; give its --source too")
    if broadcast and source:
        raise FeatureStoreError(
            "--broadcast is for the source engine; replicas' inference servers take part with --source"
        )
    role = f"replica of {source}" + (f" via {upstream}" if upstream else "") if source else "source"
    if broadcast:
        role += f", broadcasting promotions from {broadcast_host} in {bucket_mb} MB buckets ({transport} transport)"
    if models_from:
        role += f", fetching from {store.location(models_from)} first"
    auth = (
        f"{len(store.config.server.api_keys)} API key(s)"
        if store.config.server.api_keys is not None
        else "no authentication"
    )
    scheme = "https" if tls else "http"
    err_console.print(f"checkpoint engine for {model!r} ({role}) on {scheme}://{host}:{port}, {auth}", markup=False)
    ServerLaunch(
        str(repo.resolve()),
        model=model,
        source=source,
        upstream=upstream,
        models_from=models_from,
        broadcast=broadcast,
        broadcast_host=broadcast_host,
        bucket_mb=bucket_mb,
        broadcast_transport=transport,
    ).export()
    _SERVING.append("checkpoint engine")
    raise_open_files_limit()
    uvicorn.run(
        "serving.checkpoint_engine:app_factory",
        factory=True,
        host=host,
        port=port,
        log_level="warning",
        http=GUARDED_HTTP,
        **tls,
    )


runs_app = _App(help="Tracked training runs.", no_args_is_help=True)
models_app = _App(help="The model registry: versions and stage aliases.", no_args_is_help=True)
app.add_typer(runs_app, name="runs", rich_help_panel="Training and models")
app.add_typer(models_app, name="models", rich_help_panel="Training and models")


@runs_app.command("list")
def runs_list(
    search: str = typer.Option("", help="Only runs whose id, tags or feature service contain this."),
    tag: list[str] = typer.Option([], "--tag", help="Only runs with this tag, as key=value (repeatable)."),
    param: list[str] = typer.Option(
        [], "--param", help="A parameter's column, e.g. config.learning_rate (repeatable)."
    ),
    metric: list[str] = typer.Option(
        [], "--metric", help="A final metric's column, e.g. val_auc (repeatable; default: every metric in one)."
    ),
    repo: Path = RepoOption,
) -> None:
    """List runs, newest first, with their status, start, duration, tags and final metrics."""
    from featurestore.tracking import list_runs

    table = Table("run", "status", "started", "took", "tags", *param, *(metric or ["metrics"]))
    table.columns[0].no_wrap, table.columns[0].min_width = True, 20  # a run id is copied whole into `runs show`

    def number(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "–" if v is None else str(v)

    for run in list_runs(_store(repo).runs_folder(), search, _key_values(tag)):
        finals = [number(run["final"].get(m)) for m in metric] or [
            " ".join(f"{k}={number(v)}" for k, v in run["final"].items())
        ]
        table.add_row(
            run["id"],
            run["status"],
            run["started_at"],
            _duration(run["duration_s"]),
            " ".join(f"{k}={v}" for k, v in run["tags"].items()),
            *(number(run["params"].get(p)) for p in param),
            *finals,
        )
    console.print(table)


def _duration(seconds: float | None) -> str:
    """``95.2`` -> ``1m 35s``; a run still going (or cut off): ``–``."""
    if seconds is None:
        return "–"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return (
        f"{hours}h {rest // 60:02d}m"
        if hours
        else f"{rest // 60}m {rest % 60:02d}s"
        if rest >= 60
        else f"{seconds:.1f}s"
    )


def _key_values(pairs: list[str]) -> dict[str, str]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise FeatureStoreError(f"tags are key=value, not {bad}")
    return dict(p.split("=", 1) for p in pairs)


@runs_app.command("show")
def runs_show(run_id: str, repo: Path = RepoOption) -> None:
    """Show a run's parameters, tags, final metrics, logged metrics and artifacts."""
    from featurestore.tracking import read_run

    console.print_json(json.dumps(read_run(_store(repo).runs_folder(run_id) / run_id), default=str))


@runs_app.command("tag")
def runs_tag(
    run_id: str, tags: list[str] = typer.Argument(..., help="key=value pairs."), repo: Path = RepoOption
) -> None:
    """Label a run (``baseline=yes``, ``note=...``): list and the web UI filter on tags."""
    from featurestore.tracking import set_tags

    store = _store(repo)
    merged = set_tags(store.runs_folder(run_id) / run_id, _key_values(tags))
    store.publish_run(run_id)
    console.print(f"run {run_id}: " + " ".join(f"{k}={v}" for k, v in merged.items()), markup=False)


@runs_app.command("compare")
def runs_compare(
    run_ids: list[str] = typer.Argument(..., help="Two or more run ids."),
    metric: list[str] = typer.Option(["train_loss", "val_auc"], "--metric", help="Curves to overlay (repeatable)."),
    plot: Path | None = typer.Option(None, help="Write the overlaid curves to this PNG."),
    x: str = typer.Option(
        "step", "--x", help="Curves against: step, epoch, samples (runs of other batch sizes) or wall_time."
    ),
    repo: Path = RepoOption,
) -> None:
    """Runs side by side: the parameters that differ first, final metrics, overlaid curves."""
    from featurestore.tracking import compare, plot_compare, read_run

    root = _store(repo).runs_folder()
    missing = [r for r in run_ids if not (root / r).is_dir()]
    if missing:
        raise FeatureStoreError(f"no run(s) {missing}; see `featurestore runs list`")
    table = compare([read_run(root / r) for r in run_ids])
    view = Table("", *table["runs"])
    for key in table["differs"]:
        view.add_row(f"[bold]{key}[/]", *(str(v) for v in table["params"][key]))
    for key, values in table["final"].items():
        cells = [f"{v:,.4f}" if isinstance(v, float) else str(v) for v in values]
        if (best := table["best"].get(key)) is not None:
            cells[best] = f"[bold green]{cells[best]} *[/]"
        view.add_row(key, *cells)
    console.print(view)
    same = [k for k in table["params"] if k not in table["differs"]]
    console.print(f"{len(same)} parameters are the same in every run; * marks the best value", markup=False)
    if plot is not None:
        console.print(f"curves: {plot_compare([root / r for r in run_ids], metric, plot, x=x)}", markup=False)


@models_app.command("list")
def models_list(repo: Path = RepoOption) -> None:
    """List registered models, versions, aliases and metrics."""

    registry = _store(repo).model_registry()
    table = Table("model", "version", "stages", "metrics", "feature service")
    for name in registry.names():
        aliases = registry.aliases(name)
        for version in registry.versions(name):
            card = registry.card(name, version)
            stages = ", ".join(s for s, v in aliases.items() if v == version)
            metrics = ", ".join(f"{k}={v:.4f}" for k, v in card["metrics"].items() if isinstance(v, float))
            table.add_row(name, str(version), stages, metrics, card["feature_service"])
    console.print(table)


@models_app.command("promote")
def models_promote(
    name: str,
    version: int,
    stage: str = typer.Option("production", help="staging or production."),
    repo: Path = RepoOption,
) -> None:
    """Point a stage alias at a version; running inference servers switch to it."""

    with _store(repo) as store:
        store.model_registry().promote(name, version, stage)
    console.print(f"{name} {stage} → v{version}")


@models_app.command("rollback")
def models_rollback(
    name: str, stage: str = typer.Option("production", help="staging or production."), repo: Path = RepoOption
) -> None:
    """Point a stage back at the version it had before its last promotion."""
    with _store(repo) as store:
        version = store.model_registry().rollback(name, stage)
    console.print(f"{name} {stage} → v{version} (rolled back)")


@app.command("check-consistency", rich_help_panel="Training and models")
def check_consistency_command(
    model: str | None = typer.Option(None, help="Model whose feature log (inference server) to check."),
    service: str | None = typer.Option(None, help="Check the feature server's log of this service instead."),
    as_of: str = typer.Option(
        "auto",
        help="History as of: auto (each vector as it was served: replays with `at` as of event "
        "time, live lookups as of created time), event or created.",
    ),
    repo: Path = RepoOption,
) -> None:
    """Compare served feature vectors (feature log) with the history store, and rescore offline."""
    from featurestore.consistency import MODES, check_consistency, check_service_log, record_check

    if (model is None) == (service is None):
        raise FeatureStoreError(
            "name what to check: --model NAME (an inference server's log) or --service NAME (the feature server's)"
        )
    if as_of not in MODES:
        raise FeatureStoreError(f"--as-of is one of {list(MODES)}, not {as_of!r}")
    with _store(repo) as store:
        if service is not None:
            report, name = check_service_log(store, service, as_of=as_of), f"service:{service}"
        else:
            assert model is not None  # one of the two, checked above
            report, name = check_consistency(store, model, as_of=as_of), model
        record_check(report, store.config.data_dir, name)
    console.print(report.describe(), markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


@app.command("monitor", rich_help_panel="Training and models")
def monitor_command(
    service: str | None = typer.Option(
        None, help="A feature service: its logged lookups (serve --log-features) against --dataset."
    ),
    dataset: Path | None = typer.Option(None, help="The exported training dataset (its folder or manifest.json)."),
    view: str | None = typer.Option(None, help="A view: its recent event days (--since) against the days before."),
    since: str | None = typer.Option(
        None, help="The recent window: 30m, 6h, 1d, 2w (a view's: whole event days, default 1d)."
    ),
    baseline: str | None = typer.Option(None, help="A view's: the days before --since to compare with (default all)."),
    psi: float | None = typer.Option(
        None, help="Flag a feature whose population stability index passes this (default: monitoring: in the yaml)."
    ),
    repo: Path = RepoOption,
) -> None:
    """Drift of each feature: PSI, Jensen-Shannon distance, null and NOT_FOUND rates, of a service
    (training vs serving) or of a view (recent days vs the days before); exits 1 when a feature
    drifted past its threshold. The report is kept for /metrics."""
    from featurestore.drift import record_drift, service_drift, view_drift

    if (service is None) == (view is None) or (service is not None and dataset is None):
        raise FeatureStoreError("monitor takes --service S --dataset DIR, or --view V [--since 1d] [--baseline 7d]")
    with _store(repo) as store:
        name = service or view
        assert name is not None
        threshold = psi if psi is not None else store.config.monitoring.threshold(name)
        if service is not None:
            assert dataset is not None
            report = service_drift(store, service, dataset, _window(since) if since else None, threshold)
        else:
            recent = _window(since or "1d")
            report = view_drift(store, name, recent, _window(baseline) if baseline else None, threshold)
        record_drift(report, store.config.data_dir)
    console.print(report.describe(), markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


def _window(text: str) -> timedelta:
    """``30m``, ``6h``, ``1d``, ``2w`` -> a timedelta."""
    units = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
    number, unit = text.strip()[:-1], text.strip()[-1:].lower()
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in units or amount <= 0:
        raise FeatureStoreError(f"--since takes a number and a unit (m, h, d, w), like 6h or 1d; not {text!r}")
    return timedelta(**{units[unit]: amount})


@app.command(rich_help_panel="Try it")
def demo(
    repo: Path = typer.Option(Path("definitions"), "--repo", "-r", help="The example repo (definitions/)."),
    data_dir: Path | None = typer.Option(None, help="Where to put data (default: a new temp folder)."),
    cards: int = typer.Option(2000, help="Number of cards to simulate."),
    days: int = typer.Option(30, help="Days of history."),
    replay_days: float = typer.Option(2, help="Held-out days replayed through the inference server."),
    batch_hours: float = typer.Option(
        2, help="Replay: history is appended every this many hours of replayed time (online updates per payment)."
    ),
    ui: bool = typer.Option(False, "--ui", help="Afterwards, serve the web UI on the demo's data until Ctrl-C."),
    ui_port: int = typer.Option(8765, help="The web UI's port."),
) -> None:
    """Run the end-to-end fraud demo on embedded defaults and print AUC, latency and consistency."""
    from featurestore.demo.pipeline import run_demo

    result = run_demo(repo, data_dir, cards=cards, days=days, replay_days=replay_days, batch_hours=batch_hours)
    url = f"http://127.0.0.1:{ui_port}/ui/"
    if ui:
        console.print(f"web UI: {url} (features, freshness, runs, models, lineage; Ctrl-C stops it)", markup=False)
        _run_server(
            "serving.ui:app_factory",
            ServerLaunch(str(Path(repo).resolve())),
            "127.0.0.1",
            ui_port,
            1,
            "warning",
            False,
            what="serving the web UI of",
            path="/ui/",
        )
    else:
        console.print(
            f"web UI: FEATURESTORE_DATA_DIR={result.data_dir} featurestore ui --repo {repo} --port {ui_port}, "
            f"then open {url} (or run the demo with --ui)",
            markup=False,
            soft_wrap=True,
        )
    if not result.consistency.ok:
        raise typer.Exit(1)


def main() -> None:
    import signal

    # SIGTERM exits like Ctrl-C: cleanups run (the embedded redis-server this process started is stopped)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        try:
            app()
        except SystemExit as done:
            if not done.code:
                _object_requests_made()
            raise
    except FeatureStoreError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except ModuleNotFoundError as exc:
        if exc.name not in TRAINING_MODULES:
            raise
        err_console.print(
            f"[bold red]error:[/] this command trains or serves models and needs {exc.name}: "
            + escape("pip install 'featurestore[train]'"),
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    except Exception as exc:
        said = _said(exc)
        if said is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(said)}", highlight=False, soft_wrap=True)
        sys.exit(1)


def _said(exc: Exception) -> str | None:
    """The error line for an exception the user can act on; None for one that is a bug (its traceback)."""
    from featurestore.storage import explain

    paths = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
    if isinstance(exc, OSError) and (exc.filename or isinstance(exc, paths)):
        # (a path the user gave, or a file a command needs first or writes: one line says which)
        return f"{exc.strerror}: {exc.filename}" if exc.filename and exc.strerror else str(exc)
    explained = explain(exc)
    return None if explained is None else str(explained)


_SERVING: list[str] = []  # set by a command that ran a server: its counts are in /metrics, its logs its own


def _object_requests_made() -> None:
    """What a command that succeeded asked of object storage, one line on stderr (nothing when it
    asked nothing; a failed command's one line is its error; a server's are in its /metrics)."""
    from featurestore.object_requests import METER, summary

    line = summary(METER.snapshot())
    if line and not _SERVING:
        err_console.print(line, style="dim", highlight=False, markup=False, soft_wrap=True)


TRAINING_MODULES = ("torch", "matplotlib")  # the `train` extra: a host that only serves features does without


if __name__ == "__main__":
    main()
