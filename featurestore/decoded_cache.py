"""A process's decoded copies of stored values that never change (packed blocks, tile summaries),
by content: a hot entity's lookups decode each once. The least recently used go first, and the
copies are bounded by the bytes they hold, not by their count (one block may hold millions of
events). Callers share what ``get`` returns: they read it, never change it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class DecodedCache(Generic[K, V]):
    """Each key decoded once (``decode``: the values of keys, those a lookup lacks together), kept
    while the copies' ``size(key, value)`` sum to at most ``most_bytes`` (a value bigger than that
    is decoded, not kept)."""

    def __init__(self, decode: Callable[[list[K]], list[V]], size: Callable[[K, V], int], most_bytes: int):
        self.decode, self.size, self.most_bytes = decode, size, most_bytes
        self._values: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()  # (servers decode on several threads)
        self.nbytes = 0

    def get(self, key: K) -> V:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[K], keep: bool = True) -> list[V]:
        """Each key's value, in order (one lock for them all: a heavy card's lookup reads ~170
        summaries); ``keep=False``: those not held are decoded, not kept (read once, as a block
        about to be packed again is: kept, they would push out what lookups read)."""
        values = self._values
        with self._lock:
            kept = [values.get(key) for key in keys]
            for key, hit in zip(keys, kept):
                if hit is not None:
                    values.move_to_end(key)
        missing = [i for i, hit in enumerate(kept) if hit is None]
        if missing:
            decoded = self.decode([keys[i] for i in missing])
            sizes = [self.size(keys[i], value) for i, value in zip(missing, decoded)]
            with self._lock:
                for i, value, size in zip(missing, decoded, sizes):
                    kept[i] = (value, size)
                    if keep and size <= self.most_bytes and keys[i] not in values:
                        values[keys[i]] = (value, size)
                        self.nbytes += size
                while self.nbytes > self.most_bytes:
                    _, (_, freed) = values.popitem(last=False)
                    self.nbytes -= freed
        return [hit[0] for hit in kept if hit is not None]

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: K) -> bool:
        return key in self._values

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.nbytes = 0
