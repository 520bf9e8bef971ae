"""A fixed-layout, mergeable histogram of positive values (TBT gaps, in seconds) with a stated
relative error.

Bins are log-spaced with ratio `GAMMA` = 1.02: bin i (1 <= i <= NUM_EDGES - 1) holds the values
in (EDGES[i-1], EDGES[i]], upper edge included as Prometheus's `le` buckets are. A value in a bin
is reported as the bin's representative 2 * EDGES[i] / (1 + GAMMA), which is within
RELATIVE_ERROR = (GAMMA - 1) / (GAMMA + 1) (0.99%) of every value in that bin. So
`quantile(q)`, which finds the bin of the exact nearest-rank sample (the counts are exact), is
within 0.99% of `autoscale.load.percentile` over the same values.

Bin 0 is the underflow, (0, LOWEST]: reported as LOWEST (an upper bound). Bin OVERFLOW holds
values above HIGHEST: reported as HIGHEST (a lower bound). Between them the error bound holds.

Every histogram shares the one layout, so two merge by adding counts (a window of time slices, a
fleet of replicas) and one leaves by subtracting them. The counts are a sparse {bin: count} dict:
a replica's report of ~100 gaps carries a few dozen bins, however many gaps it had. Where many
histograms are summed (a window's time slices) a dense list of NUM_BINS counts is quicker to add
to (`add_to_dense`, `from_dense`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping

__all__ = ["EDGES", "GAMMA", "HIGHEST", "LOWEST", "NUM_BINS", "OVERFLOW", "RELATIVE_ERROR", "LogHistogram",
           "bin_index", "edge_subset"]

GAMMA = 1.02  # ratio of a bin's upper edge to its lower edge
RELATIVE_ERROR = (GAMMA - 1) / (GAMMA + 1)  # of a reported quantile, against the exact one
LOWEST = 1e-5  # seconds: the underflow bin's upper edge
_NUM_BINS = math.ceil(math.log(1e3 / LOWEST) / math.log(GAMMA))  # log bins from 10 us to >= 1000 s
EDGES: tuple[float, ...] = tuple(LOWEST * GAMMA ** i for i in range(_NUM_BINS + 1))
HIGHEST = EDGES[-1]  # the last bin's upper edge; above it: overflow
OVERFLOW = len(EDGES)  # the overflow bin's index
NUM_BINS = OVERFLOW + 1  # underflow, the log bins, overflow
_REPRESENTATIVE = tuple([LOWEST] + [2.0 * e / (1.0 + GAMMA) for e in EDGES[1:]] + [HIGHEST])
_INV_LOG_GAMMA = 1.0 / math.log(GAMMA)


def bin_index(x: float) -> int:
    """The bin holding `x`: 0 for x <= LOWEST, OVERFLOW for x > HIGHEST, else i with
    EDGES[i-1] < x <= EDGES[i] (checked against the edges, so a float log never misplaces it)."""
    if x <= LOWEST:
        return 0
    if x > HIGHEST:
        return OVERFLOW
    i = min(math.ceil(math.log(x / LOWEST) * _INV_LOG_GAMMA), OVERFLOW - 1)
    if x > EDGES[i]:
        return i + 1
    if x <= EDGES[i - 1]:
        return i - 1
    return i


def edge_subset(low: float, high: float, every: int) -> tuple[float, ...]:
    """Every `every`-th bin edge from the first >= `low` to the last <= `high`: bucket bounds that
    are bin edges, so a cumulative bucket `le` one of them counts exactly what `count_le` does."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    start = bisect.bisect_left(EDGES, low)
    return tuple(e for e in EDGES[start::every] if e <= high)


class LogHistogram:
    """Counts of values per log bin (see the module doc); mutable, merged in place."""

    __slots__ = ("counts", "count")

    def __init__(self, counts: Mapping[int, int] | None = None) -> None:
        self.counts: dict[int, int] = {b: c for b, c in (counts or {}).items() if c}
        self.count = sum(self.counts.values())  # values held

    @classmethod
    def of(cls, values: Iterable[float]) -> LogHistogram:
        h = cls()
        h.add_many(values)
        return h

    @classmethod
    def from_dense(cls, dense: list[int]) -> LogHistogram:
        """From NUM_BINS counts indexed by bin."""
        return cls({b: c for b, c in enumerate(dense) if c})

    def add_to_dense(self, dense: list[int]) -> None:
        """Add these counts to a list of NUM_BINS counts indexed by bin."""
        for b, c in self.counts.items():
            dense[b] += c

    def __reduce__(self) -> tuple[Callable[[dict[int, int]], LogHistogram], tuple[dict[int, int]]]:
        return _unpickle, (self.counts,)  # pickled as its sparse counts only

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogHistogram) and self.counts == other.counts

    def __repr__(self) -> str:
        return f"LogHistogram(count={self.count}, bins={len(self.counts)})"

    def __bool__(self) -> bool:
        return self.count > 0

    def copy(self) -> LogHistogram:
        h = LogHistogram()
        h.counts, h.count = dict(self.counts), self.count
        return h

    __copy__ = copy  # its own counts (copy.copy would go through __reduce__, which shares them)

    def add(self, x: float) -> None:
        b = bin_index(x)
        self.counts[b] = self.counts.get(b, 0) + 1
        self.count += 1

    def add_many(self, values: Iterable[float]) -> None:
        counts, n = self.counts, 0
        for x in values:
            b = bin_index(x)
            counts[b] = counts.get(b, 0) + 1
            n += 1
        self.count += n

    def merge(self, other: LogHistogram) -> None:
        """Add `other`'s counts to these."""
        counts = self.counts
        for b, c in other.counts.items():
            counts[b] = counts.get(b, 0) + c
        self.count += other.count

    def subtract(self, other: LogHistogram) -> None:
        """Take `other`'s counts out of these (`other` must have been merged in)."""
        counts = self.counts
        for b, c in other.counts.items():
            left = counts.get(b, 0) - c
            if left < 0:
                raise ValueError(f"bin {b}: subtracting {c} from {left + c}")
            if left:
                counts[b] = left
            else:
                del counts[b]
        self.count -= other.count

    def quantile(self, q: float) -> float | None:
        """Nearest-rank percentile (q in [0, 100], as `autoscale.load.percentile`) within
        RELATIVE_ERROR; None when empty."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Iterable[float]) -> list[float | None]:
        """Several percentiles in one walk over the bins."""
        qs = list(qs)
        for q in qs:
            if not 0.0 <= q <= 100.0:
                raise ValueError(f"q must be in [0, 100], got {q}")
        if not self.count:
            return [None] * len(qs)
        ranks = sorted((max(1, math.ceil(q / 100.0 * self.count)), k) for k, q in enumerate(qs))
        out: list[float | None] = [None] * len(qs)
        bins = iter(sorted(self.counts.items()))
        seen, b = 0, -1
        for rank, k in ranks:
            while seen < rank:
                b, c = next(bins)
                seen += c
            out[k] = _REPRESENTATIVE[b]
        return out

    def count_le(self, x: float) -> int:
        """Values in bins whose upper edge is <= x: exact when x is a bin edge; otherwise the
        values in (x / GAMMA, x] may be counted as above x (never one above x as below it)."""
        b = bin_index(x)
        if b == OVERFLOW or x < EDGES[min(b, OVERFLOW - 1)]:
            b -= 1  # x's own bin reaches above x
        return sum(c for i, c in self.counts.items() if i <= b)


def _unpickle(counts: dict[int, int]) -> LogHistogram:
    """A pickled `LogHistogram` back: its counts as they were (no zeros to drop), without
    `__init__`'s copy of them (most of the cost of unpickling one)."""
    h = LogHistogram.__new__(LogHistogram)
    h.counts, h.count = counts, sum(counts.values())
    return h
