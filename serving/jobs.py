"""Background jobs for the feature server: materializations run off the request path, one at a time.

``POST /materialize`` answers 202 with a job id at once; the work runs on one worker thread
(never the event loop, never two at once in a process; across processes the per-view history
lock keeps writers apart), and ``GET /jobs/{id}`` reports its state. A request for views a
queued or running job already covers gets 409 naming that job. The table of jobs is bounded:
the oldest finished ones are forgotten first.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from featurestore.errors import ConflictError, FeatureStoreError, NotFoundError

log = logging.getLogger("featurestore.jobs")
KEPT_JOBS = 200


@dataclass
class Job:
    id: str
    kind: str
    views: list[str]  # empty: every view
    status: str = "queued"  # queued, running, succeeded, failed
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    result: Any = None
    error: str | None = None

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")

    def overlaps(self, views: list[str]) -> bool:
        return not self.views or not views or bool(set(self.views) & set(views))


class JobRunner:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featurestore-job")
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def submit(self, kind: str, views: list[str], work: Callable[[], Any]) -> Job:
        with self._lock:
            busy = next((j for j in self._jobs.values() if j.active and j.overlaps(views)), None)
            if busy is not None:
                raise ConflictError(f"job {busy.id} ({busy.kind}, {busy.status}) already covers these views; "
                                    f"follow it at /jobs/{busy.id}")
            job = Job(uuid.uuid4().hex[:12], kind, list(views))
            self._jobs[job.id] = job
            self._forget_old()
        self._pool.submit(self._run, job, work)
        log.info("job %s queued: %s %s", job.id, kind, views or "all views")
        return job

    def _run(self, job: Job, work: Callable[[], Any]) -> None:
        job.status, job.started_at = "running", time.time()
        try:
            job.result = work()
            job.status = "succeeded"
        except FeatureStoreError as exc:
            job.status, job.error = "failed", str(exc)
        except Exception as exc:  # noqa: BLE001 - a job's failure is reported, never lost
            job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("job %s failed:\n%s", job.id, traceback.format_exc())
        job.finished_at = time.time()
        log.info("job %s %s in %.1f s", job.id, job.status, job.finished_at - job.started_at)

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if not j.active]
        for job in finished[: max(0, len(self._jobs) - KEPT_JOBS)]:
            del self._jobs[job.id]

    def get(self, job_id: str) -> Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise NotFoundError(f"no job {job_id!r} (finished jobs are kept for the last {KEPT_JOBS})") from None

    def list(self) -> list[Job]:
        return list(self._jobs.values())

    def describe(self, job: Job) -> dict[str, Any]:
        return {**asdict(job), "status_url": f"/jobs/{job.id}"}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
