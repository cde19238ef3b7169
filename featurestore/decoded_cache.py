"""A process's decoded copies of stored values that never change (packed blocks, tile summaries),
by content: a hot entity's lookups decode each once. The least recently used go first, and the
copies are bounded by the bytes they hold, not by their count (one block may hold millions of
events). Callers share what ``get`` returns: they read it, never change it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class DecodedCache(Generic[K, V]):
    """``decode(key)`` once per key, kept while the copies' ``size(key, value)`` sum to at most
    ``most_bytes`` (a value bigger than that is decoded, not kept)."""

    def __init__(self, decode: Callable[[K], V], size: Callable[[K, V], int], most_bytes: int):
        self.decode, self.size, self.most_bytes = decode, size, most_bytes
        self._values: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()  # (servers decode on several threads)
        self.nbytes = 0

    def get(self, key: K) -> V:
        with self._lock:
            hit = self._values.get(key)
            if hit is not None:
                self._values.move_to_end(key)
                return hit[0]
        value = self.decode(key)
        size = self.size(key, value)
        if size > self.most_bytes:
            return value
        with self._lock:
            if key not in self._values:
                self._values[key] = (value, size)
                self.nbytes += size
            while self.nbytes > self.most_bytes:
                _, (_, freed) = self._values.popitem(last=False)
                self.nbytes -= freed
        return value

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.nbytes = 0
