"""Run an ASGI app in N uvicorn worker processes, each accepting on its own listening socket.

uvicorn's ``--workers`` shares one listening socket: every worker wakes for a new connection
and the first one to run accepts the whole queue. Keep-alive clients that connect in a burst
(a connection pool, a load balancer) then all land on one worker and the others idle; with
16 clients and 2 workers, 16 of 16 connections went to one worker in every trial. Here each
worker binds the address with ``SO_REUSEPORT`` and the kernel spreads connections over the
workers' sockets by a hash of each connection's addresses.

The supervisor restarts a worker that dies after it started serving, stops everything if one
fails while starting (a broken app fails the same way every time), and on SIGTERM or SIGINT
lets the workers finish their requests before it exits. Linux only: elsewhere
``SO_REUSEPORT`` does not balance, and callers fall back to uvicorn's shared socket.
"""

from __future__ import annotations

import logging
import multiprocessing
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
            raise FeatureStoreError(f"cannot listen on {host}:{port}: {exc.strerror}; stop what holds the port "
                                    "or choose another --port") from None


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def _worker(config_kwargs: dict[str, Any], ready: Any) -> None:  # runs in the child process
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
        self.start()

    def start(self) -> None:
        self.ready = _spawn.Event()
        self.process = _spawn.Process(target=_worker, args=(self.config_kwargs, self.ready), daemon=False)
        self.process.start()


def serve(app: str, *, workers: int, host: str, port: int, **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` (an import string, as for uvicorn) with ``workers`` processes until SIGTERM/SIGINT.

    Raises FeatureStoreError if the port is taken or a worker fails while starting."""
    if port == 0:
        raise FeatureStoreError("--port 0 picks a different port per worker; give a port, or use --workers 1")
    _check_port_free(host, port)
    config_kwargs = {"app": app, "host": host, "port": port, **uvicorn_kwargs}
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    slots = [_Slot(config_kwargs) for _ in range(workers)]
    failure = None
    try:
        while not stopping.wait(0.5):
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
                slot.start()
    finally:
        for slot in slots:
            if slot.process.is_alive():
                slot.process.terminate()  # SIGTERM: uvicorn finishes in-flight requests, then exits
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        for slot in slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                slot.process.kill()
                slot.process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise FeatureStoreError(failure)
