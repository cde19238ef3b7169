"""Largest-Triangle-Three-Buckets downsampling: a million-point curve as a few hundred points
that keep its shape (first and last points, spikes and dips)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lttb(x: Sequence[float], y: Sequence[float], points: int) -> tuple[np.ndarray, np.ndarray]:
    """Largest-Triangle-Three-Buckets (Steinarsson 2013): ``points`` of the series, first and last
    kept; from each bucket between them, the point making the largest triangle with the point kept
    before it and the mean of the next bucket."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(xs)
    if points >= n or points < 3:
        return xs, ys
    every = (n - 2) / (points - 2)  # points - 2 buckets over the interior
    keep = [0]
    for b in range(points - 2):
        lo, hi = int(b * every) + 1, int((b + 1) * every) + 1
        nxt_lo, nxt_hi = hi, min(int((b + 2) * every) + 1, n)
        next_x, next_y = xs[nxt_lo:nxt_hi].mean(), ys[nxt_lo:nxt_hi].mean()
        ax, ay = xs[keep[-1]], ys[keep[-1]]
        area = np.abs((ax - next_x) * (ys[lo:hi] - ay) - (ax - xs[lo:hi]) * (next_y - ay))
        keep.append(lo + int(np.argmax(area)))
    keep.append(n - 1)
    return xs[keep], ys[keep]
