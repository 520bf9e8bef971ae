"""Percentiles are nearest-rank (exact over samples; within the histogram's 0.99% over a window of
TBT histograms, which covers whole time slices), and a replica's load is one record from the
scheduler to the controller."""

from __future__ import annotations

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad, ReportThrottle, TbtWindow, fleet_interval, percentile
from replicas.scheduling.histogram import RELATIVE_ERROR, LogHistogram

pytestmark = pytest.mark.unit


def test_percentile_nearest_rank():
    values = [float(i) for i in range(1, 101)]  # 1..100, shuffled order must not matter
    shuffled = values[::-1]
    assert percentile(shuffled, 50) == 50.0
    assert percentile(shuffled, 99) == 99.0
    assert percentile(shuffled, 100) == 100.0
    assert percentile(shuffled, 0) == 1.0
    assert percentile([0.3], 99) == 0.3
    assert percentile([], 99) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def close(got: float | None, exact: float) -> bool:
    return got is not None and abs(got - exact) <= RELATIVE_ERROR * exact


def test_tbt_window_merges_the_slices_that_overlap_the_window():
    w = TbtWindow(window_s=10.0, slice_s=1.0)
    w.add(LogHistogram.of([1.0, 2.0]), t=0.2)
    w.add(LogHistogram.of([3.0]), t=5.5)
    w.add(LogHistogram.of([4.0]), t=9.0)
    w.add(LogHistogram.of([5.0]), t=9.9)  # the same slice as t=9
    assert len(w) == 3 and w.histogram(now=9.9).count == 5
    assert w.histogram(now=10.5).count == 5  # window [0.5, 10.5] reaches into slice [0, 1)
    assert w.histogram(now=11.0).count == 3  # slice [0, 1) ended at the window's start
    assert len(w) == 2  # and is gone
    assert w.histogram(now=11.0, since=6.0).count == 2  # slices [9, 10) only
    assert w.histogram(now=11.0, since=5.9).count == 3  # [5, 6) overlaps since=5.9
    assert close(w.histogram(now=11.0).quantile(99), 5.0)
    assert w.histogram(now=100.0).count == 0 and len(w) == 0
    with pytest.raises(ValueError):
        TbtWindow(window_s=0.0)


def test_tbt_window_copies_what_it_is_given():
    w = TbtWindow(window_s=10.0)
    h = LogHistogram.of([0.1])
    w.add(h, t=0.0)
    w.add(LogHistogram.of([0.2]), t=0.5)
    assert h.count == 1 and w.histogram(now=1.0).count == 2


def test_throttle_heartbeat_when_unchanged_and_the_fleet_period():
    t = ReportThrottle(interval_s=0.1, min_interval_s=0.02, change_tokens=256, change_fraction=0.25,
                       heartbeat_s=1.0)
    assert t.due(0.1, 0, 100) and not t.due(0.5, 0, 100, changed=False) and t.due(1.0, 0, 100, changed=False)
    assert not t.due(0.15, 0, 100, fleet_interval_s=0.2) and t.due(0.2, 0, 100, fleet_interval_s=0.2)
    assert t.due(0.03, 1000, 100, fleet_interval_s=0.2)  # a jump still goes early
    assert fleet_interval(1000, 5000.0) == 0.2 and fleet_interval(100, 5000.0) == 0.02


def test_replica_load_from_the_scheduler_and_the_replica():
    """The scheduler builds the record in O(1); the replica's intake and the reporter only
    complete it: the same type the controller, router and simulator read."""
    import dataclasses

    from replicas.config import EngineConfig
    from replicas.scheduling.kv_cache import BlockManager
    from replicas.protocol import SamplingParams
    from replicas.request import Request
    from replicas.scheduling.scheduler import Scheduler

    sched = Scheduler(EngineConfig(max_batch_prefill_tokens=64), BlockManager(64, 16), clock=lambda: 0.0)
    for i, n in enumerate((300, 500)):
        sched.add(Request(str(i), list(range(n)), SamplingParams(max_tokens=4)))
    load = sched.load()
    assert (load.running_tokens, load.waiting_tokens, load.num_running, load.num_waiting) == (0, 800, 0, 2)
    batch = sched.schedule()  # 64 prompt tokens of request 0 start
    assert sched.advance(batch, [], now=1.0) == []  # a prompt chunk samples nothing
    load = sched.load()
    assert (load.running_tokens, load.waiting_tokens, load.free_kv_tokens) == (300, 500, 60 * 16)
    assert (load.num_running, load.num_waiting, load.token_load, load.kv_usage) == (1, 1, 800, 4 / 64)
    done = dataclasses.replace(load, replica_id="r1", tbt_histogram=LogHistogram.of([0.02]), timestamp=5.0)
    assert done.tbt_histogram.count == 1 and done.timestamp == 5.0 and done.token_load == 800


def test_cluster_aggregates():
    a = ReplicaLoad("a", running_tokens=100, waiting_tokens=50, timestamp=1.0)
    b = ReplicaLoad("b", running_tokens=10, waiting_tokens=0, timestamp=2.0)
    samples = [0.01] * 90 + [0.5] * 10
    snap = ClusterSnapshot.build({"a": a, "b": b}, LogHistogram.of(samples), tbt_slo_s=0.1, timestamp=3.0)
    assert (snap.running_tokens, snap.waiting_tokens, snap.token_load) == (110, 50, 160)
    assert close(snap.tbt_p50_s, 0.01) and close(snap.tbt_p99_s, 0.5) and snap.num_tbt_samples == 100
    assert snap.tbt_slo_token_share == pytest.approx(0.9)
    for empty in (ClusterSnapshot.build({}, LogHistogram(), tbt_slo_s=0.1, timestamp=0.0),
                  ClusterSnapshot.build({}, None, tbt_slo_s=0.1, timestamp=0.0)):
        assert empty.tbt_p99_s is None and empty.tbt_slo_token_share is None and empty.token_load == 0
        assert empty.num_tbt_samples == 0
