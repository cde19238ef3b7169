"""Packed blocks: the ended tiles of an entity's events, compressed into one sorted-set member.

Online, an aggregated view's events are sorted-set members (``codec``): ~200 bytes each in
Redis, most of it Redis's own bookkeeping per member. Tiles are grouped in blocks of
``BLOCK_TILES``; once some of a block's tiles have ended, a writer that holds all their events
(``PACK_FROM`` or more) replaces them with one member, a block (``pack``), scored at the start of
the block's first tile, so a range read that reaches any of its tiles returns it
(``block_range``); as more of its tiles end it is packed again with their events. A block holds
exactly the members it replaced: ``unpack`` gives them back byte for byte, so everything
downstream of a read is unchanged. Inside:

- a directory of the events' ids and µs, sorted by id (``directory``): it is also the record the
  duplicate rule reads (``scripts/_blocks.lua``), so an id is stored once; the rows of the other
  sections are its entries in (µs, id) order;
- integers and timestamps: frame-of-reference bit packing of the values or of their deltas,
  whichever is smaller, divided by their common factor;
- floats: as decimals (``v == k / 10**e`` exactly, for the smallest such ``e``) bit-packed, else
  XOR with the previous value's bits keeping the bytes between its leading and trailing zero
  bytes (Gorilla's idea, bytewise), else raw: NaN payloads, ±inf and -0.0 round-trip exactly;
- booleans one bit each; strings and bytes dictionary-encoded when values repeat;
- null bitmaps only when some value is null.

Layout: ``BLOCK_MARK`` (16 bytes: an event's bytes 8–16 are its µs, never all ones), version,
block number (int64), which of its tiles hold events (uint32, bit i for tile i), the width of a
count (1 or 2 bytes), the events of each tile holding some (read by ``seal_tiles.lua``), the
directory (read by ``add_events.lua``), then the other sections, which Redis never decodes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from featurestore.decoded_cache import DecodedCache
from featurestore.online.codec import variable_width
from featurestore.types import DType

BLOCK_TILES = 32
MOST_PER_TILE = 65_535  # events of one tile a block counts (uint16): a tile with more stays plain
PACK_FROM = 16  # events a block needs before it takes less memory than they do (~200 bytes a member)
COMPACT_SETS_FROM = 1024  # a Redis value limit for compact sorted sets at which small blocks pay (``pack_from``)
SPARSE_PACK_FROM = 2  # events a block needs in a sorted set past its compact encoding (``pack_from``)
BLOCK_MARK = b"\x00" * 8 + b"\xff" * 8
_MARK_TIME = BLOCK_MARK[8:]  # (where an event has its µs)
_VERSION = 4
_HEAD = struct.Struct(">16sBqIB")  # then the counts of the tiles holding events (``_header``)
_FIXED = {"Int32": ">i4", "Int64": ">i8", "Float32": ">f4", "Float64": ">f8", "UnixTimestamp": ">i8", "Bool": "u1"}
_U64 = np.uint64
SMALL = 32  # values up to which bit-unpacking runs in Python
FEW_BLOCKS = 8  # blocks below which ``pack_many`` and ``_decode_many`` go a block at a time (cheaper then)
BIT_ROWS_MOST = 512  # values up to which it spreads bits into rows (fewer numpy calls), past it shifts words
DECODED_BLOCK_BYTES = 256 << 20  # what a process's decoded blocks may hold (blocks, head records, values)


def pack_from(zset_value_limit: int) -> int:
    """Events a block needs, given Redis's ``zset-max-listpack-value``: a sorted set holding a
    member longer than that leaves its compact encoding for one costing ~100 bytes more a member,
    so with the default (64) a block pays from ``PACK_FROM`` events; from ``COMPACT_SETS_FROM``
    (the embedded server's setting) small blocks stay compact and half as many pay. (Fewer would
    save more still, but a light entity's lookup would then decode a block for its few events.)
    A set holding a longer member (a block) has left the compact encoding for good: there a plain
    member costs ~150 bytes, and a block pays from ``SPARSE_PACK_FROM`` events."""
    return PACK_FROM if zset_value_limit < COMPACT_SETS_FROM else max(1, PACK_FROM // 2)


def is_block(member: bytes) -> bool:
    return member[8:16] == _MARK_TIME


def tile_of(member: bytes, tile_us: int) -> int:
    """The tile (or, by a block's span, the block) of a plain event: its µs are its bytes 9-16, sign-flipped big-endian."""
    return (int.from_bytes(member[8:16], "big") - (1 << 63)) // tile_us


def block_range(low_us: int, high_us: int, tile_us: int) -> tuple[int, int]:
    """The scores a range read of events in ``(low_us, high_us]`` asks for (exclusive low,
    inclusive high) so that it also returns the blocks holding any of them: a block is scored at
    the start of its first tile, up to a block before its last event."""
    return low_us + 1 - BLOCK_TILES * tile_us, high_us


def header(blob: bytes) -> tuple[int, list[int]]:
    """A block's number and the events of each of its tiles."""
    _, number, tiles, held_counts, _ = _header(blob)
    counts = [0] * BLOCK_TILES
    for tile, count in zip(tiles, held_counts):
        counts[tile] = count
    return number, counts


def _header(blob: bytes) -> tuple[int, int, list[int], tuple[int, ...], int]:
    """A block's version, number, tiles holding events, their events, and where its sections start."""
    _, version, number, held, width = _HEAD.unpack_from(blob)
    tiles, layout = _held_tiles(held, width)
    return version, number, tiles, layout.unpack_from(blob, _HEAD.size), _HEAD.size + layout.size


@functools.lru_cache(maxsize=4096)
def _held_tiles(held: int, width: int) -> tuple[list[int], struct.Struct]:
    """The tiles a header's map names, and the layout of their counts."""
    tiles = [i for i in range(BLOCK_TILES) if held >> i & 1]
    return tiles, struct.Struct(f">{len(tiles)}{'B' if width == 1 else 'H'}")


def event_count(members: Sequence[bytes]) -> int:
    """Events in ``members``: one per plain member, a block's own count per block."""
    return sum(sum(_header(m)[3]) if is_block(m) else 1 for m in members)


def events_after(members: Sequence[bytes], low_us: int, tile_us: int) -> int:
    """Events in ``members`` after ``low_us``: a plain member's by its µs, a block's by the tiles
    ending after it (a window's events, where an entity also keeps older ones for their writes)."""
    count = 0
    for m in members:
        if not is_block(m):
            count += tile_of(m, 1) > low_us
            continue
        _, number, tiles, counts, _ = _header(m)
        count += sum(n for i, n in zip(tiles, counts) if (number * BLOCK_TILES + i + 1) * tile_us > low_us)
    return count


def recorded_writes(blob: bytes) -> list[bytes]:
    """The writes a block's directory records, as the duplicate rule reads them: each event's
    8-byte id and 8-byte µs as its member starts, in (time, id) order."""
    _, _, _, counts, at = _header(blob)
    return _writes(memoryview(blob), at, sum(counts))


def ledger_writes(ledger: bytes) -> list[bytes]:
    """The writes an entity's ledger (its member scored +inf: ``scripts/_blocks.lua``) records
    of events it no longer holds, as ``recorded_writes``."""
    if len(ledger) <= 8:
        return []
    view = memoryview(ledger)
    (length,) = _LENGTH.unpack_from(view, 8)
    p = view[12]
    return _writes(view, 8, (length - 11 - p) // (8 - p + view[13 + p]))


def _writes(view: memoryview, at: int, n: int) -> list[bytes]:
    ids, times, _ = _read_directory(view, at, n)
    stamps = times.view(_U64) ^ _U64(1 << 63)
    return [i.to_bytes(8, "big") + t.to_bytes(8, "big") for i, t in zip(ids.tolist(), stamps.tolist())]


def expand(
    members: list[bytes],
    features: Sequence[tuple[str, DType]],
    within: tuple[int, int] | None = None,
    tile_us: int = 0,
    skip_tiles: Collection[int] = (),
    keep: bool = True,
) -> list[bytes]:
    """``members`` with each block (once, however often it comes) replaced by the events it holds
    with µs in ``within`` (``(low, high]``) outside the tiles ``skip_tiles``, in (time, id) order
    (the order of plain members: a block's tiles may have had late events added since);
    ``keep``: as ``unpack``'s."""
    return _expanded(members, lambda block: unpack(block, features, within, tile_us, skip_tiles, keep))


def _expanded(members: list[bytes], unpacked: Callable[[bytes], list[bytes]]) -> list[bytes]:
    if not any(is_block(m) for m in members):
        return members
    pieces: list[list[bytes]] = []  # runs of plain members (each in order), and each block's events
    plain: list[bytes] = []
    blocks = set()
    for m in members:
        if not is_block(m):
            plain.append(m)
            continue
        if plain:
            pieces.append(plain)
            plain = []
        if m not in blocks:
            blocks.add(m)
            pieces.append(unpacked(m))
    pieces.append(plain)
    pieces = [p for p in pieces if p]
    pieces.sort(key=lambda p: _order(p[0]))
    out = [m for p in pieces for m in p]
    if any(_order(a[-1]) > _order(b[0]) for a, b in zip(pieces, pieces[1:])):  # (late events inside a block)
        out.sort(key=_order)
    return out


def _order(member: bytes) -> tuple[bytes, bytes]:
    return member[8:16], member[:8]


# ------------------------------------------------------------------ the format


@functools.lru_cache(maxsize=256)
def _head_dtype(features: tuple[tuple[str, DType], ...]) -> np.dtype:
    nbytes = (len(features) + 7) // 8
    fixed = [(f"f{i}", _FIXED[t.name]) for i, (_, t) in enumerate(features) if t.name in _FIXED]
    lengths = [(f"len{i}", ">u4") for i, (_, t) in enumerate(features) if variable_width(t)]
    return np.dtype([("id", ">u8"), ("time", ">u8"), ("nulls", "u1", (nbytes,)), *fixed, *lengths])


def pack(members: Sequence[bytes], features: Sequence[tuple[str, DType]], tile_us: int) -> bytes:
    """One block from the plain members of its tiles, in (time, id) order."""
    head = _head_dtype(tuple(features))
    size = head.itemsize
    heads = np.frombuffer(b"".join(m[:size] for m in members), dtype=head)
    times = (heads["time"] ^ _U64(1 << 63)).view(np.int64)
    tiles = times // tile_us
    block = int(tiles[0]) // BLOCK_TILES
    if int(tiles[-1]) // BLOCK_TILES != block:
        raise ValueError("the members span more than one block")
    counts = np.bincount(tiles - block * BLOCK_TILES, minlength=BLOCK_TILES).tolist()
    if max(counts) > MOST_PER_TILE:
        raise ValueError(f"a tile of more than {MOST_PER_TILE:,} events stays plain")
    held, width = sum(1 << i for i, count in enumerate(counts) if count), 1 if max(counts) < 256 else 2
    out = [
        _HEAD.pack(BLOCK_MARK, _VERSION, block, held, width),
        _held_tiles(held, width)[1].pack(*filter(None, counts)),
    ]
    out.append(directory(heads["id"].astype(_U64), times))
    nulls = np.ascontiguousarray(heads["nulls"])
    out.append(b"\x01" + nulls.tobytes() if nulls.any() else b"\x00")
    out += [
        _section(members, heads, features, k)
        for k in range(len(features))
        if features[k][1].name in _FIXED or variable_width(features[k][1])
    ]
    return b"".join(out)


def _section(members: Sequence[bytes], heads: np.ndarray, features: Sequence[tuple[str, DType]], k: int) -> bytes:
    """Feature ``k``'s section of a block of ``members`` (their head records ``heads``)."""
    dtype = features[k][1]
    if dtype.name in _FIXED:
        return _fixed(heads[f"f{k}"], dtype.name)
    starts = heads.dtype.itemsize + sum(
        (heads[f"len{j}"].astype(np.int64) for j in range(k) if variable_width(features[j][1])),
        np.zeros(len(members), np.int64),
    )
    lengths = heads[f"len{k}"].astype(np.int64)
    return _variable([m[a : a + n] for m, a, n in zip(members, starts.tolist(), lengths.tolist())])


def unpack(
    blob: bytes,
    features: Sequence[tuple[str, DType]],
    within: tuple[int, int] | None = None,
    tile_us: int = 0,
    skip_tiles: Collection[int] = (),
    keep: bool = True,
) -> list[bytes]:
    """The members a block holds, byte for byte, in (time, id) order; those with µs in
    ``within`` (``(low, high]``) outside the tiles ``skip_tiles`` only, if given. Only those
    are built: a lookup reads a few tiles of the blocks at its window's edges. With tiles to skip
    (a heavy card's summarized ones), only the rows of the others are decoded: the newest block
    of a heavy card's window holds thousands of events, most of them in summarized tiles.
    ``keep=False``: not kept decoded (a block about to be replaced)."""
    rows = _wanted_rows(blob, within, tile_us, skip_tiles) if skip_tiles else None
    if rows == ():
        return []
    times, heads, var = decoded_blocks.get_many([(blob, tuple(features), rows)], keep)[0]
    if within is None:  # (the rows decoded are of tiles not skipped already)
        return _members(heads, var, None)
    return _members(heads, var, np.flatnonzero((times > within[0]) & (times <= within[1])))


Runs = tuple[tuple[int, int], ...]  # rows [first, stop) of a block, in order


def _wanted_rows(blob: bytes, within: tuple[int, int] | None, tile_us: int, skip_tiles: Collection[int]) -> Runs | None:
    """The rows of a block's tiles reaching into ``within`` outside ``skip_tiles``, as runs (a
    tile's rows follow the tiles before it: rows are in time order); None for all of them."""
    _, number, tiles, counts, _ = _header(blob)
    first = number * BLOCK_TILES
    low, high = ((within[0] + 1) // tile_us, within[1] // tile_us) if within is not None else (-(1 << 62), 1 << 62)
    runs: list[tuple[int, int]] = []
    row = 0
    for i, count in zip(tiles, counts):
        if low <= first + i <= high and first + i not in skip_tiles:
            if runs and runs[-1][1] == row:  # (a tile right after the last run's: one run)
                runs[-1] = (runs[-1][0], row + count)
            else:
                runs.append((row, row + count))
        row += count
    return None if runs == [(0, row)] else tuple(runs)


def _members(heads: np.ndarray, var: list[list[bytes]], rows: np.ndarray | None) -> list[bytes]:
    """The members of a decoded block (at ``rows``, or all): each its head record, then its variable-width values."""
    if rows is not None and len(rows) < len(heads):
        heads = heads[rows]
        picked = rows.tolist()
        var = [[values[i] for i in picked] for values in var]
    fixed = struct.unpack(f"{heads.itemsize}s" * len(heads), heads.tobytes())  # (one C loop: slices cost 10x)
    if not var:
        return list(fixed)
    return list(map(b"".join, zip(fixed, *var)))


_Decoded = tuple[np.ndarray, np.ndarray, list[list[bytes]]]


_BlockKey = tuple[bytes, tuple[tuple[str, DType], ...], Runs | None]  # (the rows decoded, or all)


def _decoded_size(key: _BlockKey, decoded: _Decoded) -> int:
    times, heads, var = decoded
    # each value a bytes object (~33 bytes of its own) in a list (8 bytes a slot)
    return len(key[0]) + times.nbytes + heads.nbytes + sum(sum(map(len, values)) + 41 * len(values) for values in var)


# the blocks a process decoded last (a block never changes): what they hold, not how many, is bounded
decoded_blocks: DecodedCache[_BlockKey, _Decoded] = DecodedCache(
    lambda keys: _decode_many(keys), _decoded_size, DECODED_BLOCK_BYTES
)


def _decode(blob: bytes, features: tuple[tuple[str, DType], ...], rows: Runs | None = None) -> _Decoded:
    """A block's event µs, its members' head records and the values of its variable-width columns:
    of the rows in ``rows``, or all."""
    version, _, _, counts, at = _header(blob)
    if version != _VERSION:
        raise ValueError(f"a packed block of version {version}; this featurestore reads version {_VERSION}")
    n = sum(counts)
    head = _head_dtype(features)
    heads = np.zeros(n if rows is None else sum(stop - first for first, stop in rows), dtype=head)
    view = memoryview(blob)
    ids, times, at = _read_directory(view, at, n, rows)
    heads["id"] = ids
    heads["time"] = times.view(_U64) ^ _U64(1 << 63)
    if blob[at]:
        width = head["nulls"].itemsize
        heads["nulls"] = _take(np.frombuffer(view[at + 1 : at + 1 + n * width], np.uint8).reshape(n, width), rows)
        at += 1 + n * width
    else:
        at += 1
    var: list[list[bytes]] = []
    for k, (_, dtype) in enumerate(features):
        if dtype.name in _FIXED:
            heads[f"f{k}"], at = _read_fixed(view, at, n, dtype.name, rows)
        elif variable_width(dtype):
            values, at = _read_variable(view, at, n, rows)
            heads[f"len{k}"] = [len(v) for v in values]
            var.append(values)
    return times, heads, var


def _take(values: np.ndarray, rows: Runs | None) -> np.ndarray:
    """``values`` at ``rows`` (all if None), a copy: a view would keep all of them alive in the cache."""
    if rows is None:
        return values
    return np.concatenate([values[first:stop] for first, stop in rows])


# the directory: each event's id and µs, sorted by id (Redis finds an id's writes in it)

_LENGTH = struct.Struct(">I")


def directory(ids: np.ndarray, times: np.ndarray) -> bytes:
    """The directory of events with ``ids`` (uint64: their 8 bytes big-endian) at ``times`` (µs),
    as ``scripts/_blocks.lua`` reads it: its length (4 bytes), the length ``p`` of the prefix all
    ids share, the prefix, the width ``w`` of a time, the exponent ``e`` of its unit (10^e µs:
    whole seconds, ms, else µs), the earliest µs (8 bytes, sign-flipped), then per event sorted
    by (id, µs) the id's last ``8 - p`` bytes and its µs less the earliest, in units, in ``w``
    bytes. Fixed-width entries, so a script finds an id by binary search; the rows of the other
    sections are the entries in (µs, id) order."""
    if len(ids) <= SMALL:
        return _few_directory(ids.tolist(), times.tolist())
    order = np.lexsort((times, ids))  # (stable: rows of equal id and µs keep their order)
    ids, times = ids[order], times[order]
    low = int(times.min())
    p = 8 - ((int(ids[0]) ^ int(ids[-1])).bit_length() + 7) // 8
    offsets = (times - low).view(_U64)
    exponent = next(e for e in (6, 3, 0) if not (offsets % _U64(10**e)).any())
    units = offsets // _U64(10**exponent)
    w = max(1, (int(units.max()).bit_length() + 7) // 8)
    entries = np.hstack([_big_endian(ids)[:, p:], _big_endian(units)[:, 8 - w :]])
    head = bytes([p]) + int(ids[0]).to_bytes(8, "big")[:p] + bytes([w, exponent]) + (low + (1 << 63)).to_bytes(8, "big")
    body = head + entries.tobytes()
    return _LENGTH.pack(len(body)) + body


def _few_directory(ids: list[int], times: list[int]) -> bytes:
    """``directory`` of a few events, byte for byte, in Python."""
    rows = sorted(zip(ids, times))
    low = min(times)
    p = 8 - ((rows[0][0] ^ rows[-1][0]).bit_length() + 7) // 8
    offsets = [t - low for _, t in rows]
    exponent = next(e for e in (6, 3, 0) if not any(o % 10**e for o in offsets))
    units = [o // 10**exponent for o in offsets]
    w = max(1, (max(units).bit_length() + 7) // 8)
    entries = b"".join(i.to_bytes(8, "big")[p:] + u.to_bytes(8, "big")[8 - w :] for (i, _), u in zip(rows, units))
    head = bytes([p]) + rows[0][0].to_bytes(8, "big")[:p] + bytes([w, exponent]) + (low + (1 << 63)).to_bytes(8, "big")
    body = head + entries
    return _LENGTH.pack(len(body)) + body


# the id filter: which ids a block may hold, so that a write of a new id need not read the block.
# Every block has one: without, each write of an entity of small blocks (tens of events each, an
# entity of ~100 events a window) read every block a dedup window either side of it
# (``benchmarks/aggregations.py``: sustained ingest into such cards); blocks packed without one are
# read (``may_hold``)
_FILTER_PRIME = 2**31 - 1
_FILTER_FACTORS = np.array([[648_113, 521_387], [797_473, 938_351], [574_831, 1_003_441]], dtype=_U64)


def filter_hashes(ids: np.ndarray) -> np.ndarray:
    """Three hashes of each id (uint64: its 8 bytes big-endian), as ``scripts/_blocks.lua``'s
    ``id_hashes``: (hi · A + lo · B) mod 2^31 − 1 over its 32-bit halves, every product and sum
    below 2^53 (exact in Lua's doubles)."""
    halves = ids.astype(">u8").view(">u4").reshape(-1, 2).astype(_U64)
    return (halves[:, :1] * _FILTER_FACTORS[:, 0] + halves[:, 1:] * _FILTER_FACTORS[:, 1]) % _U64(_FILTER_PRIME)


def id_filter(ids: np.ndarray) -> bytes:
    """A block's id filter, a byte an id (uint64, as ``filter_hashes`` takes them): a Bloom filter
    setting the bit each hash picks, so an id the block lacks gets through about one time in
    thirty (none for no ids)."""
    if not len(ids):
        return b""
    bits = len(ids) * 8
    held = np.zeros(bits, dtype=bool)
    held[filter_hashes(ids) % _U64(bits)] = True
    return np.packbits(held, bitorder="little").tobytes()


def id_filters(ids: np.ndarray, sizes: np.ndarray) -> list[bytes]:
    """``id_filter`` of each run of ``ids`` (uint64), consecutive runs of ``sizes``, in one pass."""
    starts, sizes, run = _rows_of(np.asarray(sizes, np.int64))
    held = np.zeros(8 * len(ids), dtype=bool)
    at = (
        filter_hashes(ids) % (_U64(8) * sizes.astype(_U64))[run][:, None]
        + (_U64(8) * starts.astype(_U64))[run][:, None]
    )
    held[at.ravel()] = True
    return _split(np.packbits(held, bitorder="little").tobytes(), sizes)


def _from_bytes(columns: np.ndarray) -> np.ndarray:
    """Each row of bytes (up to 8) as one big-endian unsigned integer."""
    out = np.zeros(len(columns), dtype=_U64)
    for k in range(columns.shape[1]):
        out = (out << _U64(8)) | columns[:, k]
    return out


def _big_endian(values: np.ndarray) -> np.ndarray:
    return values.astype(">u8").view(np.uint8).reshape(-1, 8)


def _read_directory(view: memoryview, at: int, n: int, rows: Runs | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The ids (uint64) and µs (int64) of a block's ``n`` rows (those in ``rows``), in row order,
    and where its directory ends."""
    (length,) = _LENGTH.unpack_from(view, at)
    at += _LENGTH.size
    p = view[at]
    w, exponent = view[at + 1 + p], view[at + 2 + p]
    low = int.from_bytes(view[at + 3 + p : at + 11 + p], "big") - (1 << 63)
    grid = np.frombuffer(view, np.uint8, n * (8 - p + w), at + 11 + p).reshape(n, 8 - p + w)
    prefix = int.from_bytes(view[at + 1 : at + 1 + p], "big") << (8 * (8 - p)) if p else 0
    if rows is None and w + 8 - p <= 8:  # (an entry's time then id bytes make one integer: one sort)
        keys = np.zeros((n, 8), np.uint8)
        keys[:, p - w : p] = grid[:, 8 - p :]
        keys[:, p:] = grid[:, : 8 - p]
        ordered = np.sort(keys.view(">u8").ravel()).astype(_U64)
        id_bits = 8 * (8 - p)
        if id_bits:
            units, ids = ordered >> _U64(id_bits), (ordered & _U64((1 << id_bits) - 1)) | _U64(prefix)
        else:  # (one id, all prefix: numpy's shift by 64 would not clear the units)
            units, ids = ordered, np.full(n, prefix, _U64)
        return ids, units.astype(np.int64) * 10**exponent + low, at + length
    times = _from_bytes(grid[:, 8 - p :]).astype(np.int64) * 10**exponent + low
    if rows is not None:  # (a run is whole tiles, so its entries are those whose µs lie between
        # its first and last row's: found by selection, and only they are decoded and sorted)
        edges = np.partition(times, sorted({k for first, stop in rows for k in (first, stop - 1)}))
        wanted = np.zeros(n, dtype=bool)
        for first, stop in rows:
            wanted |= (times >= edges[first]) & (times <= edges[stop - 1])
        picked = np.flatnonzero(wanted)
        grid, times = grid[picked], times[picked]
    ids = _from_bytes(grid[:, : 8 - p]) | _U64(prefix)
    order = np.lexsort((ids, times))
    return ids[order], times[order], at + length


# integers: frame of reference over the values or their deltas (mod 2^64), bit-packed


def _bits(values: np.ndarray, width: int) -> bytes:
    if width == 0 or not len(values):
        return b""
    shifts = np.arange(width, dtype=_U64)
    bits = ((values[:, None] >> shifts) & _U64(1)).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def _read_bits(view: memoryview, at: int, n: int, width: int, rows: Runs | None = None) -> tuple[np.ndarray, int]:
    """Values ``rows`` (all if None) of ``n`` packed at ``at``, and where the section ends."""
    parts = [_bits_between(view, at, width, first, stop) for first, stop in rows or ((0, n),)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts), at + (n * width + 7) // 8


def _bits_between(view: memoryview, at: int, width: int, first: int, stop: int) -> np.ndarray:
    """Values ``[first, stop)`` packed at ``at``."""
    count = stop - first
    if width == 0:
        return np.zeros(count, _U64)
    shift, nbits = first * width % 8, count * width
    at += first * width // 8
    nbytes = (shift + nbits + 7) // 8
    if count <= SMALL:  # one Python integer, shifted: numpy's per-call costs would outweigh it
        whole, mask = int.from_bytes(view[at : at + nbytes], "little") >> shift, (1 << width) - 1
        return np.array([(whole >> (i * width)) & mask for i in range(count)], _U64)
    if count <= BIT_ROWS_MOST:  # each value's bits into a row of 64, packed back into a little-endian word
        bits = np.unpackbits(np.frombuffer(view, np.uint8, nbytes, at), count=shift + nbits, bitorder="little")
        rows = np.zeros((count, 64), np.uint8)
        rows[:, :width] = bits[shift:].reshape(count, width)
        return np.packbits(rows, axis=1, bitorder="little").view("<u8").ravel()
    padded = np.zeros((nbytes // 8 + 2) * 8, np.uint8)  # as little-endian words, one spare
    padded[:nbytes] = np.frombuffer(view[at : at + nbytes], np.uint8)
    words = padded.view("<u8")
    starts = np.arange(count, dtype=_U64) * _U64(width) + _U64(shift)
    index, shifts = (starts >> _U64(6)).astype(np.intp), starts & _U64(63)
    # each value: its first word shifted down, or'd with the next shifted up (numpy's shift by 64 is 0)
    high = words[index + 1] << (_U64(64) - shifts)
    return ((words[index] >> shifts) | high) & _U64((1 << width) - 1)


def _frame(values: np.ndarray) -> tuple[int, int, np.ndarray]:
    """(base, width, offsets): values = base + offsets (mod 2^64)."""
    if not len(values):
        return 0, 0, values.view(_U64)
    base = int(values.min())
    offsets = values.view(_U64) - np.array(base, np.int64).view(_U64)
    return base, int(offsets.max()).bit_length(), offsets


def _ints(values: np.ndarray) -> bytes:
    """int64 values as the smaller of their frame of reference (kind 0) and their first value then
    their deltas' frame (kind 1); kind | 2 when the frame's offsets share a factor, stored once
    (event times in whole milliseconds or seconds, ids stepping by more than one)."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    if len(values) <= SMALL:
        return _few_ints(values.tolist())
    plain = _framed(0, (), values)
    if len(values) < 2:
        return plain
    deltas = _framed(1, (int(values[0]),), np.diff(values.view(_U64)).view(np.int64))
    return deltas if len(deltas) < len(plain) else plain


# an integer section's head by kind: kind, (deltas: the first value), base, (scaled: the factor), width
_INT_HEADS = {kind: struct.Struct(f">B{kind & 1}qq{'Q' * (kind >> 1)}b") for kind in range(4)}


def _framed(kind: int, lead: tuple[int, ...], values: np.ndarray) -> bytes:
    base, width, offsets = _frame(values)
    scale = int(np.gcd.reduce(offsets)) if width else 1
    if scale == 1:
        return _INT_HEADS[kind].pack(kind, *lead, base, width) + _bits(offsets, width)
    offsets = offsets // _U64(scale)
    width = int(offsets.max()).bit_length()
    return _INT_HEADS[kind | 2].pack(kind | 2, *lead, base, scale, width) + _bits(offsets, width)


def _few_ints(values: list[int]) -> bytes:
    """``_ints`` of a few values, byte for byte, in Python (numpy's per-call costs outweighed the work)."""
    plain = _few_framed(0, (), values)
    if len(values) < 2:
        return plain
    wrapped = [(b - a) % 2**64 for a, b in zip(values, values[1:])]  # (mod 2^64, as signed int64)
    deltas = _few_framed(1, (values[0],), [d - 2**64 if d >= 2**63 else d for d in wrapped])
    return deltas if len(deltas) < len(plain) else plain


def _few_framed(kind: int, lead: tuple[int, ...], values: list[int]) -> bytes:
    base = min(values, default=0)
    offsets = [v - base for v in values]
    width = max(offsets, default=0).bit_length()
    scale = math.gcd(*offsets) if width else 1
    if scale == 1:
        return _INT_HEADS[kind].pack(kind, *lead, base, width) + _few_bits(offsets, width)
    offsets = [o // scale for o in offsets]
    width = max(offsets).bit_length()
    return _INT_HEADS[kind | 2].pack(kind | 2, *lead, base, scale, width) + _few_bits(offsets, width)


def _few_bits(values: list[int], width: int) -> bytes:
    """``_bits`` in Python: value i at bits ``[i · width, (i + 1) · width)``, little-endian."""
    whole = 0
    for i, value in enumerate(values):
        whole |= value << (i * width)
    return whole.to_bytes((len(values) * width + 7) // 8, "little") if width else b""


def _read_ints(view: memoryview, at: int, n: int, rows: Runs | None = None) -> tuple[np.ndarray, int]:
    """Values ``rows`` (all if None) of ``n`` in the section at ``at`` (deltas: those before are
    summed too), and where the section ends."""
    kind = view[at]
    head = _INT_HEADS[kind]
    fields, deltas = head.unpack_from(view, at), kind & 1
    stop = n if rows is None else rows[-1][1]
    # (delta i is row i + 1's)
    offsets, at = _read_bits(view, at + head.size, n - deltas, fields[-1], ((0, stop - 1),) if deltas else rows)
    if kind & 2:
        offsets *= _U64(fields[-2])
    framed = offsets + np.array(fields[1 + deltas], np.int64).view(_U64)
    if not deltas:
        return framed.view(np.int64), at
    values = np.empty(stop, _U64)
    values[0] = np.array(fields[1], np.int64).view(_U64)
    values[1:] = framed
    return _take(np.cumsum(values, dtype=_U64).view(np.int64), rows), at


# fixed-width columns


def _fixed(column: np.ndarray, dtype: str) -> bytes:
    if dtype == "Bool":
        values = column.astype(np.uint8)
        if (values <= 1).all():
            return b"b" + np.packbits(values, bitorder="little").tobytes()
        return b"r" + values.tobytes()
    if dtype in ("Float64", "Float32"):
        return _floats(column.astype(column.dtype.newbyteorder("=")))
    return b"i" + _ints(column.astype(np.int64))


def _read_fixed(view: memoryview, at: int, n: int, dtype: str, rows: Runs | None) -> tuple[np.ndarray, int]:
    if dtype in ("Float64", "Float32"):
        return _read_floats(view, at, n, dtype, rows)
    kind = chr(view[at])
    at += 1
    if kind == "b":
        nbytes = (n + 7) // 8
        bits = np.unpackbits(np.frombuffer(view[at : at + nbytes], np.uint8), count=n, bitorder="little")
        return _take(bits, rows), at + nbytes
    if kind == "r":
        return _take(np.frombuffer(view[at : at + n], np.uint8), rows), at + n
    return _read_ints(view, at, n, rows)


def _floats(values: np.ndarray) -> bytes:
    """The smallest of: decimals, XOR with the previous value's bits, raw."""
    if len(values) <= SMALL:
        return _few_floats(values)
    width = values.dtype.itemsize
    unsigned = np.uint64 if width == 8 else np.uint32
    bits = values.view(unsigned)
    candidates = [b"r" + bits.astype(f">u{width}").tobytes()]
    if width == 8 and np.isfinite(values).all():
        for exponent in range(7):
            scale = 10.0**exponent
            scaled = np.rint(values * scale)
            if np.abs(scaled).max(initial=0) >= 2**53:
                break
            ints = scaled.astype(np.int64)  # (-0.0 becomes 0: its bits differ, so it is not a decimal)
            if np.array_equal((ints.astype(np.float64) / scale).view(unsigned), bits):
                candidates.append(b"d" + bytes([exponent]) + _ints(ints))
                break
    xor = np.bitwise_xor(bits, np.concatenate([bits[:1] * 0, bits[:-1]]))
    shape, kept, _ = _xor_shapes(xor)
    candidates.append(b"x" + shape.tobytes() + kept.tobytes())
    return min(candidates, key=len)


def _xor_shapes(xor: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each XOR's shape byte (its first non-zero byte, big-endian, and how many bytes from there
    to its last non-zero one; the width and 0 for none), those bytes of them all, and how many
    of them each kept."""
    width = xor.dtype.itemsize
    grid = xor.astype(f">u{width}").view(np.uint8).reshape(-1, width)
    nonzero = grid != 0
    any_set = nonzero.any(axis=1)
    lead = np.where(any_set, nonzero.argmax(axis=1), width)
    last = np.where(any_set, width - 1 - nonzero[:, ::-1].argmax(axis=1), width - 1)
    length = np.where(any_set, last - lead + 1, 0)
    column = np.arange(width)
    kept = grid[(column >= lead[:, None]) & (column < (lead + length)[:, None])]
    return ((lead << 4) | length).astype(np.uint8), kept, length


def _few_floats(values: np.ndarray) -> bytes:
    """``_floats`` of a few values, byte for byte, in Python: numpy's per-call costs made it most of
    a small block's packing."""
    width, n = values.dtype.itemsize, len(values)
    raw = values.view(np.uint64 if width == 8 else np.uint32).astype(f">u{width}").tobytes()  # (bits as they are)
    candidates = [b"r" + raw]
    floats = values.tolist()
    if width == 8 and all(map(math.isfinite, floats)):
        for exponent in range(7):
            scale = 10.0**exponent
            products = [v * scale for v in floats]
            if max(map(abs, products), default=0) >= 2**53:  # (inf included)
                break
            scaled = [round(p) for p in products]  # (to even, as np.rint; exact below 2^53)
            if struct.pack(f">{n}d", *(i / scale for i in scaled)) == raw:  # (bits: -0.0 is no decimal)
                candidates.append(b"d" + bytes([exponent]) + _few_ints(scaled))
                break
    shapes, kept, previous = bytearray(), [], 0
    for bits in struct.unpack(f">{n}{'Q' if width == 8 else 'I'}", raw):
        xor, previous = bits ^ previous, bits
        if not xor:
            shapes.append(width << 4)
            continue
        trailing = ((xor & -xor).bit_length() - 1) // 8  # (zero bytes at the end)
        lead = width - (xor.bit_length() + 7) // 8
        length = width - lead - trailing
        shapes.append(lead << 4 | length)
        kept.append((xor >> (8 * trailing)).to_bytes(length, "big"))
    candidates.append(b"x" + bytes(shapes) + b"".join(kept))
    return min(candidates, key=len)


def _read_floats(view: memoryview, at: int, n: int, dtype: str, rows: Runs | None) -> tuple[np.ndarray, int]:
    kind = chr(view[at])
    at += 1
    width = 8 if dtype == "Float64" else 4
    float_type = np.float64 if width == 8 else np.float32
    if kind == "r":
        raw = np.frombuffer(view[at : at + n * width], f">f{width}")
        return _take(raw, rows).astype(float_type), at + n * width
    if kind == "d":
        exponent = view[at]
        scaled, at = _read_ints(view, at + 1, n, rows)
        return scaled.astype(np.float64) / 10.0**exponent, at
    shape = np.frombuffer(view[at : at + n], np.uint8)  # (each value XORs the one before: all are read)
    total = int((shape & 15).sum(dtype=np.int64))
    xor = _xors(shape, view[at + n : at + n + total], width)
    return _take(np.bitwise_xor.accumulate(xor).view(float_type), rows), at + n + total


def _xors(shape: np.ndarray, kept: Any, width: int) -> np.ndarray:
    """The XORs (unsigned, ``width`` bytes) that shape bytes and the bytes they kept (``_xor_shapes``) stand for."""
    lead, length = (shape >> 4).astype(np.int64), (shape & 15).astype(np.int64)
    column = np.arange(width)
    grid = np.zeros((len(shape), width), np.uint8)
    grid[(column >= lead[:, None]) & (column < (lead + length)[:, None])] = np.frombuffer(kept, np.uint8)
    return grid.view(f">u{width}").ravel().astype(np.uint64 if width == 8 else np.uint32)


# strings, bytes and arrays: their bytes, dictionary-encoded when values repeat


def _variable(values: list[bytes]) -> bytes:
    unique: dict[bytes, int] = {}
    codes = np.array([unique.setdefault(v, len(unique)) for v in values], np.int64)
    if len(unique) * 2 <= len(values):
        words = list(unique)
        lengths = np.array([len(w) for w in words], np.int64)
        return b"d" + struct.pack(">I", len(words)) + _ints(lengths) + b"".join(words) + _ints(codes)
    lengths = np.array([len(v) for v in values], np.int64)
    return b"r" + _ints(lengths) + b"".join(values)


def _read_variable(view: memoryview, at: int, n: int, rows: Runs | None) -> tuple[list[bytes], int]:
    kind = chr(view[at])
    at += 1
    if kind == "d":
        (words,) = struct.unpack_from(">I", view, at)
        lengths, at = _read_ints(view, at + 4, words)
        dictionary = []
        for length in lengths.tolist():
            dictionary.append(bytes(view[at : at + length]))
            at += length
        codes, at = _read_ints(view, at, n, rows)
        return [dictionary[c] for c in codes.tolist()], at
    lengths, at = _read_ints(view, at, n)
    starts = (at + np.cumsum(lengths) - lengths).tolist()
    out: list[Any] = []
    for first, stop in ((0, n),) if rows is None else rows:
        out.extend(bytes(view[a : a + length]) for a, length in zip(starts[first:stop], lengths[first:stop].tolist()))
    return out, at + int(lengths.sum())


# many blocks at once: a writer or a packing run packs hundreds of small blocks (tens of events
# each), where numpy's per-call costs, paid per block and section, were most of the work. The
# bytes are ``pack``'s; each section is computed for all blocks in one pass over their rows,
# ``starts`` and ``sizes`` saying where each block's rows are.


def pack_many(
    groups: Sequence[Sequence[bytes]], features: Sequence[tuple[str, DType]], tile_us: int
) -> list[bytes | None]:
    """``pack`` of each group (the plain members of one block's tiles, in (time, id) order), byte
    for byte; None for a group ``pack`` refuses (empty, across blocks, a tile too full)."""
    features = tuple(features)
    out: list[bytes | None] = [None] * len(groups)
    usable = [i for i, g in enumerate(groups) if g]
    if len(usable) < max(1, FEW_BLOCKS):
        for i in usable:
            with contextlib.suppress(ValueError):
                out[i] = pack(groups[i], features, tile_us)
        return out
    head = _head_dtype(features)
    size = head.itemsize
    rows = _rows_of(np.array([len(groups[i]) for i in usable], np.int64))
    starts, sizes, segment = rows
    heads = np.frombuffer(b"".join(m[:size] for i in usable for m in groups[i]), dtype=head)
    times = (heads["time"] ^ _U64(1 << 63)).view(np.int64)
    tiles = times // tile_us
    blocks = tiles[starts] // BLOCK_TILES
    local = tiles - blocks[segment] * BLOCK_TILES
    within = np.logical_and.reduceat((local >= 0) & (local < BLOCK_TILES), starts)
    local = np.where(within[segment], local, 0)
    counts = np.bincount(segment * BLOCK_TILES + local, minlength=len(usable) * BLOCK_TILES).reshape(-1, BLOCK_TILES)
    within &= counts.max(axis=1) <= MOST_PER_TILE
    if not within.all():  # (rare: packed without them)
        kept = [usable[k] for k in np.flatnonzero(within).tolist()]
        for i, blob in zip(kept, pack_many([groups[i] for i in kept], features, tile_us)):
            out[i] = blob
        return out
    held = (counts > 0).astype(np.int64) @ (np.int64(1) << np.arange(BLOCK_TILES, dtype=np.int64))
    sections = [
        [
            _HEAD.pack(BLOCK_MARK, _VERSION, number, h, width) + _held_tiles(h, width)[1].pack(*filter(None, row))
            for number, h, row, width in zip(
                blocks.tolist(), held.tolist(), counts.tolist(), np.where(counts.max(axis=1) < 256, 1, 2).tolist()
            )
        ],
        _directories(heads["id"].astype(_U64), times, rows),
        _null_sections(np.ascontiguousarray(heads["nulls"]), rows),
    ]
    members = [m for i in usable for m in groups[i]]
    for k, (_, dtype) in enumerate(features):
        if dtype.name in ("Float64", "Float32"):
            column = heads[f"f{k}"]
            sections.append(_floats_many(column.astype(column.dtype.newbyteorder("=")), rows))
        elif dtype.name in _FIXED and dtype.name != "Bool":
            sections.append([b"i" + s for s in _ints_many(heads[f"f{k}"].astype(np.int64), rows)])
        elif dtype.name in _FIXED or variable_width(dtype):  # (booleans and variable widths: a block at a time)
            sections.append(
                [
                    _section(members[a : a + n], heads[a : a + n], features, k)
                    for a, n in zip(starts.tolist(), sizes.tolist())
                ]
            )
    for i, parts in zip(usable, zip(*sections)):
        out[i] = b"".join(parts)
    return out


_Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # each block's first row and its rows; each row's block


def _split(data: bytes, lengths: np.ndarray) -> list[bytes]:
    """``data`` cut into consecutive pieces of ``lengths``."""
    stops = np.cumsum(lengths).tolist()
    return [data[a:b] for a, b in zip([0, *stops[:-1]], stops)]


def _byte_lengths(values: np.ndarray) -> np.ndarray:
    """The bytes each uint64 needs (0 for 0): how many of its shifts by whole bytes are non-zero."""
    return ((values[:, None] >> (_U64(8) * np.arange(8, dtype=_U64))) != 0).sum(axis=1)


_BIT_LENGTHS = np.array([n.bit_length() for n in range(256)], np.int64)


def _bit_lengths(values: np.ndarray) -> np.ndarray:
    """``int.bit_length`` of each uint64."""
    nbytes = _byte_lengths(values)
    top = (values >> (_U64(8) * np.maximum(nbytes - 1, 0).astype(_U64))) & _U64(255)
    return np.where(nbytes > 0, 8 * (nbytes - 1) + _BIT_LENGTHS[top.astype(np.int64)], 0)


def _directories(ids: np.ndarray, times: np.ndarray, rows: _Rows) -> list[bytes]:
    """``directory`` of each block's rows."""
    starts, sizes, segment = rows
    order = np.lexsort((times, ids, segment))
    ids, times = ids[order], times[order]
    low = np.minimum.reduceat(times, starts)
    p = 8 - _byte_lengths(ids[starts] ^ ids[starts + sizes - 1])
    offsets = (times - low[segment]).view(_U64)
    exponent = np.zeros(len(starts), np.int64)
    for e in (3, 6):  # (the largest unit every offset is a whole number of)
        exponent[np.logical_and.reduceat(offsets % _U64(10**e) == 0, starts)] = e
    units = offsets // (_U64(10) ** exponent.astype(_U64))[segment]
    w = np.maximum(1, _byte_lengths(np.maximum.reduceat(units, starts)))
    grid = np.hstack([_big_endian(ids), _big_endian(units)])
    column = np.arange(8)
    keep = np.hstack([column >= p[segment][:, None], column >= (8 - w)[segment][:, None]])
    entries = _split(grid[keep].tobytes(), sizes * (8 - p + w))
    out = []
    for p_, first, w_, e, low_, body in zip(
        p.tolist(), ids[starts].tolist(), w.tolist(), exponent.tolist(), low.tolist(), entries
    ):
        head = bytes([p_]) + first.to_bytes(8, "big")[:p_] + bytes([w_, e]) + (low_ + (1 << 63)).to_bytes(8, "big")
        out.append(_LENGTH.pack(len(head) + len(body)) + head + body)
    return out


def _null_sections(nulls: np.ndarray, rows: _Rows) -> list[bytes]:
    starts, sizes, _ = rows
    width = nulls.shape[1]
    some = np.logical_or.reduceat(nulls.any(axis=1), starts).tolist()
    data = nulls.tobytes()
    return [
        b"\x01" + data[a * width : (a + n) * width] if s else b"\x00"
        for a, n, s in zip(starts.tolist(), sizes.tolist(), some)
    ]


def _framed_many(values: np.ndarray, rows: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_framed``'s base, factor, width and offsets (divided by the factor) of each block's
    values (int64, each block holding some)."""
    starts, _, segment = rows
    base = np.minimum.reduceat(values, starts)
    offsets = values.view(_U64) - base.view(_U64)[segment]
    width = _bit_lengths(np.maximum.reduceat(offsets, starts))
    scale = np.where(width > 0, np.gcd.reduceat(offsets, starts), _U64(1))
    scaled = scale > 1
    if scaled.any():
        offsets = offsets // scale[segment]
        width = np.where(scaled, _bit_lengths(np.maximum.reduceat(offsets, starts)), width)
    return base, scale, width, offsets


def _ints_many(values: np.ndarray, rows: _Rows) -> list[bytes]:
    """``_ints`` of each block's values (int64): the smaller of their frame and their first value
    then their deltas' frame (blocks of two or more)."""
    starts, sizes, segment = rows
    base, scale, width, offsets = _framed_many(values, rows)
    kind, lead = np.where(scale > 1, 2, 0), np.zeros(len(starts), np.int64)
    length = _INT_HEAD_SIZES[kind] + (sizes * width + 7) // 8
    several = np.flatnonzero(sizes >= 2)
    by_delta = np.zeros(len(starts), bool)
    if len(several):  # (each row's value less the one before it, mod 2^64)
        later = np.ones(len(values), bool)
        later[starts] = False
        deltas = (values.view(_U64) - np.roll(values.view(_U64), 1))[later].view(np.int64)
        d_rows = _rows_of(sizes[several] - 1)
        d_base, d_scale, d_width, d_offsets = _framed_many(deltas, d_rows)
        d_kind = np.where(d_scale > 1, 3, 1)
        better = _INT_HEAD_SIZES[d_kind] + (d_rows[1] * d_width + 7) // 8 < length[several]
        take = several[better]
        by_delta[take] = True
        kind[take], lead[take], base[take], scale[take], width[take] = (
            d_kind[better],
            values[starts[take]],
            d_base[better],
            d_scale[better],
            d_width[better],
        )
    bits = [b""] * len(starts)
    plain = np.flatnonzero(~by_delta)
    for block, piece in zip(plain.tolist(), _bits_many(offsets[~by_delta[segment]], sizes[plain], width[plain])):
        bits[block] = piece
    if by_delta.any():
        chosen = d_offsets[by_delta[several][d_rows[2]]]
        for block, piece in zip(take.tolist(), _bits_many(chosen, sizes[take] - 1, width[take])):
            bits[block] = piece
    out = []
    for k, first, b, s, w, body in zip(
        kind.tolist(), lead.tolist(), base.tolist(), scale.tolist(), width.tolist(), bits
    ):
        fields = (k, *((first,) if k & 1 else ()), b, *((s,) if k & 2 else ()), w)
        out.append(_INT_HEADS[k].pack(*fields) + body)
    return out


def _rows_of(sizes: np.ndarray) -> _Rows:
    """The rows of consecutive blocks of ``sizes`` rows."""
    return np.cumsum(sizes) - sizes, sizes, np.repeat(np.arange(len(sizes)), sizes)


def _bits_many(values: np.ndarray, counts: np.ndarray, widths: np.ndarray) -> list[bytes]:
    """``_bits`` of consecutive runs of ``values`` (uint64): ``counts[i]`` of them at ``widths[i]``."""
    nbits = counts * widths
    nbytes = (nbits + 7) // 8
    if not nbits.any():
        return [b""] * len(counts)
    widest = int(widths.max())
    bits = ((values[:, None] >> np.arange(widest, dtype=_U64)) & _U64(1)).astype(np.uint8)
    taken = bits[np.arange(widest) < np.repeat(widths, counts)[:, None]]  # (each value's bits, in order)
    first_bit = np.cumsum(nbits) - nbits
    first_byte = np.cumsum(nbytes) - nbytes
    at = np.arange(len(taken)) + np.repeat(8 * first_byte - first_bit, nbits)
    spread = np.zeros(8 * int(nbytes.sum()), np.uint8)
    spread[at] = taken
    return _split(np.packbits(spread, bitorder="little").tobytes(), nbytes)


_INT_HEAD_SIZES = np.array([_INT_HEADS[kind].size for kind in range(4)])
_POWERS = np.array([10.0**e for e in range(7)])


def _floats_many(values: np.ndarray, rows: _Rows) -> list[bytes]:
    """``_floats`` of each block's values (float64 or float32): the smallest of raw, decimals, XOR."""
    starts, sizes, segment = rows
    width = values.dtype.itemsize
    bits = values.view(np.uint64 if width == 8 else np.uint32)
    raw = _split(bits.astype(f">u{width}").tobytes(), sizes * width)
    decimals: dict[int, bytes] = {}
    if width == 8:
        exponent = np.full(len(starts), -1)
        searching = np.logical_and.reduceat(np.isfinite(values), starts)
        with np.errstate(all="ignore"):  # (the rows of blocks not searched)
            for e in range(7):
                if not searching.any():
                    break
                scaled = np.rint(values * _POWERS[e])
                searching &= np.maximum.reduceat(np.abs(scaled), starts) < 2**53
                same = (scaled.astype(np.int64).astype(np.float64) / _POWERS[e]).view(np.uint64) == bits
                found = searching & np.logical_and.reduceat(same, starts)
                exponent[found], searching = e, searching & ~found
            blocks = np.flatnonzero(exponent >= 0)
            if len(blocks):
                picked = (exponent >= 0)[segment]
                ints = np.rint(values[picked] * _POWERS[exponent[segment[picked]]]).astype(np.int64)
                sections = _ints_many(ints, _rows_of(sizes[blocks]))
                for block, e, section in zip(blocks.tolist(), exponent[blocks].tolist(), sections):
                    decimals[block] = b"d" + bytes([e]) + section
    previous = np.roll(bits, 1)
    previous[starts] = 0
    shape, kept_bytes, length = _xor_shapes(bits ^ previous)
    shapes = _split(shape.tobytes(), sizes)
    kept = _split(kept_bytes.tobytes(), np.add.reduceat(length, starts))
    out = []
    for block, (r, s, k) in enumerate(zip(raw, shapes, kept)):
        candidates = [b"r" + r]
        if block in decimals:
            candidates.append(decimals[block])
        candidates.append(b"x" + s + k)
        out.append(min(candidates, key=len))
    return out


# many blocks decoded at once: a packing run reads the blocks it packs again, hundreds of small
# ones, where numpy's per-call costs per block and section were most of the decoding. The values
# are ``_decode``'s; a pass in Python finds each block's sections, then each kind of section is
# read for all blocks in one pass over their rows.


def expand_many(
    lists: Sequence[list[bytes]], features: Sequence[tuple[str, DType]], keep: bool = True
) -> list[list[bytes]]:
    """``expand`` of each list of members (whole blocks), their blocks decoded together."""
    features = tuple(features)
    blocks = list(dict.fromkeys(m for members in lists for m in members if is_block(m)))
    decoded = dict(zip(blocks, decoded_blocks.get_many([(b, features, None) for b in blocks], keep)))
    return [_expanded(members, lambda m: _members(decoded[m][1], decoded[m][2], None)) for members in lists]


def _decode_many(keys: Sequence[_BlockKey]) -> list[_Decoded]:
    """``_decode`` of each key: whole blocks of one layout together, where there are enough."""
    together: dict[tuple[tuple[str, DType], ...], list[int]] = {}
    for i, (_, features, rows) in enumerate(keys):
        if rows is None:
            together.setdefault(features, []).append(i)
    out: list[_Decoded | None] = [None] * len(keys)
    for features, indices in together.items():
        if len(indices) >= max(1, FEW_BLOCKS):
            for i, decoded in zip(indices, _decode_blocks([keys[i][0] for i in indices], features)):
                out[i] = decoded
    return [_decode(*key) if decoded is None else decoded for key, decoded in zip(keys, out)]


def _decode_blocks(blobs: Sequence[bytes], features: tuple[tuple[str, DType], ...]) -> list[_Decoded]:
    """``_decode`` of each whole block."""
    head = _head_dtype(features)
    nulls_width = head["nulls"].itemsize
    sizes, directories, nulls = [], [], []
    columns: dict[int, list] = {k: [] for k in range(len(features))}  # per feature, each block's section
    for blob in blobs:
        version, _, _, counts, at = _header(blob)
        if version != _VERSION:
            raise ValueError(f"a packed block of version {version}; this featurestore reads version {_VERSION}")
        n = sum(counts)
        sizes.append(n)
        (length,) = _LENGTH.unpack_from(blob, at)
        d = at + _LENGTH.size
        p = blob[d]
        directories.append((blob, p, blob[d + 1 : d + 1 + p], blob[d + 1 + p], blob[d + 2 + p], d + 11 + p))
        at = d + length
        nulls.append(at + 1 if blob[at] else None)
        at += 1 + (n * nulls_width if blob[at] else 0)
        for k, (_, dtype) in enumerate(features):
            if dtype.name in ("Float64", "Float32"):
                kind, at = chr(blob[at]), at + 1
                if kind == "r":
                    columns[k].append(("r", at))
                    at += n * (8 if dtype.name == "Float64" else 4)
                elif kind == "d":
                    section = _int_section(blob, at + 1, n)
                    columns[k].append(("d", blob[at], section))
                    at = section[-1]
                else:
                    kept = sum(b & 15 for b in blob[at : at + n])
                    columns[k].append(("x", at, kept))
                    at += n + kept
            elif dtype.name in _FIXED and dtype.name != "Bool":
                section = _int_section(blob, at + 1, n)
                columns[k].append(("i", section))
                at = section[-1]
            elif dtype.name in _FIXED:  # (booleans and variable widths: a block at a time)
                boolean, at = _read_fixed(memoryview(blob), at, n, dtype.name, None)
                columns[k].append(boolean)
            elif variable_width(dtype):
                values, at = _read_variable(memoryview(blob), at, n, None)
                columns[k].append(values)
    rows = _rows_of(np.array(sizes, np.int64))
    starts, _, segment = rows
    ids, times = _directories_read(directories, rows)
    heads = np.zeros(len(segment), dtype=head)
    heads["id"], heads["time"] = ids, times.view(_U64) ^ _U64(1 << 63)
    for block, nulls_at in enumerate(nulls):
        if nulls_at is not None:
            a, n = int(starts[block]), sizes[block]
            heads["nulls"][a : a + n] = np.frombuffer(blobs[block], np.uint8, n * nulls_width, nulls_at).reshape(
                n, nulls_width
            )
    var: list[list[list[bytes]]] = [[] for _ in blobs]
    for k, (_, dtype) in enumerate(features):
        if dtype.name in ("Float64", "Float32"):
            heads[f"f{k}"] = _floats_read(blobs, columns[k], rows, 8 if dtype.name == "Float64" else 4)
        elif dtype.name in _FIXED and dtype.name != "Bool":
            heads[f"f{k}"] = _ints_read([(blob, section) for blob, (_, section) in zip(blobs, columns[k])], rows)
        elif dtype.name in _FIXED:
            heads[f"f{k}"] = np.concatenate(columns[k])
        elif variable_width(dtype):
            heads[f"len{k}"] = [len(v) for values in columns[k] for v in values]
            for block, values in enumerate(columns[k]):
                var[block].append(values)
    out = []
    for block, (a, n) in enumerate(zip(starts.tolist(), sizes)):  # (copies: a view would keep the batch alive)
        out.append((times[a : a + n].copy(), heads[a : a + n].copy(), var[block]))
    return out


_IntSection = tuple[int, tuple, int, int, int, int]  # kind, head fields, values, width, where its bits start, its end


def _int_section(blob: bytes, at: int, n: int) -> _IntSection:
    """Where an integer section of ``n`` values at ``at`` keeps what (``_read_ints``)."""
    kind = blob[at]
    head = _INT_HEADS[kind]
    fields = head.unpack_from(blob, at)
    count, width = n - (kind & 1), fields[-1]
    bits_at = at + head.size
    return kind, fields, count, width, bits_at, bits_at + (count * width + 7) // 8


def _directories_read(directories: list, rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """Each block's ids (uint64) and µs (int64), in (µs, id) order, as ``_read_directory``: the
    blocks whose entries have one shape (id bytes kept, time bytes) read together, a column of
    bytes at a time (as ``_read_directory`` reads one block)."""
    starts, sizes, segment = rows
    ids, units = np.zeros(len(segment), _U64), np.zeros(len(segment), _U64)
    shapes: dict[tuple[int, int], list[int]] = {}
    for block, d in enumerate(directories):
        shapes.setdefault((d[1], d[3]), []).append(block)
    for (p, w), blocks in shapes.items():
        grid = np.frombuffer(
            b"".join(directories[k][0][directories[k][5] : directories[k][5] + sizes[k] * (8 - p + w)] for k in blocks),
            np.uint8,
        ).reshape(-1, 8 - p + w)
        at = np.concatenate([np.arange(starts[k], starts[k] + sizes[k]) for k in blocks])
        prefix = np.array([int.from_bytes(directories[k][2], "big") << (8 * (8 - p)) if p else 0 for k in blocks], _U64)
        ids[at] = _from_bytes(grid[:, : 8 - p]) | np.repeat(prefix, sizes[blocks])
        units[at] = _from_bytes(grid[:, 8 - p :])
    scale = (np.int64(10) ** np.array([d[4] for d in directories], np.int64))[segment]
    low = np.array(
        [int.from_bytes(blob[at - 8 : at], "big") - (1 << 63) for blob, _, _, _, _, at in directories], np.int64
    )
    times = units.astype(np.int64) * scale + low[segment]
    order = np.lexsort((ids, times, segment))
    return ids[order], times[order]


def _unbits(sections: list[tuple[bytes, int, int, int]]) -> np.ndarray:
    """The values bit-packed in each ``(block, where, count, width)``, one after the other (uint64),
    as ``_bits_between`` shifts words: each value from the word its first bit is in and the next."""
    counts = np.array([s[2] for s in sections], np.int64)
    widths = np.array([s[3] for s in sections], np.int64)
    nbytes = (counts * widths + 7) // 8
    if not nbytes.any():
        return np.zeros(int(counts.sum()), _U64)
    data = b"".join(blob[at : at + m] for (blob, at, _, _), m in zip(sections, nbytes.tolist()))
    padded = np.zeros((len(data) // 8 + 2) * 8, np.uint8)  # as little-endian words, one spare
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    words = padded.view("<u8")
    first, _, of = _rows_of(counts)
    width = widths[of].astype(_U64)
    starts = ((np.cumsum(nbytes) - nbytes)[of] * 8).astype(_U64) + (np.arange(len(of)) - first[of]).astype(_U64) * width
    index, shifts = (starts >> _U64(6)).astype(np.intp), starts & _U64(63)
    high = words[index + 1] << (_U64(64) - shifts)  # (numpy's shift by 64 is 0: so is a width of 64's mask)
    return ((words[index] >> shifts) | high) & ((_U64(1) << width) - _U64(1))


def _ints_read(blocks: list[tuple[bytes, _IntSection]], rows: _Rows) -> np.ndarray:
    """``_read_ints`` of each ``(block, its section)`` (int64, the blocks' rows one after the other)."""
    starts, _, segment = rows
    sections = [section for _, section in blocks]
    kinds = np.array([s[0] for s in sections], np.int64)
    offsets = _unbits([(blob, s[4], s[2], s[3]) for blob, s in blocks])
    first, counts, of = _rows_of(np.array([s[2] for s in sections], np.int64))
    scale = np.array([s[1][-2] if s[0] & 2 else 1 for s in sections], _U64)  # (a factor may pass 2^63)
    base = np.array([s[1][1 + (s[0] & 1)] for s in sections], np.int64).view(_U64)
    framed = offsets * scale[of] + base[of]
    deltas = (kinds & 1).astype(bool)
    values = np.zeros(len(segment), _U64)
    values[np.repeat(starts + deltas, counts) + (np.arange(len(of)) - first[of])] = framed
    if deltas.any():  # (a block's first value, then each row's delta from the one before: summed)
        values[starts[deltas]] = np.array([s[1][1] for s, d in zip(sections, deltas) if d], np.int64).view(_U64)
        summed = np.cumsum(np.where(deltas[segment], values, _U64(0)), dtype=_U64)
        before = np.concatenate([[_U64(0)], summed])[starts]
        values = np.where(deltas[segment], summed - before[segment], values)
    return values.view(np.int64)


def _floats_read(blobs: Sequence[bytes], sections: list, rows: _Rows, width: int) -> np.ndarray:
    """``_read_floats`` of each block's section, the blocks' rows one after the other."""
    starts, sizes, segment = rows
    float_type, unsigned = (np.float64, np.uint64) if width == 8 else (np.float32, np.uint32)
    out = np.zeros(len(segment), float_type)
    by_kind: dict[str, list[int]] = {}
    for block, section in enumerate(sections):
        by_kind.setdefault(section[0], []).append(block)
    for kind, blocks in by_kind.items():
        picked = np.concatenate([np.arange(starts[b], starts[b] + sizes[b]) for b in blocks])
        n = sizes[blocks]
        if kind == "r":
            raw = b"".join(blobs[b][sections[b][1] : sections[b][1] + sizes[b] * width] for b in blocks)
            out[picked] = np.frombuffer(raw, f">f{width}")
        elif kind == "d":
            scaled = _ints_read([(blobs[b], sections[b][2]) for b in blocks], _rows_of(n))
            exponents = np.repeat(np.array([sections[b][1] for b in blocks], np.int64), n)
            out[picked] = scaled.astype(np.float64) / _POWERS[exponents]
        else:
            shape = np.frombuffer(
                b"".join(blobs[b][sections[b][1] : sections[b][1] + sizes[b]] for b in blocks), np.uint8
            )
            kept = b"".join(
                blobs[b][sections[b][1] + sizes[b] : sections[b][1] + sizes[b] + sections[b][2]] for b in blocks
            )
            summed = np.bitwise_xor.accumulate(_xors(shape, kept, width))
            first, _, of = _rows_of(n)  # (each block's XORs from its own first value)
            out[picked] = (summed ^ np.concatenate([[unsigned(0)], summed])[first][of]).view(float_type)
    return out
