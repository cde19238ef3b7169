"""The embedded redis-server starts, answers PING, keeps data across restarts and stops cleanly."""

import subprocess

import redis

from featurestore.online.embedded import EmbeddedRedis


def _server_pids(socket: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", socket], capture_output=True, text=True).stdout
    return out.split()


def test_embedded_redis_lifecycle(tmp_path):
    server = EmbeddedRedis(tmp_path)
    url = server.ensure_running()
    client = redis.Redis.from_url(url)
    assert client.ping()
    client.set("k", "v")
    # a second handle on the same data dir attaches instead of starting another server
    other = EmbeddedRedis(tmp_path)
    assert other.ensure_running() == url and other.process is None
    server.stop()
    assert not _server_pids(str(server.socket))
    assert not server.socket.exists()
    # append-only persistence: the value survives a restart
    again = EmbeddedRedis(tmp_path)
    assert redis.Redis.from_url(again.ensure_running()).get("k") == b"v"
    again.stop()
    assert not _server_pids(str(again.socket))


def test_concurrent_starts_share_one_server(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    handles = [EmbeddedRedis(tmp_path) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        urls = list(pool.map(lambda h: h.ensure_running(), handles))
    assert len(set(urls)) == 1
    owners = [h for h in handles if h.process is not None]
    assert len(owners) == 1
    owners[0].stop()
    assert not _server_pids(str(owners[0].socket))


def test_unreachable_redis_errors_never_show_the_password():
    """Issue #11: 503 bodies and /health echoed REDIS_URL, password included."""
    import pytest

    from featurestore.errors import OnlineStoreUnavailable
    from featurestore.online.redis_store import RedisOnlineStore

    store = RedisOnlineStore("redis://:s3cret-pw@127.0.0.1:1/0", "p")
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
    pid = server.process.pid
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

    from .conftest import write_repo

    from featurestore import FeatureStore

    from .test_streaming import FEATURES

    root = write_repo(tmp_path / "repo", FEATURES)  # embedded Redis: no url
    FeatureStore(root).apply()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    stream = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "stream", "payments", "--repo", str(root)], env=env,
                              stdout=subprocess.DEVNULL)  # runs until told to stop
    socket = EmbeddedRedis(root / "data").socket
    deadline = time.time() + 60
    while not _server_pids(str(socket)) and time.time() < deadline and stream.poll() is None:
        time.sleep(0.05)
    assert _server_pids(str(socket)), "the command did not start the embedded Redis"
    time.sleep(1.0)  # consuming
    stream.send_signal(signal.SIGTERM)
    stream.wait(timeout=30)
    time.sleep(0.5)
    assert not _server_pids(str(socket))
