"""Lookups on the event loop, batched: the lookups of one loop turn share one write and one read.

``ReadConnections`` is a pool without redis-py's per-checkout bookkeeping; ``BatchedReads``
sends a turn's lookups together (ioredis calls it auto-pipelining) and times batches out with
one watchdog timer for all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis

MAX_ASYNC_READS = 256  # batches of lookups in flight (connections in use) per server process


class ReadConnections:
    """Connections for lookups, reused newest first: a pool without redis-py's per-checkout
    bookkeeping (~10 µs a lookup). At most ``keep`` wait idle; ``make`` opens one lazily."""

    def __init__(self, make: Callable[[], Any], keep: int = 64):
        self.make, self.keep = make, keep
        self._idle: list = []

    def take(self) -> Any:
        try:
            return self._idle.pop()
        except IndexError:
            return self.make()

    def give_back(self, connection: Any) -> bool:
        """Keep ``connection`` for the next lookup; False when enough are kept (close it)."""
        if len(self._idle) >= self.keep:
            return False
        self._idle.append(connection)
        return True

    def drain(self) -> list:
        """Every idle connection, forgotten (to close)."""
        idle, self._idle = self._idle, []
        return idle


class BatchedReads:
    """Lookups made in one turn of the event loop go to Redis together: one write and one read on
    one connection for all of them, replies handed back in order (ioredis calls it
    auto-pipelining). Under concurrent requests the server and Redis then wake once per batch,
    not once per lookup. The first lookup of a turn yields once, then sends the batch and hands
    the others their replies. At most ``MAX_ASYNC_READS`` batches are in flight (connections in
    use); a batch fails after ``timeout`` to 1.25x ``timeout`` seconds (TimeoutError: an OSError)."""

    Batch = list[
        tuple[bytes, int, "asyncio.Future | None"]
    ]  # (commands, reply count, joiner's future; None: the sender's)

    def __init__(self, readers: ReadConnections, timeout: float):
        self.readers, self.timeout = readers, timeout
        self._pending: BatchedReads.Batch | None = None
        self._slots = asyncio.Semaphore(MAX_ASYNC_READS)
        self._deadlines: dict[asyncio.Task, float] = {}  # sending tasks -> loop time they time out at
        self._expired: set[asyncio.Task] = set()  # those the watchdog cancelled
        self._watching = False

    async def read(self, packed: bytes, count: int) -> list:
        """The ``count`` replies to the commands in ``packed``."""
        if self._pending is not None:  # a batch is forming: join it
            future = asyncio.get_running_loop().create_future()
            self._pending.append((packed, count, future))
            return await future
        batch: BatchedReads.Batch = [(packed, count, None)]
        self._pending = batch
        try:
            await asyncio.sleep(0)  # the lookups of this turn join
        except BaseException:  # cancelled before sending: the joiners retry
            _fail(batch, redis.ConnectionError("the batch's sender was cancelled"))
            raise
        finally:
            self._pending = None
        return await self._exchange(batch)

    async def _exchange(self, batch: BatchedReads.Batch) -> list:
        """Send ``batch``; resolve every joiner's future, whatever happens; return the sender's replies."""
        own: list = []
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self._deadlines[task] = loop.time() + self.timeout
        if not self._watching:
            self._watching = True
            loop.call_later(self.timeout / 4, self._watch, loop)
        try:
            async with self._slots:
                connection = self.readers.take()
                try:
                    if not connection.is_connected:  # (as a pool does: a Sentinel-managed one asks for the master)
                        await connection.connect()
                    await connection.send_packed_command([packed for packed, _, _ in batch], check_health=False)
                    for _, count, future in batch:
                        replies = []
                        for _ in range(count):
                            try:
                                replies.append(await connection.read_response())
                            except redis.ResponseError as exc:  # that lookup's error; the replies after it still come
                                replies.append(exc)
                        if future is None:
                            own = replies
                        elif not future.done():  # (its caller may have gone)
                            _settle(future, replies)
                except BaseException:
                    await connection.disconnect()  # replies may be left unread: never reuse it
                    raise
                if not self.readers.give_back(connection):
                    await connection.disconnect()
        except asyncio.CancelledError:
            del self._deadlines[task]  # (the watchdog must not cancel the clean-up)
            if task not in self._expired:  # the caller's cancellation: a joiner retries once on a ConnectionError
                await self._abandon(batch, redis.ConnectionError("the batch's sender was cancelled"))
                raise
            self._expired.discard(task)  # the watchdog's: a timeout (an OSError), for the sender and its joiners
            task.uncancel()
            timeout = TimeoutError(f"Redis did not answer within {self.timeout:g} s")
            await self._abandon(batch, timeout)
            raise timeout from None
        except BaseException as exc:
            del self._deadlines[task]
            await self._abandon(
                batch, exc if isinstance(exc, Exception) else redis.ConnectionError("the batch's sender was stopped")
            )
            raise
        self._deadlines.pop(task)
        error = _first_error(own)
        if error is not None:
            raise error
        return own

    async def _abandon(self, batch: BatchedReads.Batch, error: Exception) -> None:
        for idle in self.readers.drain():  # connected to the same server: as stale
            await idle.disconnect()
        _fail(batch, error)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel the batches past their deadline. One timer for all batches in flight (an
        ``asyncio.timeout`` per batch cost ~4 µs of a lookup's ~80): a batch times out within
        1.25x ``timeout``."""
        now = loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        if self._deadlines:
            loop.call_later(self.timeout / 4, self._watch, loop)
        else:
            self._watching = False


def _fail(batch: BatchedReads.Batch, error: Exception) -> None:
    for _, _, future in batch:
        if future is not None and not future.done():
            future.set_exception(error)


def _first_error(replies: list) -> Exception | None:
    """A lookup's first error reply (its other replies are then of no use)."""
    return next((r for r in replies if isinstance(r, Exception)), None)


def _settle(future: asyncio.Future, replies: list) -> None:
    error = _first_error(replies)
    if error is None:
        future.set_result(replies)
    else:
        future.set_exception(error)
