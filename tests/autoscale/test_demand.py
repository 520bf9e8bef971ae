"""Served and refused demand become rates over the part of the window asked for; sources report
monotone counters, their first value is a baseline, not a burst."""

from __future__ import annotations

import pytest

from autoscale.demand import DemandLog

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
    log.report("replica-a", 100.0, served_total=50_000, refused_total=9_000)  # its past: a baseline
    log.report("door", 100.0, served_total=0, refused_total=0)
    assert log.rates(101.0) == (0.0, 0.0)
    log.report("replica-a", 102.0, served_total=52_000, refused_total=9_000)
    log.report("door", 102.0, served_total=0, refused_total=4_000)
    log.report("replica-a", 104.0, served_total=55_000, refused_total=10_000)
    assert log.rates(104.0) == (5_000 / 4, 5_000 / 4)  # only since the log began
    log.forget("replica-a")
    log.report("replica-a", 105.0, served_total=1_000, refused_total=0)  # a new baseline
    assert log.rates(105.0) == (1_000.0, 1_000.0)
    with pytest.raises(ValueError, match="window_s"):
        DemandLog(window_s=0)
