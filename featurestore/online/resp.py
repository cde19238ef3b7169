"""Redis commands packed in bulk (RESP2), from Arrow arrays, and lookups packed in one buffer.

A write of 1,000 events is one EVALSHA with ~3,000 arguments: redis-py packs them one by one in
Python (about 7 µs per event, as long as Redis takes to run the script); here a long array of
arguments is framed by three Arrow kernels. Short ones are framed in Python: a kernel call
costs ~30 µs however short its input, which a one-event push would feel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from featurestore.online.base import Range

Argument = bytes | str | int
SHORT = 32  # arguments framed in Python below this many


def suffixed(keys: pa.Array, *suffixes: bytes) -> pa.Array:
    """Each key with each suffix, interleaved: ``k0+s0, k0+s1, k1+s0, ...``."""
    n = len(keys)
    if n * len(suffixes) < SHORT:
        return pa.array([k + s for k in keys.to_pylist() for s in suffixes], pa.binary())
    columns = [pc.binary_join_element_wise(keys, s, b"") for s in suffixes]
    order = (np.arange(len(columns))[None, :] * n + np.arange(n)[:, None]).ravel()
    return pa.concat_arrays(columns).take(pa.array(order))


def decimal(values: np.ndarray) -> pa.Array:
    """Integers as decimal text (binary), as Redis takes numbers."""
    if len(values) < SHORT:
        return pa.array([b"%d" % v for v in values.tolist()], pa.binary())
    return pc.cast(pa.array(values), pa.string()).view(pa.binary())


def command(*parts: Argument | pa.Array) -> bytes:
    """One command as RESP bytes; ``parts`` are single arguments or binary Arrow arrays of them."""
    count = sum(len(p) if isinstance(p, pa.Array) else 1 for p in parts)
    chunks = [b"*%d\r\n" % count]
    for part in parts:
        if not isinstance(part, pa.Array):
            chunks.append(_one(part))
        elif len(part) < SHORT:
            chunks += [b"$%d\r\n%b\r\n" % (len(v), v) for v in part.to_pylist()]
        elif len(part):
            chunks.append(_frame(part))
    return b"".join(chunks)


def sliced(
    head: Sequence[Argument],
    keys: pa.Array,
    args: Sequence[Argument],
    per_key: Sequence[pa.Array],
    bounds: Sequence[tuple[int, int]],
) -> list[bytes]:
    """A script call cut into commands, one per row slice ``(start, end)`` in ``bounds``: ``head``,
    the slice's key count, its keys, ``args``, its part of each per-key column. Every value is
    framed once for all slices (a cluster write cuts a call into a piece per master, and framing
    each piece on its own cost ~10 µs a piece when they were per slot). A ``head`` ending in 0
    (``EVALSHA sha 0``) puts the count and keys ahead of the arguments, undeclared (``online.lua``)."""
    columns = [_framed(keys), *(_framed(c) for c in per_key)]
    head_bytes, args_bytes = b"".join(map(_one, head)), b"".join(map(_one, args))
    fixed = len(head) + 1 + len(args)
    out = []
    for start, end in bounds:
        rows = end - start
        parts = [b"*%d\r\n" % (fixed + rows * len(columns)), head_bytes, _one(rows)]
        for k, (framed, offsets) in enumerate(columns):
            parts.append(framed[offsets[start] : offsets[end]])
            if k == 0:
                parts.append(args_bytes)
        out.append(b"".join(parts))
    return out


def whole_hash(key: bytes) -> bytes:
    """An HGETALL of ``key``."""
    return b"*2\r\n$7\r\nHGETALL\r\n$%d\r\n%b\r\n" % (len(key), key)


def _one(value: Argument) -> bytes:
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _frame(values: pa.Array) -> bytes:
    """``$<length>\\r\\n<value>\\r\\n`` for every value, as one buffer."""
    return _framed(values)[0]


def _framed(values: pa.Array) -> tuple[bytes, list[int]]:
    """``_frame``'s buffer, and where each value's frame begins in it (one offset more: the end)."""
    lengths = pc.cast(pc.binary_length(values), pa.string()).view(pa.binary())
    framed = pc.binary_join_element_wise(b"$", lengths, b"\r\n", values, b"\r\n", b"")
    offsets = np.frombuffer(framed.buffers()[1], dtype=np.int32, count=len(framed) + 1, offset=framed.offset * 4)
    return framed.buffers()[2].to_pybytes()[offsets[0] : offsets[-1]], (offsets - offsets[0]).tolist()


def reads(lookups: Sequence[tuple[bytes, Sequence[str]]], ranges: Sequence[Range] = ()) -> list[bytes]:
    """An HMGET per lookup ``(key, fields)``, then a ZRANGEBYSCORE per range ``(key, low, high,
    limit)`` (low exclusive; high may be ``math.inf``), a command each.
    Lookups of one group share their fields list: it is framed once (redis-py frames every argument
    of every command, ~3 µs a command)."""
    framed: dict[int, tuple[bytes, bytes]] = {}
    chunks = []
    for key, fields in lookups:
        frame = framed.get(id(fields))
        if frame is None:
            encoded = [f.encode() for f in fields]
            frame = framed[id(fields)] = (
                b"*%d\r\n$5\r\nHMGET\r\n" % (len(fields) + 2),
                b"".join(b"$%d\r\n%b\r\n" % (len(f), f) for f in encoded),
            )
        chunks.append(b"%b$%d\r\n%b\r\n%b" % (frame[0], len(key), key, frame[1]))
    for key, low, high, limit in ranges:
        bounds = b"(%d" % low, b"+inf" if high == math.inf else b"%d" % high
        tail = (b"$5\r\nLIMIT\r\n$1\r\n0\r\n$%d\r\n%d\r\n" % (len(str(limit)), limit)) if limit is not None else b""
        chunks.append(
            b"*%d\r\n$13\r\nZRANGEBYSCORE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n%b"
            % (7 if limit is not None else 4, len(key), key, len(bounds[0]), bounds[0], len(bounds[1]), bounds[1], tail)
        )
    return chunks
