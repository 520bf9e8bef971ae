"""Percentiles are nearest-rank over exactly the samples inside the time window, and a replica's
load is one record from the scheduler to the controller."""

from __future__ import annotations

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad, SlidingWindow, percentile

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


def test_sliding_window_drops_old_samples_and_honours_since():
    w = SlidingWindow(window_s=10.0)
    w.extend([1.0, 2.0], t=0.0)
    w.extend([3.0], t=5.0)
    w.extend([4.0, 5.0], t=9.0)
    assert w.values(now=9.0) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert w.values(now=12.0) == [3.0, 4.0, 5.0]  # t=0 fell out of [2, 12]
    assert w.values(now=12.0, since=6.0) == [4.0, 5.0]
    assert w.percentile(99, now=12.0) == 5.0
    assert w.values(now=100.0) == []
    assert len(w) == 0


def test_sliding_window_caps_samples():
    w = SlidingWindow(window_s=10.0, max_samples=3)
    w.extend([1.0, 2.0, 3.0, 4.0], t=0.0)
    assert w.values(now=0.0) == [2.0, 3.0, 4.0]


def test_replica_load_from_the_scheduler_and_the_replica():
    """The scheduler builds the record in O(1); the replica's intake and the reporter only
    complete it: the same type the controller, router and simulator read."""
    import dataclasses

    from replicas.config import EngineConfig
    from replicas.kv_cache import BlockManager
    from replicas.protocol import SamplingParams
    from replicas.request import Request
    from replicas.scheduler import Scheduler

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
    done = dataclasses.replace(load, replica_id="r1", tbt_samples=(0.02,), timestamp=5.0)
    assert done.tbt_samples == (0.02,) and done.timestamp == 5.0 and done.token_load == 800


def test_cluster_aggregates():
    a = ReplicaLoad("a", running_tokens=100, waiting_tokens=50, tbt_samples=(0.1,), timestamp=1.0)
    b = ReplicaLoad("b", running_tokens=10, waiting_tokens=0, timestamp=2.0)
    samples = [0.01] * 90 + [0.5] * 10
    snap = ClusterSnapshot.build({"a": a, "b": b}, samples, tbt_slo_s=0.1, timestamp=3.0)
    assert (snap.running_tokens, snap.waiting_tokens, snap.token_load) == (110, 50, 160)
    assert snap.tbt_p50_s == 0.01 and snap.tbt_p99_s == 0.5 and snap.num_tbt_samples == 100
    assert snap.tbt_slo_token_share == pytest.approx(0.9)
    empty = ClusterSnapshot.build({}, [], tbt_slo_s=0.1, timestamp=0.0)
    assert empty.tbt_p99_s is None and empty.tbt_slo_token_share is None and empty.token_load == 0
