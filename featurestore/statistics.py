"""Feature statistics (issue #30): what the values of a feature are, per time bucket, mergeable.

A ``Summary`` of one column holds exact figures (rows, nulls, NaN, min, max, mean and the sum of
squared deviations, merged by Chan's parallel formula) and a sketch: Apache DataSketches' KLL for
numbers (quantiles and histograms within its documented rank error, ``RANK_ERROR``), its
frequent-items sketch for text, booleans and keys (the top values and their counts). Summaries of
buckets merge into the summary of their union, so a year of hourly buckets is read as one.

``summarize`` cuts a table into time buckets and summarizes each column; ``to_table`` /
``from_table`` are the rows the stores keep (one per bucket and column, sketches serialized).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

import datasketches as ds
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KLL_K = 200  # KLL's accuracy parameter: rank error about 1.3 % (two-sided, 99 % confidence)
RANK_ERROR = ds.kll_doubles_sketch.get_normalized_rank_error(KLL_K, False)
TOP_MAP = 7  # frequent items: a map of 2**7 counters, exact for up to 96 distinct values
TOP_FED = 64  # a bucket's most frequent values fed to it: a value's count is exact when it is among
# the 64 most frequent of every bucket it appears in, else a lower bound (the tail is only counted)
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)

Kind = Literal["number", "text"]
K = TypeVar("K")

STATISTICS_SCHEMA = pa.schema(
    [
        pa.field("bucket", pa.timestamp("us", tz="UTC")),  # start of the time bucket the rows fall in
        pa.field("feature", pa.string()),
        pa.field("kind", pa.string()),  # number | text
        pa.field("rows", pa.int64()),
        pa.field("nulls", pa.int64()),
        pa.field("nans", pa.int64()),
        pa.field("min", pa.float64()),  # over non-NaN values (±inf included); null without any
        pa.field("max", pa.float64()),
        pa.field("finite", pa.int64()),  # finite values, which mean and m2 are over
        pa.field("mean", pa.float64()),
        pa.field("m2", pa.float64()),  # sum of squared deviations from the mean
        pa.field("sketch", pa.binary()),  # KLL (numbers) or frequent items (text), serialized
    ]
)


@dataclass
class Summary:
    """One column's values in one bucket (or a merge of buckets)."""

    kind: Kind
    rows: int = 0
    nulls: int = 0
    nans: int = 0
    min: float | None = None
    max: float | None = None
    finite: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sketch: ds.kll_doubles_sketch | ds.frequent_strings_sketch | None = field(default=None, repr=False)

    @property
    def null_rate(self) -> float:
        return self.nulls / self.rows if self.rows else 0.0

    @property
    def stddev(self) -> float | None:
        """Population standard deviation of the finite values."""
        return math.sqrt(self.m2 / self.finite) if self.finite else None

    def merge(self, other: Summary, in_place: bool = False) -> Summary:
        """The summary of both: a new one, or with ``in_place`` this one (``other`` never changes)."""
        if other.kind != self.kind:
            raise ValueError(f"cannot merge a {other.kind} summary into a {self.kind} one")
        n = self.finite + other.finite
        if not self.finite or not other.finite:  # (no arithmetic: an empty side's mean is no value)
            mean, m2 = (other.mean, other.m2) if other.finite else (self.mean, self.m2)
        else:
            delta = other.mean - self.mean
            mean = self.mean + delta * other.finite / n
            m2 = self.m2 + other.m2 + delta * delta * self.finite * other.finite / n
        target = self if in_place else Summary(self.kind, sketch=_copy(self.sketch))
        if target.sketch is None:
            target.sketch = _copy(other.sketch)
        elif other.sketch is not None:
            target.sketch.merge(other.sketch)
        target.rows, target.nulls, target.nans = (
            self.rows + other.rows,
            self.nulls + other.nulls,
            self.nans + other.nans,
        )
        target.min, target.max = _pick(min, self.min, other.min), _pick(max, self.max, other.max)
        target.finite, target.mean, target.m2 = n, mean, m2
        return target

    def quantiles(self, ranks: Sequence[float]) -> list[float]:
        """Values at the normalized ``ranks`` (numbers only; within ``RANK_ERROR`` in rank)."""
        if not isinstance(self.sketch, ds.kll_doubles_sketch) or self.sketch.is_empty():
            return []
        return [float(self.sketch.get_quantile(r)) for r in ranks]

    def histogram(self, edges: Sequence[float]) -> list[float]:
        """Estimated counts of non-NaN values in the bins cut at ``edges`` (len(edges) + 1 bins:
        below the first edge, from each edge up to the next, from the last on)."""
        if not isinstance(self.sketch, ds.kll_doubles_sketch) or self.sketch.is_empty():
            return [0.0] * (len(edges) + 1)
        shares = self.sketch.get_pmf(sorted(set(edges)), False)  # False: an edge's value counts in the bin it starts
        return [s * self.sketch.n for s in shares]

    def top(self, k: int = 10) -> list[tuple[str, int]]:
        """The most frequent values (text) and their estimated counts, most frequent first."""
        if not isinstance(self.sketch, ds.frequent_strings_sketch):
            return []
        items = self.sketch.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES)
        return [(item, int(estimate)) for item, estimate, *_ in items[:k]]

    def counts(self, categories: Sequence[str]) -> list[float]:
        """Estimated count of each of ``categories`` (text), then of every other value."""
        if not isinstance(self.sketch, ds.frequent_strings_sketch):
            return [0.0] * (len(categories) + 1)
        found = [float(self.sketch.get_estimate(c)) for c in categories]
        return [*found, max(self.rows - self.nulls - sum(found), 0.0)]


def kind_of(dtype: pa.DataType) -> Kind:
    """Numbers are summarized by quantiles, everything else (text, booleans, keys) by its top values."""
    return "number" if pa.types.is_floating(dtype) or pa.types.is_integer(dtype) else "text"


def summarize_column(values: pa.Array | pa.ChunkedArray, kind: Kind | None = None) -> Summary:
    """The summary of one column's values."""
    kind = kind or kind_of(values.type)
    rows, nulls = len(values), values.null_count
    if kind == "text":
        sketch = ds.frequent_strings_sketch(TOP_MAP)
        counted = pc.value_counts(pc.drop_null(values).cast(pa.string()))
        if len(counted) > TOP_FED:  # (the rest, the long tail, counts in ``rows`` only)
            counts = counted.field("counts").to_numpy()
            counted = counted.take(pa.array(np.argpartition(-counts, TOP_FED)[:TOP_FED]))
        for value, count in zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist(), strict=True):
            sketch.update(value, count)
        return Summary("text", rows, nulls, sketch=sketch)
    x = pc.drop_null(values).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    nan = np.isnan(x)
    real = x[~nan]
    finite = real[np.isfinite(real)]
    sketch = ds.kll_doubles_sketch(KLL_K)
    if real.size:
        sketch.update(real)
    with np.errstate(over="ignore"):  # (values near float64's limit: their mean or spread is infinite, as it is)
        mean = float(finite.mean()) if finite.size else 0.0
        m2 = float(((finite - mean) ** 2).sum()) if finite.size else 0.0
    return Summary(
        "number",
        rows,
        nulls,
        int(nan.sum()),
        float(real.min()) if real.size else None,
        float(real.max()) if real.size else None,
        int(finite.size),
        mean,
        m2,
        sketch,
    )


def bucket_start(at: datetime, width: timedelta) -> datetime:
    """The start of the bucket of ``width`` (a whole number of seconds) holding ``at``."""
    seconds = int(width.total_seconds())
    epoch = int(at.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, UTC)


def summarize(
    table: pa.Table, columns: Iterable[str], time_column: str, width: timedelta, kinds: dict[str, Kind] | None = None
) -> pa.Table:
    """Rows of ``STATISTICS_SCHEMA``: each of ``columns`` summarized per bucket of ``time_column``
    (``kinds``: a column's kind other than its type's, e.g. text for an integer key)."""
    kinds = kinds or {}
    if table.num_rows == 0:
        return STATISTICS_SCHEMA.empty_table()
    columns = list(columns)
    micros = pc.cast(table[time_column], pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_numpy(zero_copy_only=False)
    step = int(width.total_seconds()) * 1_000_000
    buckets = micros - micros % step
    ordered = table.select(columns)
    if buckets.min() != buckets.max():  # (a history file holds one day: no sorting)
        order = np.argsort(buckets, kind="stable")
        ordered, buckets = ordered.take(pa.array(order)), buckets[order]
    starts = np.flatnonzero(np.diff(buckets, prepend=buckets[0] - 1))
    found: list[tuple[datetime, str, Summary]] = []
    for start, stop in zip(starts, [*starts[1:], len(buckets)], strict=True):
        part = ordered.slice(start, stop - start)
        at = datetime.fromtimestamp(int(buckets[start]) // 1_000_000, UTC)
        found += [(at, name, summarize_column(part[name], kinds.get(name))) for name in columns]
    return to_table(found)


def to_table(found: Iterable[tuple[datetime, str, Summary]]) -> pa.Table:
    rows = [
        {
            "bucket": at,
            "feature": name,
            "kind": s.kind,
            "rows": s.rows,
            "nulls": s.nulls,
            "nans": s.nans,
            "min": s.min,
            "max": s.max,
            "finite": s.finite,
            "mean": s.mean,
            "m2": s.m2,
            "sketch": s.sketch.serialize() if s.sketch is not None else None,
        }
        for at, name, s in found
    ]
    return pa.Table.from_pylist(rows, schema=STATISTICS_SCHEMA)


def from_table(table: pa.Table) -> list[tuple[datetime, str, Summary]]:
    """``to_table``'s rows read back."""
    found = []
    for row in table.select(STATISTICS_SCHEMA.names).to_pylist():
        kind: Kind = row["kind"]
        blob = row["sketch"]
        sketch: ds.kll_doubles_sketch | ds.frequent_strings_sketch | None = None
        if blob is not None:
            sketch = (
                ds.kll_doubles_sketch.deserialize(blob)
                if kind == "number"
                else ds.frequent_strings_sketch.deserialize(blob)
            )
        summary = Summary(
            kind,
            row["rows"],
            row["nulls"],
            row["nans"],
            row["min"],
            row["max"],
            row["finite"],
            row["mean"],
            row["m2"],
            sketch,
        )
        found.append((row["bucket"], row["feature"], summary))
    return found


def merged(found: Iterable[tuple[datetime, str, Summary]]) -> dict[str, Summary]:
    """Each feature's summaries over all buckets, merged."""
    return merged_by((name, s) for _, name, s in found)


def merged_by(pairs: Iterable[tuple[K, Summary]]) -> dict[K, Summary]:
    """The summaries of each key merged (the ones given are not changed)."""
    out: dict[K, Summary] = {}
    for key, s in pairs:
        out[key] = out[key].merge(s, in_place=True) if key in out else s.merge(Summary(s.kind))
    return out


def _pick(choose: Callable[[float, float], float], a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else choose(a, b)


def _copy(sketch: Any) -> Any:
    return type(sketch).deserialize(sketch.serialize()) if sketch is not None else None
