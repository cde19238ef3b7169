"""A local Redis Cluster from the ``redis-server`` the project ships: for tests, benchmarks and
trying the cluster store on one machine (``python -m featurestore.online.local_cluster DIR``)."""

from __future__ import annotations

import functools
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from featurestore.online.embedded import COMPACT_ENCODINGS, redis_server_binary


def start_local_cluster(
    folder: Path,
    masters: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 1000,
    password: str | None = None,
    announce: dict[int, int] | None = None,
) -> dict[int, subprocess.Popen]:
    """Start ``masters × (1 + replicas)`` nodes under ``folder`` and join them; returns {port: process}.
    No persistence: a test or benchmark cluster. Stop it with ``stop_local_cluster``. With
    ``password``, every node requires it (``requirepass``; ``masterauth`` for its replicas). With
    ``announce`` (its ports, as ``free_ports`` gives them -> others), each node tells clients to
    reach it on the other port (behind a proxy)."""
    secret = ["--requirepass", password, "--masterauth", password] if password else []
    server = Path(redis_server_binary())
    cli = server.with_name("redis-cli")
    ports = list(announce) if announce else free_ports(masters * (1 + replicas))
    procs = {}
    for port in ports:
        announced = (
            ["--cluster-announce-port", str(announce[port]), "--cluster-announce-bus-port", str(port + 10000)]
            if announce
            else []
        )
        (folder / str(port)).mkdir(parents=True, exist_ok=True)
        procs[port] = subprocess.Popen(
            [
                str(server),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--dir",
                str(folder / str(port)),
                "--save",
                "",
                "--appendonly",
                "no",
                "--cluster-replica-validity-factor",
                "0",
                *COMPACT_ENCODINGS,
                *secret,
                *announced,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        for port in ports:
            wait_until(functools.partial(_ping, port, password))
        subprocess.run(
            [
                str(cli),
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
                *(["-a", password, "--no-auth-warning"] if password else []),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        # "create" returns before every node has heard which nodes are replicas: until then some see six masters
        wait_until(lambda: all(_settled(port, masters, replicas, password) for port in ports))
    except BaseException:
        stop_local_cluster(procs)
        raise
    return procs


def stop_local_cluster(procs: dict[int, subprocess.Popen]) -> None:
    for proc in procs.values():
        proc.kill()
        proc.wait()


def free_ports(n: int) -> list[int]:
    """Ports free together with their cluster-bus port (+10000, so below 55536)."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 40000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        if port not in ports:
            ports.append(port)
    return ports


def _settled(port: int, masters: int, replicas: int, password: str | None) -> bool:
    """This node's cluster is ok and it sees ``masters`` healthy masters and their replicas, each replica linked."""
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    if client.cluster("info")["cluster_state"] != "ok":
        return False
    healthy = [node["flags"].split(",") for node in client.cluster("nodes").values() if "fail" not in node["flags"]]
    role = client.execute_command("ROLE")
    linked = role[0] == b"master" or role[3] == b"connected"
    return (
        linked
        and sum("master" in r for r in healthy) == masters
        and sum("slave" in r for r in healthy) == masters * replicas
    )


def _ping(port: int, password: str | None) -> bool:
    return bool(redis.Redis(host="127.0.0.1", port=port, password=password).ping())


def wait_until(check: Callable[[], object], seconds: float = 30, errors: tuple[type[BaseException], ...] = ()) -> None:
    """Call ``check`` until it returns true (connection errors, and ``errors``, count as not yet)."""
    caught: tuple[type[BaseException], ...] = (redis.RedisError, OSError, KeyError, *errors)
    deadline = time.time() + seconds
    while True:
        try:
            if check():
                return
        except caught:
            pass
        if time.time() > deadline:
            raise TimeoutError("the local Redis Cluster did not come up in time")
        time.sleep(0.1)


if __name__ == "__main__":
    procs = start_local_cluster(Path(sys.argv[1] if len(sys.argv) > 1 else "redis-cluster"))
    print("online_store: {type: redis_cluster, nodes: [" + ", ".join(f"'127.0.0.1:{p}'" for p in procs) + "]}")
    print("Ctrl-C stops it")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop_local_cluster(procs)
