"""Percentiles are nearest-rank over exactly the samples inside the time window, and a replica's
load converts from the engine's `EngineLoad` (or its `load()` dict) without losing a field."""

from __future__ import annotations

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad, SlidingWindow, percentile


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


def test_from_engine_load_dataclass_and_dict():
    from replicas.engine import EngineLoad

    eng = EngineLoad(num_running=3, num_waiting=2, running_tokens=300, waiting_tokens=500,
                     free_blocks=10, total_blocks=64, block_size=16, kv_usage=0.84,
                     recent_tbt_s=[0.01, 0.02])
    r = ReplicaLoad.from_engine_load("r1", eng, timestamp=5.0, tbt_samples=[0.02])
    assert (r.running_tokens, r.waiting_tokens, r.token_load) == (300, 500, 800)
    assert (r.free_kv_tokens, r.kv_capacity_tokens, r.num_running, r.num_waiting) == (160, 1024, 3, 2)
    assert r.tbt_samples == (0.02,) and r.timestamp == 5.0 and r.kv_usage == 0.84
    # The replica's load() dict adds intake the engine snapshot has not seen yet.
    d = {"num_running": 3, "num_waiting": 2, "running_tokens": 300, "waiting_tokens": 500,
         "free_blocks": 10, "total_blocks": 64, "block_size": 16, "kv_usage": 0.84,
         "queued_tokens": 900, "num_queued": 4}
    r2 = ReplicaLoad.from_engine_load("r1", d, timestamp=5.0)
    assert (r2.waiting_tokens, r2.num_waiting) == (900, 4)


def test_round_trip_and_cluster_aggregates():
    a = ReplicaLoad("a", running_tokens=100, waiting_tokens=50, tbt_samples=(0.1,), timestamp=1.0)
    b = ReplicaLoad("b", running_tokens=10, waiting_tokens=0, timestamp=2.0)
    assert ReplicaLoad.from_dict(a.to_dict()) == a
    samples = [0.01] * 90 + [0.5] * 10
    snap = ClusterSnapshot.build({"a": a, "b": b}, samples, tbt_slo_s=0.1, timestamp=3.0)
    assert (snap.running_tokens, snap.waiting_tokens, snap.token_load) == (110, 50, 160)
    assert snap.tbt_p50_s == 0.01 and snap.tbt_p99_s == 0.5 and snap.num_tbt_samples == 100
    assert snap.slo_attainment == pytest.approx(0.9)
    assert ClusterSnapshot.from_dict(snap.to_dict()) == snap
    empty = ClusterSnapshot.build({}, [], tbt_slo_s=0.1, timestamp=0.0)
    assert empty.tbt_p99_s is None and empty.slo_attainment is None and empty.token_load == 0
