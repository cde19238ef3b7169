"""The buffer's record format: a header and a payload of ``(target, Arrow IPC stream)`` parts.

A record is ``RECORD`` (magic, payload length, CRC-32 of the payload, sequence, rows, flags)
followed by its parts; ``read_records`` reads a journal up to its first invalid record (zeros:
its end, or a record torn by a writer that died writing it). ``decode`` joins one target's
streams of one schema into one read. Segment files of one record each, written by earlier
versions (``<seq>-<pid>-<rows>[-retry].<state>.arrow``), read as records too.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

RECORD = struct.Struct(">4sIIQIB7x")  # magic, payload bytes, CRC-32, sequence, rows, flags (32 bytes)
MAGIC = b"FSB2"
FLAGS_AT = 24  # the flags byte's offset in the header
PENDING, RETRY = 1, 2


@dataclass
class Record:
    """One push's rows in a lane: ``streams`` is ``[(target, rows as an Arrow IPC stream)]``."""

    seq: int
    rows: int
    pending: bool
    retry: bool
    streams: list[tuple[str, Any]]  # (target, bytes-like IPC stream or, from an old segment, a Table)

    @property
    def parts(self) -> list[tuple[str, pa.Table]]:
        """``[(target, rows)]``."""
        return [
            (target, s if isinstance(s, pa.Table) else ipc.open_stream(pa.py_buffer(s)).read_all())
            for target, s in self.streams
        ]


PARTS = "featurestore.parts"  # schema metadata of an old segment holding several targets' rows
PART = struct.Struct(">HI")  # a part's target name length, then its stream's
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def encode_parts(parts: dict[str, pa.Table]) -> bytes:
    """A record's payload: each target's name and its rows as an Arrow IPC stream."""
    return b"".join(
        PART.pack(len(name := target.encode()), len(stream := ipc_bytes(table))) + name + stream
        for target, table in parts.items()
    )


def ipc_bytes(rows: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    return sink.getvalue().to_pybytes()


def decode(streams: list) -> pa.Table:
    """One target's rows from its records' IPC streams (and old segments' tables), in order:
    streams of one schema are joined into one (its schema message once, every stream's batch
    messages, one end) and read in one call."""
    tables: list[pa.Table] = []
    schema_message, batches = b"", list[bytes | memoryview]()
    joinable: dict[bytes, bool] = {}  # per schema message: no dictionaries (each stream would carry its own)

    def read_joined() -> None:
        if batches:
            tables.append(ipc.open_stream(pa.py_buffer(b"".join([schema_message, *batches, _EOS]))).read_all())
            batches.clear()

    for i, stream in enumerate(streams):
        yield_gil(i)
        if isinstance(stream, pa.Table):
            read_joined()
            tables.append(stream)
            continue
        view = memoryview(stream)
        # a stream: its schema message (continuation marker, metadata length, metadata), batch messages, the end
        length = struct.unpack_from("<i", view, 4)[0] if view[:4] == b"\xff\xff\xff\xff" else -1
        schema = bytes(view[: 8 + length]) if length >= 0 and view[-8:] == _EOS else b""
        if schema and schema not in joinable:
            joinable[schema] = not any(pa.types.is_dictionary(f.type) for f in ipc.read_schema(pa.py_buffer(schema)))
        if not schema or not joinable[schema]:  # read alone
            read_joined()
            tables.append(ipc.open_stream(pa.py_buffer(stream)).read_all())
            continue
        if schema != schema_message:
            read_joined()
            schema_message = schema
        batches.append(view[8 + length : -8])
    read_joined()
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def read_records(path: Path, lane: str) -> tuple[list[Record], str | None]:
    """A file's complete records, and what is wrong with the first incomplete one (None: none is)."""
    if path.suffix == ".arrow":  # a segment of an earlier version: one record, its state in its name
        seq, _, rows = path.name.split(".")[0].split("-")[:3]
        try:
            parts = _segment_parts(pa.py_buffer(path.read_bytes()), lane)
        except pa.ArrowInvalid as exc:
            return [], str(exc)
        return [Record(int(seq), int(rows), ".pending." in path.name, "-retry" in path.name, parts)], None
    data = path.read_bytes()
    records: list[Record] = []
    at = 0
    while at + RECORD.size <= len(data):
        yield_gil(len(records))
        magic, size, crc, seq, rows, flags = RECORD.unpack_from(data, at)
        if magic != MAGIC:
            return records, None if not any(data[at : at + RECORD.size]) else f"no record header at byte {at}"
        payload = memoryview(data)[at + RECORD.size : at + RECORD.size + size]  # (no copy)
        if len(payload) < size or zlib.crc32(payload) != crc:
            return records, f"record at byte {at} is cut short or corrupt"
        records.append(Record(seq, rows, bool(flags & PENDING), bool(flags & RETRY), _streams(payload)))
        at += RECORD.size + size
    return records, None


def count_rows(path: Path, at: int = 0, rows: int = 0) -> tuple[int, int]:
    """``(where the valid records end, rows)`` of a file, counting on from record offset ``at`` with
    ``rows`` before it, from the record headers (payloads are not read)."""
    if path.suffix == ".arrow":
        return 0, int(path.name.split("-")[2].split(".")[0])
    try:
        with open(path, "rb") as f:
            while (header := os.pread(f.fileno(), RECORD.size, at)) and len(header) == RECORD.size:
                magic, size, _, _, n, _ = RECORD.unpack(header)
                if magic != MAGIC:
                    break
                rows, at = rows + n, at + RECORD.size + size
    except FileNotFoundError:  # a drain took it since the listing
        pass
    return at, rows


def _streams(payload: memoryview) -> list[tuple[str, memoryview]]:
    """A record's ``(target, IPC stream)`` parts."""
    parts, at = [], 0
    while at < len(payload):
        name_length, stream_length = PART.unpack_from(payload, at)
        at += PART.size
        name, stream = (
            bytes(payload[at : at + name_length]).decode(),
            payload[at + name_length : at + name_length + stream_length],
        )
        parts.append((name, stream))
        at += name_length + stream_length
    return parts


def _segment_parts(payload: pa.Buffer, lane: str) -> list[tuple[str, pa.Table]]:
    """An old segment's ``(target, rows)`` parts (one target's rows, or a table of them)."""
    table = ipc.open_file(payload).read_all()
    if (table.schema.metadata or {}).get(PARTS.encode()) != b"1":
        return [(lane, table)]
    return [
        (target, ipc.open_stream(pa.py_buffer(rows)).read_all())
        for target, rows in zip(table["target"].to_pylist(), table["rows"].to_pylist())
    ]


def yield_gil(i: int) -> None:
    """Every 64 records, let a waiting thread (a push) have the GIL now: a commit's per-record loops
    otherwise keep it for the interpreter's switch interval (5 ms) each time a push needs it."""
    if i % 64 == 63:
        time.sleep(0)
