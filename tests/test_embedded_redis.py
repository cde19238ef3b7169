"""The embedded redis-server starts, answers PING, keeps data across restarts and stops cleanly."""

import subprocess

import redis

from featurestore.online.embedded import EmbeddedRedis


def _server_pids(socket: str) -> list[str]:
    """redis-server processes on ``socket`` (not their supervisor, whose command line names it too)."""
    out = subprocess.run(["pgrep", "-f", socket], capture_output=True, text=True).stdout
    return [pid for pid in out.split() if "featurestore.online.embedded" not in _cmdline(pid)]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_embedded_redis_lifecycle(tmp_path):
    server = EmbeddedRedis(tmp_path)
    url = server.ensure_running()
    client = redis.Redis.from_url(url)
    assert client.ping()
    client.set("k", "v")
    # a second handle on the same data dir attaches instead of starting another server
    other = EmbeddedRedis(tmp_path)
    assert other.ensure_running() == url and not other.started
    server.stop()  # another user remains: the server stays
    assert client.ping()
    other.stop()  # the last one out stops it
    assert not _server_pids(str(server.socket))
    assert not server.socket.exists()
    # append-only persistence: the value survives a restart
    again = EmbeddedRedis(tmp_path)
    assert redis.Redis.from_url(again.ensure_running()).get("k") == b"v"
    again.stop()
    assert not _server_pids(str(again.socket))


def test_a_start_right_after_a_stop_waits_for_the_old_supervisor(tmp_path):
    """A server stopped and started again at once (the lifecycle test, on a busy machine) failed
    with "did not start": the new supervisor found the old one, not yet exited, holding the
    directory's owner lock, and gave up. It waits for it; here the test holds the lock for it."""
    import fcntl
    import threading

    server = EmbeddedRedis(tmp_path)
    server.data_dir.mkdir(parents=True)
    exiting = open(server.data_dir / "owner.lock", "a")
    fcntl.flock(exiting, fcntl.LOCK_EX)
    threading.Timer(0.5, exiting.close).start()  # the old supervisor exits
    url = server.ensure_running()
    try:
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()


def test_concurrent_starts_share_one_server(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    handles = [EmbeddedRedis(tmp_path) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        urls = list(pool.map(lambda h: h.ensure_running(), handles))
    assert len(set(urls)) == 1
    assert sum(h.started for h in handles) == 1 and len(_server_pids(str(handles[0].socket))) == 1
    for h in handles:
        h.stop()
    assert not _server_pids(str(handles[0].socket))


def test_unreachable_redis_errors_never_show_the_password():
    """Issue #11: 503 bodies and /health echoed REDIS_URL, password included."""
    import pytest

    from featurestore.errors import OnlineStoreUnavailable
    from featurestore.online.base import OnlineStoreSettings, open_online_store

    store = open_online_store(OnlineStoreSettings("p", "redis://:s3cret-pw@127.0.0.1:1/0"))
    with pytest.raises(OnlineStoreUnavailable) as raised:
        store.read([(b"k", ["v"])])
    assert "s3cret-pw" not in str(raised.value) and "***" in str(raised.value)


def test_a_hung_server_is_never_joined_by_a_second_one(tmp_path):
    """Issue #11: after a SIGSTOP the server started a second redis-server on the same AOF directory."""
    import os
    import signal

    import pytest

    from featurestore.errors import OnlineStoreUnavailable

    server = EmbeddedRedis(tmp_path)
    server.ensure_running()
    pid = server.redis_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(OnlineStoreUnavailable, match=f"pid {pid}.*no second one"):
            EmbeddedRedis(tmp_path).ensure_running(timeout=2)
        assert _server_pids(str(server.socket)) == [str(pid)]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert EmbeddedRedis(tmp_path).ensure_running() == server.url  # answers again: attached, not restarted
    server.stop()


def test_sigterm_to_a_cli_command_stops_the_redis_it_started(tmp_path):
    """Issue #11: SIGTERM left the embedded redis-server running, orphaned."""
    import os
    import signal
    import sys
    import time

    from featurestore import FeatureStore
    from featurestore.streaming import GROUP, stream_key

    from .conftest import write_repo
    from .test_streaming import FEATURES

    root = write_repo(tmp_path / "repo", FEATURES)  # embedded Redis: no url
    with FeatureStore(root) as store:
        store.apply()
        stream_name = stream_key(store.config.project, store.definitions.push_source("payments"))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    stream = subprocess.Popen(
        [sys.executable, "-m", "featurestore.cli", "stream", "payments", "--repo", str(root)],
        env=env,
        stdout=subprocess.DEVNULL,
    )  # runs until told to stop
    socket = EmbeddedRedis(root / "data").socket
    deadline = time.time() + 60
    while not _server_pids(str(socket)) and time.time() < deadline and stream.poll() is None:
        time.sleep(0.05)
    assert _server_pids(str(socket)), "the command did not start the embedded Redis"

    def consuming() -> bool:  # (its consumer has read: the command is past its start, a user of the server)
        try:
            groups = redis.Redis(unix_socket_path=str(socket)).xinfo_groups(stream_name)
        except redis.RedisError:
            return False
        return any(g["name"] == GROUP.encode() and g["consumers"] for g in groups)

    while not consuming() and time.time() < deadline and stream.poll() is None:
        time.sleep(0.05)  # (a SIGTERM before it is a user leaves the server to its supervisor's idle stop)
    assert consuming(), "the command did not start consuming"
    stream.send_signal(signal.SIGTERM)
    stream.wait(timeout=30)
    assert not _server_pids(str(socket))


def _wait_gone(socket, seconds: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while _server_pids(str(socket)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _server_pids(str(socket))


def _hold(data_dir, *extra: str) -> subprocess.Popen:
    """Another process using the embedded Redis of ``data_dir`` until killed; prints its URL."""
    import sys

    code = (
        "import sys, time; from featurestore.online.embedded import EmbeddedRedis; "
        f"print(EmbeddedRedis({str(data_dir)!r}).ensure_running(), flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("unix://")
    return process


def test_one_server_per_directory_shared_until_the_last_user_leaves(tmp_path):
    """Issue #11: the replica that started Redis shut it down on exit while other replicas used it
    (6 x 503 on a rolling restart); a kill -9 of the starter left it orphaned or stopped it."""
    import os
    import signal

    first, second = _hold(tmp_path), _hold(tmp_path)
    socket = EmbeddedRedis(tmp_path).socket
    assert len(_server_pids(str(socket))) == 1
    first.kill()  # the starter dies by SIGKILL: no cleanup ran, the other user keeps its server
    first.wait()
    import time

    time.sleep(1.0)  # longer than the supervisor's idle grace
    assert redis.Redis(unix_socket_path=str(socket)).ping()
    second.kill()  # the last user dies too: the supervisor stops the server
    second.wait()
    assert _wait_gone(socket)
    # and a killed supervisor takes its redis-server with it (parent-death signal), never an orphan
    third = _hold(tmp_path)
    supervisor = int(
        subprocess.run(
            ["pgrep", "-f", "featurestore.online.embedded " + str(tmp_path)], capture_output=True, text=True
        ).stdout.split()[0]
    )
    os.kill(supervisor, signal.SIGKILL)
    assert _wait_gone(socket)
    third.kill()
    third.wait()


def test_the_embedded_redis_files_are_private(tmp_path):
    import stat

    server = EmbeddedRedis(tmp_path)
    server.ensure_running()
    redis.Redis.from_url(server.url).set("secret", "v")
    try:
        assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.socket.parent.stat().st_mode) == 0o700
        for f in server.data_dir.rglob("*"):
            if f.is_file() and not f.name.endswith(".lock"):
                assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0, f
    finally:
        server.stop()


def test_a_copied_data_dir_neither_blocks_nor_kills_the_original_server(tmp_path):
    """A data dir copied while its server ran holds that server's pid file: the copy's handle must
    start its own server, and stopping it must leave the original running (it used to kill it)."""
    import shutil

    original = EmbeddedRedis(tmp_path / "a")
    client = redis.Redis.from_url(original.ensure_running())
    client.set("k", "v")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = EmbeddedRedis(tmp_path / "b")
    assert copy.redis_pid() is None  # the pid names a server of another directory
    copy.ensure_running()
    assert copy.started and copy.socket != original.socket
    copy.stop()
    assert client.get("k") == b"v"
    original.stop()
    assert not _server_pids(str(original.socket))
