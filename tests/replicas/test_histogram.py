"""A TBT histogram reports any nearest-rank percentile within 1% of the exact one (its counts
are exact; only the value inside a 2%-wide bin is approximated), merges and unmerges by counts,
and pickles small."""

from __future__ import annotations

import math
import copy
import pickle
import random

import pytest

from autoscale.load import percentile
from replicas.scheduling.histogram import (EDGES, GAMMA, HIGHEST, LOWEST, OVERFLOW, RELATIVE_ERROR, LogHistogram,
                                bin_index, edge_subset)

pytestmark = pytest.mark.unit


def heavy_tailed_gaps(n: int, seed: int = 7) -> list[float]:
    """Decode gaps as a loaded replica makes them: a lognormal body around 25 ms, 3% prefill
    hiccups of 2-5x, and a Pareto tail (alpha 1.5) of stalls from 100 ms up to seconds."""
    rng = random.Random(seed)
    gaps = []
    for _ in range(n):
        u = rng.random()
        if u < 0.01:
            gaps.append(0.1 * rng.paretovariate(1.5))
        elif u < 0.04:
            gaps.append(rng.lognormvariate(math.log(0.025), 0.2) * rng.uniform(2.0, 5.0))
        else:
            gaps.append(rng.lognormvariate(math.log(0.025), 0.3))
    return gaps


def test_the_stated_error_is_under_one_percent():
    assert RELATIVE_ERROR < 0.01 and GAMMA == 1.02
    assert len(EDGES) < 1000 and LOWEST <= 1e-5 and HIGHEST >= 1e3


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_percentiles_within_one_percent_of_nearest_rank_on_a_heavy_tailed_trace(seed: int):
    gaps = heavy_tailed_gaps(50_000, seed)
    hist = LogHistogram.of(gaps)
    assert hist.count == len(gaps)
    for q in (0, 1, 10, 50, 90, 99, 99.5, 99.9, 99.99, 100):
        exact = percentile(gaps, q)
        got = hist.quantile(q)
        assert abs(got - exact) / exact <= RELATIVE_ERROR + 1e-12, (q, got, exact)
    assert hist.quantiles([50, 99]) == [hist.quantile(50), hist.quantile(99)]


def test_bins_hold_what_their_edges_say():
    rng = random.Random(0)
    for x in [rng.uniform(LOWEST, 10.0) for _ in range(2000)] + list(EDGES[1:50]) + list(EDGES[-3:]):
        i = bin_index(x)
        assert 1 <= i < OVERFLOW and EDGES[i - 1] < x <= EDGES[i]
    assert bin_index(0.0) == bin_index(LOWEST) == 0 and bin_index(-1.0) == 0
    assert bin_index(HIGHEST * 1.0001) == bin_index(math.inf) == OVERFLOW


def test_underflow_and_overflow_report_their_bound():
    hist = LogHistogram.of([1e-7, 0.0, 5e3, 2e4])
    assert hist.counts == {0: 2, OVERFLOW: 2}
    assert hist.quantile(50) == LOWEST  # at most this
    assert hist.quantile(100) == HIGHEST  # at least this
    assert hist.count_le(LOWEST) == 2 and hist.count_le(HIGHEST) == 2


def test_merge_and_subtract_are_exact():
    gaps = heavy_tailed_gaps(3000)
    whole = LogHistogram.of(gaps)
    parts = [LogHistogram.of(gaps[k:k + 700]) for k in range(0, len(gaps), 700)]
    merged = LogHistogram()
    for p in parts:
        merged.merge(p)
    assert merged == whole and merged.count == 3000
    merged.subtract(parts[0])
    assert merged == LogHistogram.of(gaps[700:]) and merged.count == 2300
    with pytest.raises(ValueError):
        merged.subtract(parts[0])  # already out
    assert all(c > 0 for c in merged.counts.values())  # emptied bins leave


def test_count_le_is_exact_at_edges_and_never_counts_above():
    gaps = heavy_tailed_gaps(5000)
    hist = LogHistogram.of(gaps)
    for edge in edge_subset(1e-3, 10.0, 24):
        assert hist.count_le(edge) == sum(1 for g in gaps if g <= edge)
    for slo in (0.015, 0.05, 0.1, 0.2):  # not edges: a lower bound, short by one bin at most
        exact = sum(1 for g in gaps if g <= slo)
        assert sum(1 for g in gaps if g <= slo / GAMMA) <= hist.count_le(slo) <= exact


def test_edge_subset_is_every_nth_edge_in_range():
    sub = edge_subset(1e-3, 80.0, 24)
    assert sub[0] >= 1e-3 and sub[0] / GAMMA < 1e-3 and sub[-1] <= 80.0
    steps = {round(b / a, 9) for a, b in zip(sub, sub[1:])}
    assert steps == {round(GAMMA ** 24, 9)} and all(e in EDGES for e in sub)
    with pytest.raises(ValueError):
        edge_subset(1e-3, 1.0, 0)


def test_pickles_as_a_few_sparse_bins():
    gaps = heavy_tailed_gaps(100)  # one report's worth
    hist = LogHistogram.of(gaps)
    blob = pickle.dumps(hist)
    back = pickle.loads(blob)
    assert back == hist and back.count == 100 and back.quantiles((50, 99)) == hist.quantiles((50, 99))
    back.add(0.5)
    assert back.count == 101 and hist.count == 100  # its own counts
    twin = copy.copy(hist)
    twin.add(0.5)
    assert twin.count == 101 and hist.count == 100 and sum(hist.counts.values()) == 100
    assert len(blob) < len(pickle.dumps(tuple(gaps))) and len(blob) < 600
    assert LogHistogram().quantile(99) is None and not LogHistogram()
    with pytest.raises(ValueError):
        hist.quantile(101)
