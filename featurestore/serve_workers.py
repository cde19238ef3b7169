"""Run an ASGI app in N uvicorn worker processes, each accepting on its own listening socket.

uvicorn's ``--workers`` shares one listening socket: every worker wakes for a new connection
and the first one to run accepts the whole queue. Keep-alive clients that connect in a burst
(a connection pool, a load balancer) then land on one worker while the others idle: with 16
clients and 2 workers, one worker took 14 or more of the 16 in about two bursts of three. Here each
worker binds the address with ``SO_REUSEPORT`` and the kernel spreads connections over the
workers' sockets by a hash of each connection's addresses.

The supervisor restarts a worker that dies after it started serving, stops everything if one
fails while starting (a broken app fails the same way every time), and on SIGTERM or SIGINT
lets the workers finish their requests before it exits. SIGHUP replaces the workers one by one,
each new one serving before its predecessor stops (new code, no refused connection). Workers
exit with the supervisor, even if it is killed. Linux only: elsewhere ``SO_REUSEPORT`` does not
balance, and callers fall back to uvicorn's shared socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from featurestore.errors import FeatureStoreError

log = logging.getLogger("featurestore.serve")
SHUTDOWN_GRACE_SECONDS = 30.0
RESTART_DELAY_SECONDS = 1.0  # a worker that keeps dying does not spin the supervisor
_spawn = multiprocessing.get_context("spawn")


def raise_open_files_limit() -> None:
    """Let this process (and the workers it starts) open as many files as the hard limit allows:
    every connection holds one, and at a soft limit of 1,024 (a common default) a burst of
    connections left none for accepting lookups or for Redis."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def supported() -> bool:
    """Whether the kernel balances connections over ``SO_REUSEPORT`` sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _check_port_free(host: str, port: int) -> None:
    """Bind once *without* SO_REUSEPORT: fails if anything listens there, including another
    featurestore server, whose workers a second one must never silently join."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers, as uvicorn does
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise FeatureStoreError(
                f"cannot listen on {host}:{port}: {exc.strerror}; stop what holds the port or choose another --port"
            ) from None


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _worker(config_kwargs: dict[str, Any], ready: Any, supervisor: int) -> None:  # runs in the child process
    with contextlib.suppress(OSError, AttributeError):  # SIGTERM when the supervisor dies, however it dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != supervisor:  # it died before prctl
        return
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

    config = uvicorn.Config(**config_kwargs)
    sock = _listen(config.host, config.port, config.backlog)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass


class _Slot:
    """One worker position: its current process and whether that process started serving."""

    def __init__(self, config_kwargs: dict[str, Any]):
        self.config_kwargs = config_kwargs
        self.restart()

    def _spawn(self) -> tuple[Any, Any]:
        ready = _spawn.Event()
        process = _spawn.Process(target=_worker, args=(self.config_kwargs, ready, os.getpid()))
        process.start()
        return process, ready

    def restart(self) -> None:
        self.process, self.ready = self._spawn()

    def replace(self, timeout: float, stopping: threading.Event) -> bool:
        """Start a successor; once it serves, stop this worker (SIGTERM: its requests finish).
        False, with this worker kept, if the successor does not serve in time or the server stops."""
        process, ready = self._spawn()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1):
            if not process.is_alive() or time.monotonic() > deadline or stopping.is_set():
                _stop(process, grace=0.0)
                return False
        old, self.process, self.ready = self.process, process, ready
        _stop(old, SHUTDOWN_GRACE_SECONDS)
        return True


def _stop(process: Any, grace: float) -> None:
    """SIGTERM (uvicorn finishes in-flight requests), then SIGKILL after ``grace`` seconds."""
    if process.is_alive():
        process.terminate()
    process.join(grace)
    if process.is_alive():
        process.kill()
        process.join()


def serve(app: str, *, workers: int, host: str, port: int, **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` (an import string, as for uvicorn) with ``workers`` processes until SIGTERM/SIGINT.

    Raises FeatureStoreError if the port is taken or a worker fails while starting."""
    if port == 0:
        raise FeatureStoreError("--port 0 picks a different port per worker; give a port, or use --workers 1")
    _check_port_free(host, port)
    config_kwargs = {"app": app, "host": host, "port": port, **uvicorn_kwargs}
    stopping, reloading = threading.Event(), threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: reloading.set())
    slots = [_Slot(config_kwargs) for _ in range(workers)]
    failure = None
    try:
        while not stopping.wait(0.5):
            if reloading.is_set():
                reloading.clear()
                log.warning("SIGHUP: replacing %d worker(s) one by one", len(slots))
                for slot in slots:
                    if not slot.replace(timeout=60.0, stopping=stopping):
                        if not stopping.is_set():
                            log.error("a new worker did not start serving; keeping the old ones")
                        break
            for slot in slots:
                if slot.process.is_alive():
                    continue
                code = slot.process.exitcode
                if not slot.ready.is_set():  # it never served: the app or the address is broken
                    failure = f"a worker failed while starting (exit code {code}); its log above says why"
                    stopping.set()
                    break
                log.warning("worker %s died (exit code %s); starting another", slot.process.pid, code)
                time.sleep(RESTART_DELAY_SECONDS)
                slot.restart()
    finally:
        for slot in slots:
            if slot.process.is_alive():
                slot.process.terminate()  # all at once, then wait for each within one grace period
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        for slot in slots:
            _stop(slot.process, max(0.0, deadline - time.monotonic()))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise FeatureStoreError(failure)
