"""Timestamps as clients send them over REST: ISO 8601 text, or epoch numbers in the unit their
size says (as Feast's clients and pandas users send seconds, milliseconds or nanoseconds alike).

- text: ``2024-05-01T10:00:00Z``, with an offset, with a space for the ``T``; naive means UTC;
- numbers: seconds below 10^11 (until the year 5138), then milliseconds below 10^14, then
  microseconds below 10^17, else nanoseconds (truncated to µs, as everywhere).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_UNITS = ((1e11, 1_000_000), (1e14, 1_000), (1e17, 1))  # (below, µs per unit)


def from_epoch(number: float) -> datetime:
    """An epoch number, its unit told by its size (see the module docstring)."""
    for below, micros in _UNITS:
        if abs(number) < below:
            return EPOCH + timedelta(microseconds=round(number * micros) if micros > 1 else int(number))
    return EPOCH + timedelta(microseconds=int(number) // 1000)


def parse_timestamp(value: object) -> datetime:
    """A UTC datetime from ISO 8601 text, an epoch number or a datetime; ValueError otherwise."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a timestamp")
    if isinstance(value, (int, float)):
        return from_epoch(value)
    if isinstance(value, str):
        parsed = datetime.fromisoformat(value.strip())
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    raise ValueError(f"{value!r} is not a timestamp")


def epoch_column(numbers: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Epoch numbers as UTC µs timestamps, each in the unit its size says (``from_epoch``, at once
    for a column: a pushed DataFrame's integer or float times). ValueError for NaN or infinities."""
    numbers = numbers.combine_chunks() if isinstance(numbers, pa.ChunkedArray) else numbers
    valid = pc.is_valid(numbers).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(numbers.type):
        x = numbers.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
        if not np.isfinite(x).all():
            raise ValueError("an epoch time is NaN or infinite")
        size = np.abs(x)
        with np.errstate(invalid="ignore", over="ignore"):
            micros = np.select(
                [size < 1e11, size < 1e14, size < 1e17],
                [np.rint(x * 1e6), np.rint(x * 1e3), np.trunc(x)],
                np.trunc(x) // 1000,
            )
        if ((micros < _FIRST_US) | (micros > _LAST_US)).any():
            raise ValueError("an epoch time lies outside the years 1 to 9999")
        us = micros.astype(np.int64)
    else:
        x = numbers.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        size = np.abs(x)
        us = np.select([size < 10**11, size < 10**14, size < 10**17], [x * 1_000_000, x * 1_000, x], x // 1000)
        if ((us < _FIRST_US) | (us > _LAST_US)).any():
            raise ValueError("an epoch time lies outside the years 1 to 9999")
    return pa.array(us, pa.timestamp("us", tz="UTC"), mask=~valid)


def micros_column(times: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Nanosecond times as UTC µs, truncated to the µs at or before (as every path stores them:
    an entity at t+700 ns never sees a row stamped t+1 µs); Arrow's cast refuses, or rounds."""
    times = times.combine_chunks() if isinstance(times, pa.ChunkedArray) else times
    ns = times.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
    return pa.array(ns // 1000, pa.timestamp("us", tz="UTC"), mask=~pc.is_valid(times).to_numpy(zero_copy_only=False))


# the µs of datetime's range, as ``from_epoch`` takes it (a time past it is an OverflowError there)
_FIRST_US = (datetime.min.replace(tzinfo=UTC) - EPOCH) // timedelta(microseconds=1)
_LAST_US = (datetime.max.replace(tzinfo=UTC) - EPOCH) // timedelta(microseconds=1)
