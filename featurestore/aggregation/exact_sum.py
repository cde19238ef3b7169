"""Exact float sums, rounded once, on both paths: the same bits online and offline.

Online (``fsum``) is ``math.fsum``; a tile summary keeps Shewchuk's partials (``partials``),
non-overlapping floats whose sum is exactly the tile's, so merging tiles rounds the same exact
sum. Offline (``float_sum``) scales each value by a power of two that makes every value of the
column an integer (``SumScale``, from a scan of the column), sums them as a 128-bit integer
and rounds once. A column whose nonzero magnitudes span too much for 128 bits falls back to
DuckDB's compensated ``fsum``. Non-finite values as IEEE 754: NaN, or both infinities, give
NaN; one infinity gives itself. A zero sum is +0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

_HUGE_BITS = 126  # a sum stays below 2^126: HUGEINT holds 2^127 - 1


def fsum(values: list[Any]) -> Any:
    """The exact sum, rounded once; exact for integers."""
    if not values or not isinstance(values[0], float):
        return sum(values)
    try:
        return math.fsum(values) + 0.0
    except ValueError:  # inf - inf
        return math.nan
    except OverflowError:  # a partial sum left the float range: exactly, then rounded (to +-inf if it must)
        total = sum(map(Fraction, values), Fraction(0))
        try:
            return float(total)
        except OverflowError:
            return math.inf if total > 0 else -math.inf


def partials(values: list[float]) -> list[float] | None:
    """Shewchuk's non-overlapping partials of ``values`` (their sum, exactly); None if a value is
    not finite or the sum overflows."""
    out: list[float] = []
    for x in values:
        if not math.isfinite(x):
            return None
        i = 0
        for y in out:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                out[i] = lo
                i += 1
            x = hi
        if not math.isfinite(x):
            return None
        out[i:] = [x]
    return out


@dataclass(frozen=True)
class SumScale:
    """How a float column is summed exactly: every value times ``2**-exponent`` is an integer and
    the sum of ``rows`` of them fits 126 bits; ``non_finite``: some value is NaN or infinite."""

    exponent: int
    non_finite: bool


def sum_scale(rows: int, low: float | None, high: float | None, non_finite: int) -> SumScale | None:
    """The scale for a scanned column (``aggregation.sql.scale_scan_sql``), or None when no power
    of two keeps its sums within 128 bits.

    ``floor(log2|x|)`` may be one too high just below a power of two: a value's last bit is worth
    at least ``2**(low - 53)``, and its magnitude is below ``2**(high + 1)``."""
    if low is None or high is None:  # only zeros, nulls or non-finite values
        return SumScale(0, bool(non_finite))
    exponent = max(int(low) - 53, -1074)
    if exponent < -1022 or int(high) + 1 - exponent + max(rows, 1).bit_length() > _HUGE_BITS:
        return None
    return SumScale(exponent, bool(non_finite))


def double_sql(value: float) -> str:
    return f"CAST('{value!r}' AS DOUBLE)"


def float_sum(double: str, scale: SumScale | None, over: str) -> str:
    """SQL: the sum of a DOUBLE expression over ``over`` (an OVER or FILTER clause): exact with
    ``scale``, else DuckDB's compensated ``fsum``."""
    if scale is None:  # magnitudes too far apart for 128 bits: compensated, not exact
        return f"fsum({double}) {over}"
    scaled = f"CAST({double} * {double_sql(2.0**-scale.exponent)} AS HUGEINT)"
    unscale = double_sql(2.0**scale.exponent)
    if not scale.non_finite:
        return f"CAST(sum({scaled}) {over} AS DOUBLE) * {unscale}"
    total = f"CAST(sum(CASE WHEN isfinite({double}) THEN {scaled} END) {over} AS DOUBLE) * {unscale}"
    nan, pinf, ninf = (
        f"count_if({test}) {over}"
        for test in (f"isnan({double})", f"{double} = 'inf'::DOUBLE", f"{double} = '-inf'::DOUBLE")
    )
    return (
        f"CASE WHEN {nan} > 0 OR ({pinf} > 0 AND {ninf} > 0) THEN 'NaN'::DOUBLE WHEN {pinf} > 0 THEN 'inf'::DOUBLE "
        f"WHEN {ninf} > 0 THEN '-inf'::DOUBLE ELSE {total} END"
    )
