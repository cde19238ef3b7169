"""The subset of MLflow's REST API the ``mlflow`` client uses for tracking, served by the UI server,
so ``mlflow.set_tracking_uri("http://host:8765")`` and an unchanged script log runs we show.

Routes as MLflow's (``/api/2.0/mlflow/...``, artifacts proxied under
``/api/2.0/mlflow-artifacts/artifacts/...``), errors as MLflow writes them (``error_code`` and
``message``), behind the server's API keys: reads need ``read``, writes ``track``
(``MLFLOW_TRACKING_TOKEN`` is sent as ``Authorization: Bearer``). The model is
``featurestore.tracking.mlflow_compat``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from featurestore import FeatureStore
from featurestore.errors import ConflictError, FeatureStoreError, NotFoundError, RequestError
from featurestore.tracking.mlflow_compat import DEFAULT_EXPERIMENT, MlflowTracking
from serving.responses import error_status, json_response

PULL_SECONDS = 5  # runs of other machines (object storage) pulled in for a search at most this often


def mlflow_app(store: Callable[[], FeatureStore]) -> FastAPI:
    """MLflow's tracking routes over ``store()``'s runs; mount at ``/api/2.0``."""
    app = FastAPI(title="MLflow-compatible tracking", docs_url=None, redoc_url=None, openapi_url=None)
    made: list[MlflowTracking] = []
    pulled = [0.0]

    def tracking() -> MlflowTracking:
        if not made:
            current = store()
            made.append(
                MlflowTracking(
                    current.config.data_dir / "runs",
                    current.artifacts(),
                    current.config.data.child("experiments").objects(),
                    current.publish_run,
                )
            )
        return made[0]

    @app.exception_handler(FeatureStoreError)
    async def _error(request: Request, exc: FeatureStoreError) -> Response:
        code = (
            "RESOURCE_DOES_NOT_EXIST"
            if isinstance(exc, NotFoundError)
            else "RESOURCE_ALREADY_EXISTS"
            if isinstance(exc, ConflictError)
            else "INVALID_PARAMETER_VALUE"
            if isinstance(exc, RequestError)
            else "TEMPORARILY_UNAVAILABLE"
        )
        status = 400 if isinstance(exc, ConflictError) else error_status(exc)
        return json_response({"error_code": code, "message": str(exc)}, status)

    @app.exception_handler(StarletteHTTPException)
    async def _not_served(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:  # in MLflow's words, so its client says which route
            message = f"{request.url.path} is not part of the MLflow API served here (tracking only)"
            return json_response({"error_code": "ENDPOINT_NOT_FOUND", "message": message}, 404)
        code = "INVALID_PARAMETER_VALUE" if exc.status_code < 500 else "INTERNAL_ERROR"
        return json_response({"error_code": code, "message": str(exc.detail)}, exc.status_code)

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            parsed = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            raise RequestError("the request body is not JSON") from None
        if not isinstance(parsed, dict):
            raise RequestError("the request body is a JSON object")
        return parsed

    def run_id(fields: dict[str, Any]) -> str:
        found = fields.get("run_id") or fields.get("run_uuid")
        if not found:
            raise RequestError("run_id is required")
        return str(found)

    def objects(fields: dict[str, Any], name: str) -> list[dict[str, Any]]:
        """A field holding a list of objects (metrics, params, tags); absent: none."""
        found = fields.get(name) or []
        if not isinstance(found, list) or not all(isinstance(entry, dict) for entry in found):
            raise RequestError(f"{name} is a list of objects, not {str(found)[:80]!r}")
        return found

    def tag_map(fields: dict[str, Any]) -> dict[str, str]:
        tags = objects(fields, "tags")
        if not all(isinstance(t.get("key"), str) and t["key"] for t in tags):
            raise RequestError("each of tags is {key: text, value: text}")
        return {t["key"]: str(t.get("value", "")) for t in tags}

    def text(fields: dict[str, Any], name: str) -> str | None:
        """A text field; absent or null: None."""
        found = fields.get(name)
        if found is not None and not isinstance(found, str):
            raise RequestError(f"{name} is text, not {str(found)[:80]!r}")
        return found

    def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return asyncio.to_thread(fn, *args, **kwargs)  # (files and object storage: off the event loop)

    # ------------------------------------------------------------ experiments

    @app.post("/mlflow/experiments/create")
    async def create_experiment(request: Request) -> Response:
        fields = await body(request)
        return json_response(
            {"experiment_id": await call(tracking().create_experiment, fields.get("name"), tag_map(fields))}
        )

    @app.get("/mlflow/experiments/get")
    async def get_experiment(experiment_id: str) -> Response:
        return json_response({"experiment": await call(tracking().experiment, experiment_id)})

    @app.get("/mlflow/experiments/get-by-name")
    async def get_experiment_by_name(experiment_name: str) -> Response:
        return json_response({"experiment": await call(tracking().experiment_by_name, experiment_name)})

    @app.api_route("/mlflow/experiments/search", methods=["GET", "POST"])
    async def search_experiments(request: Request) -> Response:
        return json_response({"experiments": await call(tracking().search_experiments)})

    # ------------------------------------------------------------ runs

    @app.post("/mlflow/runs/create")
    async def create_run(request: Request) -> Response:
        fields = await body(request)
        run = await call(
            tracking().create_run,
            str(fields.get("experiment_id") or DEFAULT_EXPERIMENT),
            text(fields, "run_name"),
            fields.get("start_time"),
            tag_map(fields),
            text(fields, "user_id") or "",
        )
        return json_response({"run": run})

    @app.post("/mlflow/runs/update")
    async def update_run(request: Request) -> Response:
        fields = await body(request)
        info = await call(
            tracking().update_run,
            run_id(fields),
            text(fields, "status"),
            fields.get("end_time"),
            text(fields, "run_name"),
        )
        return json_response({"run_info": info})

    @app.post("/mlflow/runs/delete")
    async def delete_run(request: Request) -> Response:
        await call(tracking().set_lifecycle, run_id(await body(request)), "deleted")
        return json_response({})

    @app.post("/mlflow/runs/restore")
    async def restore_run(request: Request) -> Response:
        await call(tracking().set_lifecycle, run_id(await body(request)), "active")
        return json_response({})

    @app.get("/mlflow/runs/get")
    async def get_run(request: Request) -> Response:
        return json_response({"run": await call(tracking().run, run_id(dict(request.query_params)))})

    @app.post("/mlflow/runs/log-metric")
    async def log_metric(request: Request) -> Response:
        fields = await body(request)
        await call(tracking().log_batch, run_id(fields), metrics=[fields])
        return json_response({})

    @app.post("/mlflow/runs/log-parameter")
    async def log_parameter(request: Request) -> Response:
        fields = await body(request)
        await call(tracking().log_batch, run_id(fields), params=[fields])
        return json_response({})

    @app.post("/mlflow/runs/set-tag")
    async def set_tag(request: Request) -> Response:
        fields = await body(request)
        await call(tracking().log_batch, run_id(fields), tags=[fields])
        return json_response({})

    @app.post("/mlflow/runs/delete-tag")
    async def delete_tag(request: Request) -> Response:
        fields = await body(request)
        await call(tracking().delete_tag, run_id(fields), str(fields.get("key")))
        return json_response({})

    @app.post("/mlflow/runs/log-batch")
    async def log_batch(request: Request) -> Response:
        fields = await body(request)
        await call(
            tracking().log_batch,
            run_id(fields),
            objects(fields, "metrics"),
            objects(fields, "params"),
            objects(fields, "tags"),
        )
        return json_response({})

    @app.get("/mlflow/metrics/get-history")
    async def metric_history(request: Request) -> Response:
        query = dict(request.query_params)
        history = await call(tracking().metric_history, run_id(query), str(query.get("metric_key")))
        return json_response({"metrics": history})

    @app.api_route("/mlflow/runs/search", methods=["GET", "POST"])
    async def search_runs(request: Request) -> Response:
        fields = await body(request) if request.method == "POST" else dict(request.query_params)
        if time.monotonic() - pulled[0] > PULL_SECONDS:
            pulled[0] = time.monotonic()
            await call(store().runs_folder)
        try:
            max_results = int(fields.get("max_results") or 1000)
        except (TypeError, ValueError, OverflowError):
            raise RequestError("max_results is an integer") from None
        experiments, order_by = (fields.get(name) or [] for name in ("experiment_ids", "order_by"))
        experiments = [experiments] if isinstance(experiments, (str, int)) else experiments
        order_by = [order_by] if isinstance(order_by, str) else order_by
        if (
            not isinstance(experiments, list)
            or not isinstance(order_by, list)
            or not all(map(isinstance, order_by, repeat(str)))
        ):
            raise RequestError("experiment_ids is a list of experiment ids, order_by a list of texts")
        runs, token = await call(
            tracking().search_runs,
            experiments,
            text(fields, "filter") or "",
            order_by,
            max_results,
            text(fields, "page_token"),
            text(fields, "run_view_type") or "ACTIVE_ONLY",
        )
        return json_response({"runs": runs, **({"next_page_token": token} if token else {})})

    @app.post("/mlflow/logged-models/search")
    async def search_logged_models(request: Request) -> Response:
        """(MLflow 3 looks here when reading ``runs:/`` URIs: models are ``featurestore models``'s, none are MLflow's.)"""
        await body(request)
        return json_response({"models": []})

    # ------------------------------------------------------------ artifacts (proxied)

    def located(path: str) -> tuple[str, str]:
        """``<experiment>/<run>/artifacts/<path>`` -> (run id, path)."""
        parts = path.strip("/").split("/", 3)
        if len(parts) < 3 or parts[2] != "artifacts":
            raise RequestError(f"{path[:120]!r} is not <experiment id>/<run id>/artifacts/<path>")
        return parts[1], parts[3] if len(parts) > 3 else ""

    @app.get("/mlflow-artifacts/artifacts")
    async def list_artifacts(path: str = "") -> Response:
        run, folder = located(path)
        return json_response({"files": await call(tracking().list_artifacts, run, folder)})

    @app.put("/mlflow-artifacts/artifacts/{path:path}")
    async def upload_artifact(path: str, request: Request) -> Response:
        run, name = located(path)
        await call(tracking().put_artifact, run, name, await request.body())
        return json_response({})

    @app.get("/mlflow-artifacts/artifacts/{path:path}")
    async def download_artifact(path: str) -> Response:
        run, name = located(path)
        data = await call(tracking().read_artifact, run, name)
        return Response(data, media_type="application/octet-stream")

    return app
