"""Background jobs for the feature server: materializations run off the request path, one at a time.

``POST /materialize`` with ``Prefer: respond-async`` answers 202 with a job id at once; the work
runs on one worker thread (never the event loop, never two at once in a process; across
processes the per-view history lock keeps writers apart), and ``GET /jobs/{id}`` reports its
state. Such a request for views a queued or running job already covers gets 409 naming that job.
Without the header (Feast's clients, which expect the call to finish) the request waits: for a
job already covering its views, else for its own, and answers with the outcome (``wait``).

The table of jobs is a folder of JSON files (one per job, replaced whole at each change) that
every worker process of the server reads: with ``--workers N`` a status request lands on any
worker, not only the one running the job. Each process holds a lock file while it lives, so a
job whose process died (killed, or stopped before a queued job ran) reads as failed, not as
running forever. The table is bounded: the oldest finished jobs are forgotten first.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from featurestore.errors import ConflictError, FeatureStoreError, NotFoundError
from serving.responses import dumps, error_status

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
    runner: str = ""  # the process that runs it (its lock file's name)
    error_status: int | None = None  # the HTTP status its failure answers with

    @property
    def finished(self) -> bool:
        return self.status in ("succeeded", "failed")

    @property
    def active(self) -> bool:
        return self.status in ("queued", "running")

    def overlaps(self, views: list[str]) -> bool:
        return not self.views or not views or bool(set(self.views) & set(views))


class JobRunner:
    """Runs jobs on one thread and keeps the table in ``folder``, shared by the server's workers."""

    def __init__(self, folder: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featurestore-job")
        self._folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._alive: IO = open(folder / f"runner-{self._name}.lock", "a")  # held while this process lives
        fcntl.flock(self._alive, fcntl.LOCK_EX)
        self._lock = threading.Lock()

    def submit(self, kind: str, views: list[str], work: Callable[[], Any]) -> Job:
        """Queue ``work``; ConflictError if a queued or running job covers any of ``views``."""
        job, busy = self._submit_unless_busy(kind, views, work)
        if busy is not None:
            raise ConflictError(
                f"job {busy.id} ({busy.kind}, {busy.status}) already covers these views; follow it at /jobs/{busy.id}"
            )
        assert job is not None
        return job

    def wait(self, kind: str, views: list[str], work: Callable[[], Any], poll: float = 0.1) -> Job:
        """Run ``work`` as a job and return it finished. A job already running over some of ``views``
        is waited for first; if it was the same kind of job over all of them (or every view), its
        outcome is the answer, else this one runs after it."""
        while True:
            job, busy = self._submit_unless_busy(kind, views, work)
            done = self._finished(job or busy, poll)  # type: ignore[arg-type]
            if job is not None or (done.kind == kind and (not done.views or set(views) <= set(done.views))):
                return done

    def _finished(self, job: Job, poll: float) -> Job:
        while not (current := self.get(job.id)).finished:
            time.sleep(poll)
        return current

    def _submit_unless_busy(
        self, kind: str, views: list[str], work: Callable[[], Any]
    ) -> tuple[Job | None, Job | None]:
        """(the queued job, None), or (None, the active job that covers some of ``views``)."""
        with self._lock, open(self._folder / ".table.lock", "a") as table:  # one submitter at a time, all processes
            fcntl.flock(table, fcntl.LOCK_EX)
            jobs = self.list()
            busy = next((j for j in jobs if j.active and j.overlaps(views)), None)
            if busy is not None:
                return None, busy
            job = Job(uuid.uuid4().hex[:12], kind, list(views), runner=self._name)
            self._save(job)
            self._forget_old(jobs)
        self._pool.submit(self._run, job, work)
        log.info("job %s queued: %s %s", job.id, kind, views or "all views")
        return job, None

    def _run(self, job: Job, work: Callable[[], Any]) -> None:
        job.status, job.started_at = "running", time.time()
        self._save(job)
        try:
            job.result = orjson.loads(dumps(work()))  # as the table will hold it
            job.status = "succeeded"
        except FeatureStoreError as exc:
            job.status, job.error, job.error_status = "failed", str(exc), error_status(exc)
        except Exception as exc:  # noqa: BLE001 - a job's failure is reported, never lost
            job.status, job.error, job.error_status = "failed", f"{type(exc).__name__}: {exc}", 500
            log.error("job %s failed:\n%s", job.id, traceback.format_exc())
        job.finished_at = time.time()
        self._save(job)
        log.info("job %s %s in %.1f s", job.id, job.status, job.finished_at - job.started_at)

    def _save(self, job: Job) -> None:
        staged = self._folder / f".{job.id}.{self._name}.tmp"
        staged.write_bytes(dumps(asdict(job)))
        os.replace(staged, self._folder / f"{job.id}.json")  # readers see the old state or the new, whole

    def _load(self, path: Path) -> Job | None:
        try:
            job = Job(**orjson.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError):  # gone meanwhile (forgotten), or not a job file
            return None
        if job.active and job.runner != self._name and not self._runner_alive(job.runner):
            job.status, job.error_status = "failed", 503
            job.error = "the server process that ran this job exited before it finished; submit it again"
        return job

    def _runner_alive(self, runner: str) -> bool:
        """Whether the process named ``runner`` still holds its lock file."""
        try:
            with open(self._folder / f"runner-{runner}.lock") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def _forget_old(self, jobs: list[Job]) -> None:
        finished = [j for j in jobs if not j.active]
        for job in finished[: max(0, len(jobs) - KEPT_JOBS)]:
            (self._folder / f"{job.id}.json").unlink(missing_ok=True)
        live = {j.runner for j in jobs if j.active}  # dead processes' lock files, once no job names them
        for lock in self._folder.glob("runner-*.lock"):
            runner = lock.name[len("runner-") : -len(".lock")]
            if runner != self._name and runner not in live and not self._runner_alive(runner):
                lock.unlink(missing_ok=True)

    def get(self, job_id: str) -> Job:
        job = self._load(self._folder / f"{job_id}.json") if job_id.isalnum() else None
        if job is None:
            raise NotFoundError(f"no job {job_id!r} (finished jobs are kept for the last {KEPT_JOBS})")
        return job

    def list(self) -> list[Job]:
        """Every job in the table, oldest first."""
        jobs = [job for path in self._folder.glob("*.json") if (job := self._load(path)) is not None]
        return sorted(jobs, key=lambda j: j.submitted_at)

    def describe(self, job: Job) -> dict[str, Any]:
        return {**asdict(job), "status_url": f"/jobs/{job.id}"}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._alive.close()  # releases the lock: jobs still queued here now read as failed
