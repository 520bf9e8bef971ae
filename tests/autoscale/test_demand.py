"""Served and refused demand become rates over the part of the window asked for; sources report
monotone counters, their first value is a baseline, not a burst."""

from __future__ import annotations

import pytest

from autoscale.demand import REPORT_EVERY_S, DemandCounter, DemandCounts, DemandLog

pytestmark = pytest.mark.unit


def test_rates_over_the_window_and_since_a_change():
    log = DemandLog(window_s=10.0)
    for t in range(1, 11):  # 1,000 tokens served and 500 refused every second for 10 s
        log.add(float(t), served=1000, refused=500)
    assert log.rates(10.0) == (1000.0, 500.0)
    assert log.rates(10.0, since=6.0) == (1000.0, 500.0)  # ticks 7..10 over (6, 10]
    log.add(12.0, served=1000)
    served, refused = log.rates(12.0)  # window (2, 12]: ticks 3..10 and 12
    assert (served, refused) == (900.0, 400.0)
    assert log.rates(12.0, since=12.0) == (0.0, 0.0)  # no time yet since the change


def test_source_counters_add_their_growth_and_start_from_a_baseline():
    log = DemandLog(window_s=60.0, start_t=100.0)
    log.report("ingress-a", 100.0, DemandCounts(50_000, 50, 9_000))  # its past: a baseline
    log.report("door", 100.0, DemandCounts())
    assert log.rates(101.0) == (0.0, 0.0)
    log.report("ingress-a", 102.0, DemandCounts(52_000, 52, 9_000))
    log.report("ingress-a", 104.0, DemandCounts(55_000, 55, 10_000))
    assert log.rates(104.0) == (5_000 / 4, 1_000 / 4)  # only since the log began
    log.forget("ingress-a")
    log.report("ingress-a", 105.0, DemandCounts(1_000, 1))  # a new baseline
    assert log.rates(105.0) == (5_000 / 5, 1_000 / 5)
    with pytest.raises(ValueError, match="window_s"):
        DemandLog(window_s=0)


def test_refusals_of_unknown_size_count_at_the_mean_served_request():
    log = DemandLog(window_s=10.0)
    log.add(1.0, counts=DemandCounts(served_tokens=3_000, served_requests=3))  # 1,000 tokens each
    log.report("door", 1.0, DemandCounts())
    log.report("door", 2.0, DemandCounts(refused_unsized=4))
    assert log.rates(2.0) == (1_500.0, 2_000.0)  # 3,000 and 4 x 1,000 tokens over 2 s
    # The mean outlives the window's served requests: refusals alone still have a size.
    log.add(20.0, counts=DemandCounts(refused_unsized=10))
    assert log.rates(20.0) == (0.0, 1_000.0)
    assert DemandCounts(5, 1, 2, 3) - DemandCounts(1, 1, 1, 1) == DemandCounts(4, 0, 1, 2)
    assert not DemandCounts() and DemandCounts(refused_unsized=1)


def test_a_source_counts_and_sends_only_what_moved_at_most_every_second():
    counter = DemandCounter()
    assert counter.to_send(0.0) == DemandCounts()  # the baseline goes at once
    assert counter.to_send(5.0) is None  # nothing moved
    counter.served(1_200)
    counter.refused(800)
    counter.refused()  # the size was never read
    assert counter.to_send(5.0 + REPORT_EVERY_S / 2) == DemandCounts(1_200, 1, 800, 1)
    counter.served(100)
    assert counter.to_send(5.0 + REPORT_EVERY_S) is None  # within a second of the last
    assert counter.to_send(5.0 + 2 * REPORT_EVERY_S) == DemandCounts(1_300, 2, 800, 1)


def test_a_clients_retries_count_once():
    """A request refused twice, then served on the client's third try, is demand once, served; one
    refused on every try is demand once, refused. Retries that do not say so count again."""
    counter, log = DemandCounter(), DemandLog(window_s=10.0)
    log.report("ingress", 0.0, counter.to_send(0.0))  # the baseline
    counter.refused(1_000)
    counter.refused(1_000, retry=True)
    counter.served(1_000, retry=True)
    for _ in range(3):  # another, refused on each of its tries
        counter.refused(500, retry=_ > 0)
    counter.refused(200)
    counter.refused(200)  # a client that retried without saying so
    log.report("ingress", 2.0, counter.to_send(2.0))
    assert counter.counts.retried_tokens == 3_000
    assert log.rates(2.0) == (500.0, (500 + 400) / 2)
    # A window holding a retry but not the refusal it retries: never below no refusals.
    log.add(20.0, counts=DemandCounts(served_tokens=100, served_requests=1, retried_tokens=100))
    assert log.rates(20.0, since=19.0) == (100.0, 0.0)
