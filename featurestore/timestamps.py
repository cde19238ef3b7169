"""Timestamps as clients send them over REST: ISO 8601 text, or epoch numbers in the unit their
size says (as Feast's clients and pandas users send seconds, milliseconds or nanoseconds alike).

- text: ``2024-05-01T10:00:00Z``, with an offset, with a space for the ``T``; naive means UTC;
- numbers: seconds below 10^11 (until the year 5138), then milliseconds below 10^14, then
  microseconds below 10^17, else nanoseconds (truncated to µs, as everywhere).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

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
