"""Who takes part in a version's broadcast, and the process group each broadcast runs on.

The source (a checkpoint engine serving the trainer's registry) keeps a **seat** for every member
that asked to join (an inference replica, over the engine's HTTP route, behind the servers' API
keys: nobody else learns where the group meets). When a version is promoted, the source waits a
moment for every member it has seen to be seated, hands each a rank and the round's address,
and broadcasts (``featurestore.weight_broadcast``) over a gloo group made for that round alone:
a TCP store on an ephemeral port, its keys under a random 128-bit prefix that only the seated
members were told. Members on the source's machine (``shared_tensors.machine_id``) read the
buckets from shared memory the source fills instead (``transport="auto"``, the default; "shared"
or "network" to insist). Every collective has the round's timeout, so a member that dies or stops
mid-broadcast fails the round within it instead of hanging the others; nobody takes a failed
round's weights, the members still alive sit down again, and the round is run again without the
one that left. A member that missed a version (down, late, restarted) catches up through the
file path (``featurestore.checkpoint_engine``: peers, the object store), never by holding up a
broadcast.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from featurestore.errors import FeatureStoreError
from featurestore.shared_tensors import machine_id
from featurestore.weight_broadcast import BUCKET_BYTES, BroadcastFailed, Group, receive, send, staging, stream_bytes

log = logging.getLogger("featurestore.broadcast")

JOIN_SECONDS = 20.0  # a seat is held this long per call; members call again at once
SEEN_SECONDS = JOIN_SECONDS + 10.0  # a member not heard from for longer is no longer waited for
Transport = Literal["auto", "shared", "network"]  # auto: shared memory when every member is on the source's machine


@dataclass(frozen=True)
class Round:
    """One broadcast as a member is told it: where the group meets and under which secret prefix."""

    id: str
    host: str
    port: int
    rank: int
    world: int
    model: str
    version: int
    timeout: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Round:
        try:
            round_ = cls(**{f: body[f] for f in cls.__dataclass_fields__})
        except (KeyError, TypeError) as exc:
            raise FeatureStoreError(f"the source answered a round without {exc}") from None
        if not (0 < round_.rank < round_.world and 0 < round_.port < 65536 and round_.timeout > 0):
            raise FeatureStoreError(f"the source answered an impossible round {round_.to_json()}")
        return round_


def open_group(store: dist.Store, round_: Round, host: str) -> Group:
    """The round's gloo group (no default group: a trainer's own stays as it is), meeting under
    the round's prefix; ``host``: the address of this side's interface the others reach."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (its only name in torch)
    options._timeout = timedelta(seconds=round_.timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    group = dist.ProcessGroupGloo(dist.PrefixStore(round_.id, store), round_.rank, round_.world, options)
    return cast(Group, group)  # (torch's stub of a backend omits the collectives it has)


@dataclass
class _Seat:
    stage: str
    since: float
    round: Round | None = None
    wake: Callable[[], object] | None = None
    taken: bool = False  # placed in a round (whose address follows at once)
    machine: str | None = None  # the member's machine_id, when it said


@dataclass(frozen=True)
class Outcome:
    """What one version's broadcast came to: the members that took it, the failed attempts, the
    seconds in all and those the last attempt spent forming its group (before any byte was sent),
    and how the buckets went (over the group, or through shared memory)."""

    members: list[str]
    attempts: int
    seconds: float
    group_seconds: float = 0.0
    transport: str = "network"


class Coordinator:
    """The source's side: seats for members, and one broadcast per promoted version."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        gather_seconds: float = 2.0,
        timeout_seconds: float = 30.0,
        attempts: int = 3,
        bucket_bytes: int = BUCKET_BYTES,
        transport: Transport = "auto",
    ):
        self.host, self.gather_seconds, self.timeout_seconds = host, gather_seconds, timeout_seconds
        self.attempts, self.bucket_bytes, self.transport = attempts, bucket_bytes, transport
        self.machine = machine_id()
        self._lock = threading.Condition()
        self._seats: dict[str, _Seat] = {}
        self._seen: dict[str, tuple[float, str]] = {}  # member -> (last heard, stage)
        self.tamper: Callable[[int, torch.Tensor], None] | None = None  # fault injection (weight_broadcast.send)

    async def join(
        self, member: str, stage: str, timeout: float = JOIN_SECONDS, machine: str | None = None
    ) -> Round | None:
        """Hold ``member``'s seat until a broadcast places it (its round) or ``timeout`` passes (None);
        ``machine``: the member's ``machine_id`` (shared memory for members on this one)."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        seat = _Seat(stage, time.monotonic(), wake=lambda: loop.call_soon_threadsafe(woken.set), machine=machine)
        with self._lock:
            self._seats[member] = seat  # a member's newer call replaces its older one
            self._seen[member] = (seat.since, stage)
            self._lock.notify_all()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout)
        finally:  # (a member that hung up is cancelled here: its seat goes with it)
            with self._lock:
                if self._seats.get(member) is seat:
                    del self._seats[member]
                self._seen[member] = (time.monotonic(), stage)
        if seat.taken and seat.round is None:  # placed just as its time ran out: the address is coming
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), self.timeout_seconds)
        return seat.round

    def broadcast(self, model: str, stage: str, version: int, state: Mapping[str, torch.Tensor], meta: dict) -> Outcome:
        """Send ``state`` to the members following ``stage``, again without any that fail, up to
        ``attempts`` times; returns who took it."""
        started = time.monotonic()
        with self._lock:
            expected = {m for m, (at, s) in self._seen.items() if s == stage and started - at < SEEN_SECONDS}
        for attempt in range(1, self.attempts + 1):
            # after a failed attempt the members still alive sit down again once they notice it,
            # which takes them up to the round's timeout
            window = self.gather_seconds + (self.timeout_seconds if attempt > 1 else 0)
            seated = self._gather(stage, expected, window)
            if not seated:
                log.info("%s v%s: no member is waiting; replicas catch up from the files", model, version)
                return Outcome([], attempt - 1, time.monotonic() - started)
            shared = self.transport == "shared" or (
                self.transport == "auto" and all(seat.machine == self.machine for seat in seated.values())
            )
            try:
                group_seconds = self._run(model, version, seated, state, meta, shared)
            except (BroadcastFailed, RuntimeError, dist.DistError) as exc:
                log.warning("%s v%s: broadcast attempt %d to %d failed (%s)", model, version, attempt, len(seated), exc)
                expected = set(seated)  # those still alive sit down again; the round goes on without the rest
                continue
            seconds = time.monotonic() - started
            transport = "shared" if shared else "network"
            log.info("%s v%s broadcast to %d members in %.2f s (%s)", model, version, len(seated), seconds, transport)
            return Outcome(sorted(seated), attempt - 1, seconds, group_seconds, transport)
        raise BroadcastFailed(f"{model} v{version}: {self.attempts} broadcast attempts failed; replicas keep theirs")

    def _gather(self, stage: str, expected: set[str], window: float) -> dict[str, _Seat]:
        """The seated members of ``stage``, once every expected one sits or ``window`` seconds pass."""
        deadline = time.monotonic() + window
        with self._lock:
            while True:
                here = {m for m, seat in self._seats.items() if seat.stage == stage}
                left = deadline - time.monotonic()
                if expected <= here or left <= 0:
                    seated = {m: self._seats.pop(m) for m in here}
                    for seat in seated.values():
                        seat.taken = True
                    return seated
                self._lock.wait(left)

    def _run(
        self,
        model: str,
        version: int,
        seated: dict[str, _Seat],
        state: Mapping[str, torch.Tensor],
        meta: dict,
        shared: bool,
    ) -> float:
        """One attempt; returns the seconds spent forming the group."""
        started = time.monotonic()
        world = len(seated) + 1
        store = dist.TCPStore(
            self.host, 0, world, is_master=True, timeout=timedelta(seconds=self.timeout_seconds), wait_for_workers=False
        )
        round_id = secrets.token_hex(16)
        for rank, (_, seat) in enumerate(sorted(seated.items()), start=1):
            seat.round = Round(round_id, self.host, store.port, rank, world, model, version, self.timeout_seconds)
            assert seat.wake is not None
            seat.wake()
        own = Round(round_id, self.host, store.port, 0, world, model, version, self.timeout_seconds)
        group = open_group(store, own, self.host)
        formed = time.monotonic() - started
        send(state, group, bucket_bytes=self.bucket_bytes, shared=shared, meta=meta, tamper=self.tamper)
        return formed


class Member:
    """A replica's side: asks the source for a seat, again and again, and hands every version it
    receives intact to ``take`` (version, tensors viewing the received buckets, the source's meta).

    It keeps one model's worth of **staging** memory (``stage_bytes`` at first, then the last
    version's size), written through once beside its seat, never delaying it: a round receives
    into it (see ``weight_broadcast``), the new weights keep it, and the next is staged."""

    def __init__(
        self,
        join: Callable[[], Mapping[str, Any] | None],
        take: Callable[[int, dict[str, torch.Tensor], dict], None],
        host: str = "127.0.0.1",
        stage_bytes: int = 0,
    ):
        self.join, self.take, self.host = join, take, host
        self._staged: torch.Tensor | None = None
        self._staging_lock = threading.Lock()
        self._stage(stage_bytes)

    def _stage(self, nbytes: int) -> None:
        def run() -> None:
            buffer = staging(nbytes)
            with self._staging_lock:
                if self._staged is None or self._staged.numel() < nbytes:
                    self._staged = buffer

        if nbytes:
            threading.Thread(target=run, name="broadcast-staging", daemon=True).start()

    def receive_once(self) -> int | None:
        """Wait for one seat; the version received and taken, or None when no round came."""
        answer = self.join()
        if answer is None:
            return None
        round_ = Round.from_json(answer)
        store = dist.TCPStore(round_.host, round_.port, is_master=False, timeout=timedelta(seconds=round_.timeout))
        group = open_group(store, round_, self.host)
        log.info("%s v%s: receiving (rank %d of %d)", round_.model, round_.version, round_.rank, round_.world)
        with self._staging_lock:
            staged, self._staged = self._staged, None
        try:
            tensors, meta = receive(group, into=staged)
        except BaseException:
            with self._staging_lock:  # (nobody holds it: it serves the next round)
                if self._staged is None:
                    self._staged = staged
            raise
        self.take(round_.version, tensors, meta)
        self._stage(stream_bytes(tensors))  # (after the flip and install, which share the cores with requests)
        return round_.version

    def run_forever(self, stop: threading.Event, on_error: Callable[[Exception], None] | None = None) -> None:
        """Take seats until ``stop`` is set; a failed round or an unreachable source backs off and retries."""
        # requests first: this thread (and the gloo threads it starts, which inherit it) yields the
        # cores to the server's own while a round is received and installed (Linux: per thread)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        delay = 0.2
        while not stop.is_set():
            try:
                self.receive_once()
                delay = 0.2
            except Exception as exc:  # noqa: BLE001 - a failed round leaves the current weights serving
                log.warning("broadcast not taken (%s); joining again in %.1f s", exc, delay)
                if on_error is not None:
                    on_error(exc)
                stop.wait(delay)
                delay = min(delay * 2, 5.0)
