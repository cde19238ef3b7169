"""MLflow's tracking model over our runs, so an unchanged script logging through ``mlflow`` writes
runs our UI, ``runs compare`` and lineage show, and ``mlflow.search_runs`` reads ours.

The mapping: an MLflow run is a run folder (``runs``), its params ``params.json`` (flat, as
MLflow keeps them), its tags ``tags.json``, its metrics the metric store (writer ``mlflow``:
one tracking server writes a run's MLflow metrics), its artifacts the content-addressed store
listed in ``artifacts.json`` under their paths; what MLflow knows and we do not (experiment,
status, times, name) is ``mlflow.json``. Runs we create (no ``mlflow.json``) are experiment 0's,
FINISHED once they have final metrics. Experiments are objects (``<data>/experiments``, on disk
or object storage) named by their name's hash and created only if absent.

Values are as MLflow's REST API writes them (``featurestore.serving``'s routes pass them on):
dicts of ``info``/``data``, times in ms, ``{"key", "value"}`` lists.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from featurestore.errors import ConflictError, NotFoundError, RequestError
from featurestore.files import atomic_write
from featurestore.storage import Objects
from featurestore.tracking.artifacts import ArtifactStore
from featurestore.tracking.metric_store import MetricWriter, read_metrics
from featurestore.tracking.runs import _json, flat_params, record_times, set_tags, times

DEFAULT_EXPERIMENT = "0"
WRITER = "mlflow"
STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
MAX_RESULTS = 50_000  # MLflow's own cap on a search page
OPEN_WRITERS = 64  # metric writers of live runs kept (their segment numbers; each flushes every request)
_RUN_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,99}")


class MlflowTracking:
    """Experiments and runs as MLflow's tracking API sees them, over a runs folder, an artifact
    store and an experiments object store. ``published(run_id)``: called when a run changed
    enough to be copied to object storage (created, ended)."""

    def __init__(
        self,
        runs_root: Path,
        artifacts: ArtifactStore,
        experiments: Objects,
        published: Callable[[str], None] = lambda run_id: None,
    ):
        self.root = Path(runs_root)
        self.artifacts = artifacts
        self.experiments = experiments
        self.published = published
        self._writers: OrderedDict[str, MetricWriter] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ experiments

    def create_experiment(self, name: str, tags: dict[str, str] | None = None) -> str:
        """A new experiment's id: its name's hash, created only if absent, so two servers never make a
        name twice."""
        name = _text(name, "experiment name")
        experiment_id = _experiment_id(name)
        now = _now_ms()
        record = {"name": name, "creation_time": now, "last_update_time": now, "tags": dict(tags or {})}
        if (
            name == "Default"
            or self.experiments.put(f"{experiment_id}.json", json.dumps(record).encode(), if_absent=True) is None
        ):
            raise ConflictError(f"experiment {name!r} already exists")
        return experiment_id

    def experiment(self, experiment_id: str) -> dict[str, Any]:
        experiment_id = str(experiment_id)
        if experiment_id == DEFAULT_EXPERIMENT:
            record: dict[str, Any] = {"name": "Default", "creation_time": 0, "last_update_time": 0, "tags": {}}
        else:
            found = (
                self.experiments.get(f"{experiment_id}.json") if re.fullmatch(r"[0-9a-f]{16}", experiment_id) else None
            )
            if found is None:
                raise NotFoundError(f"no experiment with id {experiment_id!r}")
            record = json.loads(found[0])
        return {
            "experiment_id": experiment_id,
            "name": record["name"],
            "artifact_location": f"mlflow-artifacts:/{experiment_id}",
            "lifecycle_stage": record.get("lifecycle_stage", "active"),
            "creation_time": record["creation_time"],
            "last_update_time": record["last_update_time"],
            "tags": _pairs(record["tags"]),
        }

    def experiment_by_name(self, name: str) -> dict[str, Any]:
        return self.experiment(DEFAULT_EXPERIMENT if name == "Default" else _experiment_id(name))

    def search_experiments(self) -> list[dict[str, Any]]:
        found = [self.experiment(k.removesuffix(".json")) for k in self.experiments.keys("") if k.endswith(".json")]
        return [self.experiment(DEFAULT_EXPERIMENT), *sorted(found, key=lambda e: e["creation_time"])]

    # ------------------------------------------------------------ runs

    def create_run(
        self,
        experiment_id: str,
        run_name: str | None = None,
        start_time: int | None = None,
        tags: dict[str, str] | None = None,
        user_id: str = "",
    ) -> dict[str, Any]:
        experiment_id = self.experiment(str(experiment_id or DEFAULT_EXPERIMENT))["experiment_id"]
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]  # as the trainer names runs
        tags = dict(tags or {})
        run_name = run_name or tags.get("mlflow.runName") or run_id
        run_dir = self.root / run_id
        run_dir.mkdir(parents=True)
        started_ms = _int(start_time, "start_time") if start_time else _now_ms()
        meta = {
            "experiment_id": experiment_id,
            "run_name": run_name,
            "user_id": user_id or tags.get("mlflow.user", ""),
            "status": "RUNNING",
            "start_time": started_ms,
            "end_time": None,
            "lifecycle_stage": "active",
        }
        atomic_write(run_dir / "mlflow.json", json.dumps(meta).encode())
        record_times(run_dir, started=True, at=started_ms / 1000)
        atomic_write(run_dir / "params.json", b"{}")
        set_tags(run_dir, {**tags, "mlflow.runName": run_name})
        self.published(run_id)
        return self.run(run_id)

    def update_run(
        self, run_id: str, status: str | None = None, end_time: int | None = None, run_name: str | None = None
    ) -> dict[str, Any]:
        run_dir = self._run_dir(run_id)
        meta = self._meta(run_dir)
        if status is not None:
            if status not in STATUSES:
                raise RequestError(f"status {status!r} is none of {', '.join(STATUSES)}")
            meta["status"] = status
        if end_time is not None:
            meta["end_time"] = _int(end_time, "end_time")
        if run_name:
            meta["run_name"] = run_name
            set_tags(run_dir, {"mlflow.runName": run_name})
        atomic_write(run_dir / "mlflow.json", json.dumps(meta).encode())
        if meta["status"] != "RUNNING":
            record_times(run_dir, finished=True, at=(meta["end_time"] or _now_ms()) / 1000)
            self._close_writer(run_id)
            # final metrics, as our own runs keep them: what lists and comparisons show
            latest = {m["key"]: m["value"] for m in self._latest_metrics(run_dir)}
            atomic_write(run_dir / "final.json", json.dumps(latest, default=str).encode())
            self.published(run_id)
        return self.run(run_id)["info"]

    def set_lifecycle(self, run_id: str, stage: str) -> None:
        run_dir = self._run_dir(run_id)
        meta = self._meta(run_dir)
        atomic_write(run_dir / "mlflow.json", json.dumps({**meta, "lifecycle_stage": stage}).encode())

    def log_batch(
        self,
        run_id: str,
        metrics: Iterable[dict[str, Any]] = (),
        params: Iterable[dict[str, Any]] = (),
        tags: Iterable[dict[str, Any]] = (),
    ) -> None:
        """Params are written once (a different value for a logged key is refused, as MLflow does)."""
        run_dir = self._run_dir(run_id)
        metrics, params, tags = list(metrics), list(params), list(tags)
        parsed = [
            (_int(m.get("step", 0), "step"), _float(m.get("value")), _int(m.get("timestamp") or _now_ms(), "timestamp"))
            for m in metrics
        ]
        if params:
            stored = _json(run_dir / "params.json")
            for p in params:
                key, value = _text(p.get("key"), "param key"), str(p.get("value", ""))
                if key in stored and stored[key] != value:
                    raise RequestError(
                        f"param {key!r} was logged as {stored[key]!r}; a run's params cannot change (got {value!r})"
                    )
                stored[key] = value
            atomic_write(run_dir / "params.json", json.dumps(stored, indent=2).encode())
        if tags:
            set_tags(run_dir, {_text(t.get("key"), "tag key"): str(t.get("value", "")) for t in tags})
        if metrics:
            with self._lock:
                writer = self._writer(run_id, run_dir)
                for m, (step, number, timestamp) in zip(metrics, parsed):
                    writer.log(step, {_text(m.get("key"), "metric key"): number}, wall_time=timestamp / 1000)
                writer.flush()  # on disk before the client hears "logged"

    def delete_tag(self, run_id: str, key: str) -> None:
        run_dir = self._run_dir(run_id)
        tags = _json(run_dir / "tags.json")
        if key not in tags:
            raise NotFoundError(f"run {run_id!r} has no tag {key!r}")
        del tags[key]
        atomic_write(run_dir / "tags.json", json.dumps(tags, indent=2).encode())

    def run(self, run_id: str) -> dict[str, Any]:
        run_dir = self._run_dir(run_id)
        meta = self._meta(run_dir)
        params = _json(run_dir / "params.json")
        if not (run_dir / "mlflow.json").exists():  # one of ours: nested params as MLflow's flat strings
            params = {k: v if isinstance(v, str) else json.dumps(v) for k, v in flat_params(params).items()}
        return {
            "info": {
                "run_id": run_dir.name,
                "run_uuid": run_dir.name,
                "run_name": meta["run_name"],
                "experiment_id": meta["experiment_id"],
                "user_id": meta["user_id"],
                "status": meta["status"],
                "start_time": meta["start_time"],
                **({"end_time": meta["end_time"]} if meta["end_time"] is not None else {}),
                "artifact_uri": f"mlflow-artifacts:/{meta['experiment_id']}/{run_dir.name}/artifacts",
                "lifecycle_stage": meta["lifecycle_stage"],
            },
            "data": {
                "metrics": self._latest_metrics(run_dir),
                "params": _pairs(params),
                "tags": _pairs(_json(run_dir / "tags.json")),
            },
            "inputs": {},
        }

    def metric_history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        run_dir = self._run_dir(run_id)
        records = read_metrics(run_dir, key, columns=["step", "wall_time", "value"])
        return [
            {"key": key, "value": _json_float(v), "timestamp": _ms(t), "step": s}
            for s, t, v in zip(
                records["step"].to_pylist(), records["wall_time"].to_pylist(), records["value"].to_pylist()
            )
        ]

    def search_runs(
        self,
        experiment_ids: list[str],
        filter_string: str = "",
        order_by: list[str] | None = None,
        max_results: int = 1000,
        page_token: str | None = None,
        view_type: str = "ACTIVE_ONLY",
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of runs and the next page's token (None: the last page)."""
        if not 1 <= max_results <= MAX_RESULTS:
            raise RequestError(f"max_results is 1 to {MAX_RESULTS}, not {max_results}")
        clauses = parse_filter(filter_string)
        wanted = {str(e) for e in experiment_ids}
        stages = {"ACTIVE_ONLY": {"active"}, "DELETED_ONLY": {"deleted"}, "ALL": {"active", "deleted"}}.get(view_type)
        if stages is None:
            raise RequestError(f"run_view_type {view_type!r} is none of ACTIVE_ONLY, DELETED_ONLY, ALL")
        found = []
        for run_dir in sorted(self.root.iterdir()) if self.root.exists() else []:
            if not run_dir.is_dir() or not _RUN_ID.fullmatch(run_dir.name):
                continue
            meta = self._meta(run_dir)
            if meta["experiment_id"] in wanted and meta["lifecycle_stage"] in stages:
                run = self.run(run_dir.name)
                if all(_holds(run, clause) for clause in clauses):
                    found.append(run)
        for key, descending in reversed([_order(o) for o in order_by or []] + [(("attributes", "start_time"), True)]):
            # each pass a stable sort, the most significant key last; runs without the value go last
            present = [(_sort_key(v), r) for r in found if (v := _value(r, key)) is not None]
            present.sort(key=lambda pair: pair[0], reverse=descending)
            found = [r for _, r in present] + [r for r in found if _value(r, key) is None]
        start = int(page_token) if page_token and page_token.isdigit() else 0
        page = found[start : start + max_results]
        return page, str(start + max_results) if start + max_results < len(found) else None

    # ------------------------------------------------------------ artifacts

    def put_artifact(self, run_id: str, path: str, data: bytes) -> None:
        run_dir = self._run_dir(run_id)
        path = _artifact_path(path)
        sha = self.artifacts.put_bytes(data)
        with self._lock:  # (artifacts.json is rewritten whole: one writer at a time in this server)
            listed = _json(run_dir / "artifacts.json")
            listed[path] = {"sha256": sha, "bytes": len(data)}
            atomic_write(run_dir / "artifacts.json", json.dumps(listed, indent=2).encode())

    def read_artifact(self, run_id: str, path: str) -> bytes:
        listed = _json(self._run_dir(run_id) / "artifacts.json")
        entry = listed.get(_artifact_path(path))
        if entry is None:
            raise NotFoundError(f"run {run_id!r} has no artifact {path!r}")
        return self.artifacts.read(entry["sha256"])

    def list_artifacts(self, run_id: str, folder: str = "") -> list[dict[str, Any]]:
        """What ``folder`` holds: files (with sizes) and folders, names relative to it."""
        prefix = f"{_artifact_path(folder)}/" if folder.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, entry in _json(self._run_dir(run_id) / "artifacts.json").items():
            if path.startswith(prefix):
                head, _, rest = path[len(prefix) :].partition("/")
                if rest:
                    entries[head] = {"path": head, "is_dir": True}
                else:
                    entries[head] = {"path": head, "is_dir": False, "file_size": entry["bytes"]}
        return [entries[k] for k in sorted(entries)]

    # ------------------------------------------------------------ internals

    def _run_dir(self, run_id: str) -> Path:
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            raise RequestError(f"{str(run_id)[:80]!r} is not a run id")
        run_dir = self.root / run_id
        if not run_dir.is_dir():
            raise NotFoundError(f"no run {run_id!r}")
        return run_dir

    def _meta(self, run_dir: Path) -> dict[str, Any]:
        meta = _json(run_dir / "mlflow.json")
        if meta:
            return meta
        started, finished = times(run_dir)
        return {
            "experiment_id": DEFAULT_EXPERIMENT,
            "run_name": run_dir.name,
            "user_id": "",
            "status": "FINISHED" if (run_dir / "final.json").exists() else "RUNNING",
            "start_time": int(started * 1000),
            "end_time": int(finished * 1000) if finished is not None else None,
            "lifecycle_stage": "active",
        }

    def _latest_metrics(self, run_dir: Path) -> list[dict[str, Any]]:
        """Each metric's value at its largest step (the latest logged among equal steps), as MLflow keeps it."""
        records = read_metrics(run_dir)
        latest: dict[str, tuple[int, float, float]] = {}
        names = pc.cast(records["metric"], "string").to_pylist()
        for name, step, wall, value in zip(
            names, records["step"].to_pylist(), records["wall_time"].to_pylist(), records["value"].to_pylist()
        ):
            if name not in latest or (step, wall) >= latest[name][:2]:
                latest[name] = (step, wall, value)
        return [
            {"key": k, "value": _json_float(v), "timestamp": _ms(w), "step": s}
            for k, (s, w, v) in sorted(latest.items())
        ]

    def _writer(self, run_id: str, run_dir: Path) -> MetricWriter:
        writer = self._writers.pop(run_id, None) or MetricWriter(run_dir, WRITER)
        self._writers[run_id] = writer
        while len(self._writers) > OPEN_WRITERS:
            self._writers.popitem(last=False)[1].close()
        return writer

    def _close_writer(self, run_id: str) -> None:
        with self._lock:
            if (writer := self._writers.pop(run_id, None)) is not None:
                writer.close()


# ------------------------------------------------------------ search filters

_CLAUSE = re.compile(
    r"""\s*(?P<kind>attributes?|metrics?|params?|tags?|run)\.(?P<key>`[^`]+`|"[^"]+"|[\w.\-]+)\s*
        (?P<op>!=|>=|<=|=|<|>|NOT\s+ILIKE|NOT\s+LIKE|ILIKE|LIKE)\s*
        (?P<value>'(?:[^']|'')*'|"[^"]*"|[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*""",
    re.IGNORECASE | re.VERBOSE,
)
_KINDS = {"attribute": "attributes", "run": "attributes", "metric": "metrics", "param": "params", "tag": "tags"}
Clause = tuple[tuple[str, str], str, Any]


def parse_filter(text: str) -> list[Clause]:
    """``metrics.loss < 0.5 AND params.lr = '0.1'`` -> clauses; what it cannot read is a RequestError."""
    clauses: list[Clause] = []
    for part in re.split(r"\s+AND\s+", text.strip(), flags=re.IGNORECASE) if text.strip() else []:
        match = _CLAUSE.fullmatch(part)
        if match is None:
            raise RequestError(
                f"cannot read the filter clause {part[:120]!r}: write <metrics|params|tags|attributes>.<key> "
                "<op> <value>, clauses joined by AND"
            )
        kind = match["kind"].lower().rstrip("s")
        key = match["key"].strip('`"')
        raw = match["value"]
        value: Any = raw[1:-1].replace("''", "'") if raw[0] in "'\"" else float(raw)
        clauses.append(((_KINDS[kind], key), " ".join(match["op"].upper().split()), value))
    return clauses


def _value(run: dict[str, Any], key: tuple[str, str]) -> Any:
    kind, name = key
    if kind == "attributes":
        name = {"run_id": "run_id", "run_name": "run_name", "status": "status"}.get(name, name)
        return run["info"].get(name)
    if kind == "metrics":
        return next((m["value"] for m in run["data"]["metrics"] if m["key"] == name), None)
    return next((p["value"] for p in run["data"][kind] if p["key"] == name), None)


def _holds(run: dict[str, Any], clause: Clause) -> bool:
    key, op, wanted = clause
    found = _value(run, key)
    if found is None:
        return False
    if isinstance(wanted, float) or key[0] == "metrics":
        try:
            found, wanted = float(found), float(wanted)
        except (TypeError, ValueError):
            raise RequestError(f"{key[0]}.{key[1]} compares as a number: {wanted!r}") from None
    if op.endswith("LIKE"):
        pattern = "^" + re.escape(str(wanted)).replace("%", ".*").replace("_", ".") + "$"
        hit = re.match(pattern, str(found), re.IGNORECASE if "ILIKE" in op else 0) is not None
        return not hit if op.startswith("NOT") else hit
    return {
        "=": found == wanted,
        "!=": found != wanted,
        "<": found < wanted,
        "<=": found <= wanted,
        ">": found > wanted,
        ">=": found >= wanted,
    }[op]


def _order(text: str) -> tuple[tuple[str, str], bool]:
    match = re.fullmatch(r"\s*(\w+)\.(`[^`]+`|[\w.\-]+)(?:\s+(ASC|DESC))?\s*", text, re.IGNORECASE)
    if match is None:
        raise RequestError(f"cannot read order_by {text[:120]!r}: write <kind>.<key> [ASC|DESC]")
    kind = _KINDS.get(match[1].lower().rstrip("s"))
    if kind is None:
        raise RequestError(f"order_by {text[:120]!r}: the kind is metrics, params, tags or attributes")
    return (kind, match[2].strip("`")), (match[3] or "ASC").upper() == "DESC"


def _sort_key(value: Any) -> tuple[int, Any]:
    """Numbers before text."""
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


# ------------------------------------------------------------ values


def _experiment_id(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def _pairs(values: dict[str, Any]) -> list[dict[str, str]]:
    return [{"key": k, "value": str(v)} for k, v in sorted(values.items())]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 250:
        raise RequestError(f"{what} must be text of 1 to 250 characters, not {str(value)[:80]!r}")
    return value


def _int(value: Any, what: str) -> int:
    """An integer, as a number or (protobuf's JSON writes int64 as text) its text; nothing else."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not (whole or (isinstance(value, str) and value.strip().lstrip("-").isdigit())):
        raise RequestError(f"{what} must be an integer, not {str(value)[:80]!r}")
    return int(value)


def _float(value: Any) -> float:
    try:  # (protobuf's JSON writes NaN and infinities as "NaN", "Infinity", "-Infinity")
        return float(value)
    except (TypeError, ValueError):
        raise RequestError(f"a metric value must be a number, not {str(value)[:80]!r}") from None


def _json_float(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _ms(seconds: float) -> int:
    return 0 if seconds is None or math.isnan(seconds) else int(round(seconds * 1000))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _artifact_path(path: str) -> str:
    """A relative artifact path: no traversal, no absolute paths."""
    parts = [p for p in str(path).split("/") if p]
    if not parts or any(p in (".", "..") or "\\" in p for p in parts):
        raise RequestError(f"{str(path)[:120]!r} is not a relative artifact path")
    return posixpath.join(*parts)
