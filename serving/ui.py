"""The web UI: a catalogue of definitions, per-view freshness, runs with overlaid curves, the
model registry with one-click lineage. Served under ``/ui`` by ``featurestore ui`` or inside the
feature server (``featurestore serve --ui``), behind the same API keys.

The page is static (``ui_static/``, shipped in the package: no CDN, works offline); it reads
the JSON routes below, which are also the API (``/ui/api/...``, in the OpenAPI docs). Every
route is read-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse, Response
from pydantic import StringConstraints

from featurestore import FeatureStore
from featurestore.auth import Authenticator
from featurestore.catalog import catalogue, view_status
from featurestore.consistency import read_checks
from featurestore.errors import NotFoundError, RequestError
from featurestore.feature_profile import DEFAULT_POINTS, view_profile
from featurestore.launch import ServerLaunch
from featurestore.statistics import HOUR, bucket_start
from featurestore.tracking import compare, curve, list_runs, read_run
from featurestore.tracking.lineage import model_lineage
from featurestore.training.model_registry import NAME_PATTERN as MODEL_NAME
from serving.fast_lane import FastLane
from serving.metrics import Metrics
from serving.mlflow_api import mlflow_app
from serving.reload import RegistryWatcher
from serving.responses import document_errors, install_error_handlers, json_response

STATIC = Path(__file__).parent / "ui_static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
NAME_PATTERN = r"^[A-Za-z0-9_.:@-]{1,200}$"
_NAME = re.compile(NAME_PATTERN)
Name = Annotated[str, PathParam(pattern=NAME_PATTERN, description="A run id or a view's name.")]
ModelName = Annotated[str, PathParam(pattern=MODEL_NAME, description="A registered model's name.")]
Sha256 = Annotated[
    str, PathParam(pattern="^[0-9a-f]{64}$", description="The artifact's SHA-256: 64 lower-case hex digits.")
]
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such view, run, model version or artifact."}}
RUNS_REFRESH_SECONDS = 5  # runs on object storage are pulled at most this often
MAX_POINTS = 5000


def _name(value: str, what: str) -> str:
    """A run id, model or view name as a path component: no traversal, no surprises."""
    if not _NAME.fullmatch(value) or value in (".", ".."):
        raise RequestError(f"{what} {value[:80]!r} is not a valid name")
    return value


def ui_app(store: Callable[[], FeatureStore]) -> FastAPI:
    """The UI and its API; ``store()`` returns the current store (the caller reloads it on apply)."""
    app = FastAPI(
        title="featurestore UI API",
        description="Read-only: catalogue, view status, runs, curves, models, lineage.",
        version="0.1.0",
    )
    document_errors(app)

    pulled = [0.0]

    def runs_root() -> Path:
        """The runs folder; runs on object storage pulled in first, at most every few seconds."""
        if time.monotonic() - pulled[0] < RUNS_REFRESH_SECONDS:
            return store().config.data_dir / "runs"
        pulled[0] = time.monotonic()
        return store().runs_folder()

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{asset}", include_in_schema=False)
    def static(asset: str) -> FileResponse:
        if asset not in ASSETS:
            raise NotFoundError(f"no UI asset {asset[:80]!r}")
        return FileResponse(STATIC / asset, media_type=ASSETS[asset], headers={"Cache-Control": "max-age=300"})

    @app.get(
        "/api/catalog",
        summary="Entities, views (features, types, windows), services and sources; q filters by name, "
        "description, owner, tag or feature",
    )
    def catalog(q: str = "") -> Response:
        found = catalogue(store().registry)
        if q:
            needle = q.lower()
            for kind in ("entities", "views", "services", "sources"):
                found[kind] = [o for o in found[kind] if needle in _searchable(o)]
        return json_response(found)

    @app.get(
        "/api/views/{name}",
        summary="One view: its definition, freshness, volume, and consistency checks covering it",
        responses=NOT_FOUND,
    )
    async def view(name: Name) -> Response:
        current = store()
        found = next((v for v in catalogue(current.registry)["views"] if v["name"] == _name(name, "view")), None)
        if found is None:
            raise NotFoundError(f"no applied feature view named {name!r}")
        status = None
        if found["kind"] == "feature_view":
            online = current.online_store if found["online"] else None
            status = await asyncio.to_thread(
                view_status, current.registry, current.offline_store, online, current.config.project, name
            )
        features = {f["name"] for f in found["features"]}
        checks = [
            {**c, "feature_match": {k: v for k, v in c["feature_match"].items() if k in features}}
            for c in read_checks(current.config.data_dir)
            if features & set(c["feature_match"])
        ]
        return json_response({"view": found, "status": status, "consistency": checks})

    @app.get(
        "/api/views/{name}/statistics",
        summary="A view's values: per feature its figures, history and served histograms on the same bins, "
        "rows / null rate / mean / median over time; served NOT_FOUND and null rates over time; drift reports",
        responses=NOT_FOUND,
    )
    async def view_statistics(
        name: Name,
        days: int | None = Query(None, ge=1, le=36600, description="Only the last this many days (default: all)."),
        points: int = Query(DEFAULT_POINTS, ge=3, le=MAX_POINTS, description="The most points a series holds."),
    ) -> Response:
        current = store()
        if _name(name, "view") not in current.definitions.feature_views:
            raise NotFoundError(f"no applied feature view named {name!r} with history")
        # (from the next whole hour: statistics start on hours, and a repeated call is the same one)
        since = bucket_start(datetime.now(UTC) - timedelta(days=days), HOUR) + HOUR if days else None
        return json_response(await asyncio.to_thread(view_profile, current, name, since, None, points))

    @app.get("/api/runs", summary="Runs newest first; q searches ids, tags and services; tag=key=value filters")
    def runs(
        q: str = "",
        tag: list[Annotated[str, StringConstraints(pattern=r"^[^=]+=")]] | None = Query(
            None, description="Runs with this tag, as key=value (repeat for several)."
        ),
    ) -> Response:
        tags = dict(t.split("=", 1) for t in tag or [])
        return json_response({"runs": list_runs(runs_root(), q, tags)})

    @app.get(
        "/api/runs/{run_id}",
        summary="A run's params, tags, final metrics, logged metrics, artifacts",
        responses=NOT_FOUND,
    )
    def run(run_id: Name) -> Response:
        return json_response(read_run(runs_root() / _name(run_id, "run")))

    @app.get(
        "/api/runs/{run_id}/curve",
        summary="One metric downsampled to at most `points` (Largest-Triangle-Three-Buckets)",
        responses=NOT_FOUND,
    )
    def run_curve(
        run_id: Name,
        metric: str = Query(..., description="The metric's name."),
        points: int = Query(500, ge=3, le=MAX_POINTS),
        writer: str | None = Query(None, pattern=NAME_PATTERN),
        x: Literal["step", "epoch", "samples", "wall_time"] = Query(
            "step", description="Against the step, the epoch, samples seen, or seconds since the run started."
        ),
    ) -> Response:
        path = runs_root() / _name(run_id, "run")
        if not path.is_dir():
            raise NotFoundError(f"no run {run_id!r}")
        return json_response(curve(path, metric, points, _name(writer, "writer") if writer else None, x))

    @app.get("/api/compare", summary="Runs side by side: differing params first, final metrics", responses=NOT_FOUND)
    def compare_runs(
        runs: list[Annotated[str, StringConstraints(pattern=NAME_PATTERN)]] = Query(
            ..., min_length=2, description="Two or more run ids."
        ),
    ) -> Response:
        return json_response(compare([read_run(runs_root() / _name(r, "run")) for r in runs]))

    @app.get("/api/models", summary="Registered models: versions, stages, metrics, the run that trained each")
    def models() -> Response:
        registry = store().model_registry()
        out = []
        for name in registry.names():
            aliases = registry.aliases(name)
            out.append(
                {
                    "name": name,
                    "stages": aliases,
                    "versions": [
                        {
                            "version": v,
                            "stages": [s for s, n in aliases.items() if n == v],
                            **_card_summary(registry.card(name, v)),
                        }
                        for v in reversed(registry.versions(name))
                    ],
                }
            )
        return json_response({"models": out})

    @app.get(
        "/api/models/{name}/{version}/lineage",
        summary="Model version → run → dataset manifest → definitions → Delta table versions, each hop checked",
        responses=NOT_FOUND,
    )
    def lineage(name: ModelName, version: Annotated[int, PathParam(ge=1)]) -> Response:
        current = store()
        registry = current.model_registry()
        if version not in registry.versions(_name(name, "model")):
            raise NotFoundError(f"model {name!r} has no version {version}")
        return json_response(
            model_lineage(registry, name, version, runs_root(), current.registry, current.offline_store)
        )

    @app.get(
        "/api/artifacts/{sha256}",
        summary="An artifact's bytes, by its SHA-256 (verify with any sha256 tool)",
        responses=NOT_FOUND,
    )
    def artifact(sha256: Sha256) -> Response:
        artifacts = store().artifacts()
        headers = {"X-Content-SHA256": sha256, "Content-Disposition": f'attachment; filename="{sha256}"'}
        if artifacts.location.is_local:
            return FileResponse(artifacts.path(sha256), media_type="application/octet-stream", headers=headers)
        return Response(artifacts.read(sha256), media_type="application/octet-stream", headers=headers)

    @app.get("/api/artifacts/{sha256}/verify", summary="Recompute an artifact's hash", responses=NOT_FOUND)
    def verify(sha256: Sha256) -> Response:
        return json_response({"sha256": sha256, "ok": store().artifacts().verify(sha256)})

    @app.get(
        "/api/consistency", summary="Every recorded consistency check, oldest first, with match rate over served time"
    )
    def consistency() -> Response:
        return json_response({"checks": read_checks(store().config.data_dir)})

    return app


def _card_summary(card: dict[str, Any]) -> dict[str, Any]:
    return {k: card.get(k) for k in ("run", "metrics", "registered_at", "feature_service", "dataset_manifest_hash")}


def _searchable(obj: dict[str, Any]) -> str:
    parts = [
        obj.get("name", ""),
        obj.get("description", ""),
        obj.get("owner", ""),
        *(f"{k}={v}" for k, v in (obj.get("tags") or {}).items()),
        *(f["name"] if isinstance(f, dict) else str(f) for f in obj.get("features", [])),
    ]
    return " ".join(str(p) for p in parts).lower()


def create_app(repo: str | Path | None = None) -> FastAPI:
    """The UI on its own (``featurestore ui``): ``/ui/``, its API under ``/ui/api``, docs at ``/docs``,
    and MLflow's tracking API under ``/api/2.0`` (``serving.mlflow_api``)."""
    watcher = RegistryWatcher(Path(repo) if repo else ServerLaunch.received().repo_path)
    metrics = Metrics("featurestore_ui")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(watcher.run())
        yield
        task.cancel()
        watcher.current.close()

    app = FastAPI(title="featurestore UI", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, metrics)
    mount(app, lambda: watcher.current, metrics)
    app.mount("/api/2.0", mlflow_app(lambda: watcher.current))  # mlflow.set_tracking_uri(<this server>)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    config = watcher.current.config
    return FastLane(app, {}, config.server.max_request_bytes, Authenticator(config.server.api_keys), metrics)  # type: ignore[return-value]


def mount(app: FastAPI, store: Callable[[], FeatureStore], metrics: Metrics) -> None:
    """Serve the UI under ``/ui`` of ``app`` (errors mapped and counted like the app's)."""
    sub = ui_app(store)
    install_error_handlers(sub, metrics)
    app.mount("/ui", sub)


def app_factory() -> FastAPI:
    """Entry for ``uvicorn --factory``: what ``featurestore ui`` handed over (``ServerLaunch``)."""
    return create_app()
