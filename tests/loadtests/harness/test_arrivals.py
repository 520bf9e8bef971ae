"""One definition of each arrival process, seeded: the same seed gives the same schedule to the
benchmarks, the load tests and the simulator. Also the loadtests' shared statistics and
metrics-text reader, each written once."""

from __future__ import annotations

import numpy as np
import pytest

import autoscale.load
from loadtests.harness import arrivals, metrics_text, stats

pytestmark = pytest.mark.unit


def test_poisson_is_exponential_gaps_at_the_rate() -> None:
    times = arrivals.poisson(np.random.default_rng(0), 5000, rate=4.0)
    assert all(b > a for a, b in zip(times, times[1:]))
    assert abs(len(times) / times[-1] - 4.0) < 0.2
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential gaps: CV = 1
    # The schedule is the seed's exponential draws at mean 1/rate, summed, after start_s.
    want = 2.0 + np.cumsum(np.random.default_rng(7).exponential(0.25, 10))
    assert arrivals.poisson(np.random.default_rng(7), 10, 4.0, start_s=2.0).tolist() == want.tolist()
    with pytest.raises(ValueError, match="rate"):
        arrivals.poisson(np.random.default_rng(0), 3, 0.0)


def test_poisson_window_is_seeded_and_inside_the_window() -> None:
    a, b = arrivals.poisson_window(20.0, 30.0, 1), arrivals.poisson_window(20.0, 30.0, 1)
    assert a == b and a != arrivals.poisson_window(20.0, 30.0, 2)
    assert all(0 <= t < 30.0 for t in a) and 450 < len(a) < 750
    # The window's arrivals are the first of the seed's unbounded schedule.
    assert a == arrivals.poisson(np.random.default_rng(1), len(a), 20.0).tolist()


def test_bursty_keeps_the_mean_rate_with_a_larger_spread() -> None:
    t = arrivals.bursty(np.random.default_rng(0), 20_000, rate=5.0, cv=3.0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.2, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_stats_use_the_servers_percentile() -> None:
    assert stats.percentile is autoscale.load.percentile  # p99 is an observed sample, as the server's
    assert stats.percentile([0.5, 0.1, 0.3, 0.9, 0.7], 99) == 0.9
    assert stats.spread([0.001] * 99 + [0.4]) == {"p50_s": 0.001, "p99_s": 0.001, "max_s": 0.4}
    assert stats.spread([]) == {"p50_s": None, "p99_s": None, "max_s": None}


def test_metrics_text_reads_names_labels_and_values() -> None:
    text = ("# HELP ray_x a counter\n# TYPE ray_x counter\n"
            'ray_x{replica="a",deployment="LLMServer",msg="say \\"hi\\""} 3.0 1700000000000\n'
            "ray_y 2.5\n\n  ray_x{replica=\"b\"} 1e3\n")
    assert list(metrics_text.samples(text)) == [
        ("ray_x", {"replica": "a", "deployment": "LLMServer", "msg": 'say \\"hi\\"'}, 3.0),
        ("ray_y", {}, 2.5), ("ray_x", {"replica": "b"}, 1000.0)]
    assert [v for _, _, v in metrics_text.samples(text, ("ray_y",))] == [2.5]
