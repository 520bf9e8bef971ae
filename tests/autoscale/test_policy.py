"""The Serve policy turns an AutoscalingContext into `decide_replicas` inputs (running replicas,
Serve's min/max, its state) and back, reading the controller snapshot or, failing that, the
replicas' `record_autoscaling_stats`; composed with Serve's own wrapper it scales immediately."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.request_router import ReplicaID

from autoscale.load import ClusterSnapshot, ReplicaLoad
from autoscale.policy import STATE_KEY, TbtSloPolicy, snapshot_from_metrics

pytestmark = pytest.mark.unit

DEP = DeploymentID(name="LLMServer", app_name="default")


def rid(i: int) -> ReplicaID:
    return ReplicaID(f"u{i}", deployment_id=DEP)


def ctx(current: int, target: int | None = None, state: dict | None = None, now: float = 100.0,
        metrics: dict | None = None, lo: int = 1, hi: int = 4) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, upscale_delay_s=0, downscale_delay_s=0)
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=current, target_num_replicas=current if target is None else target,
        running_replicas=[rid(i) for i in range(current)], total_num_requests=1.0,
        total_queued_requests=0.0, aggregated_metrics=metrics or {}, raw_metrics={},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config)


class Source:
    """Stands in for the controller; records what the policy asked for."""

    def __init__(self, snapshot: ClusterSnapshot | None) -> None:
        self.snapshot = snapshot
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, ids, window_s, since, slo):
        self.calls.append((ids, window_s, since, slo))
        return self.snapshot


def busy(p99: float) -> ClusterSnapshot:
    return ClusterSnapshot({"x": ReplicaLoad("x", running_tokens=500)}, p99, p99, 100, None, 100.0)


def test_breach_scales_up_and_state_round_trips():
    source = Source(busy(0.5))
    policy = TbtSloPolicy(snapshot_source=source, tbt_slo_s=0.1, window_s=20.0, upscale_cooldown_s=5.0)
    desired, state = policy(ctx(2))
    assert desired == 3 and state[STATE_KEY]["reason"] == "tbt_p99_over_slo"
    ids, window_s, since, slo = source.calls[0]
    assert ids == [f"SERVE_REPLICA::default#LLMServer#u{i}" for i in range(2)]
    assert (window_s, since, slo) == (20.0, 80.0, 0.1)
    # Next tick: the new replica is starting (target 3, running 2): hold, cool-down restarts.
    desired, state = policy(ctx(2, target=3, state=state, now=101.0))
    assert desired == 3 and state[STATE_KEY]["last_change_s"] == 101.0
    # Landed; the window for evidence now starts at the change, not 20 s back.
    policy(ctx(3, state=state, now=103.0))
    assert source.calls[-1][2] == 101.0


def test_serve_bounds_override_policy_kwargs():
    policy = TbtSloPolicy(snapshot_source=Source(busy(0.5)), tbt_slo_s=0.1, max_replicas=50)
    assert policy(ctx(2, hi=2))[0] == 2


def test_falls_back_to_autoscaling_stats_then_holds():
    metrics = {"tbt_p99_s": {rid(0): 0.05, rid(1): 0.3}, "tbt_p50_s": {rid(0): 0.01, rid(1): 0.02},
               "num_tbt_samples": {rid(0): 40.0, rid(1): 40.0},
               "running_tokens": {rid(0): 100.0, rid(1): 900.0}, "waiting_tokens": {rid(0): 0.0}}
    snap = snapshot_from_metrics(metrics)
    assert snap.tbt_p99_s == 0.3 and snap.num_tbt_samples == 80 and snap.running_tokens == 1000
    policy = TbtSloPolicy(snapshot_source=Source(None), tbt_slo_s=0.1)
    assert policy(ctx(2, metrics=metrics))[0] == 3
    desired, _ = policy(ctx(2, target=2, metrics={}))
    assert desired == 2 and policy.last_reason == "no_load_data"


def test_composes_with_serves_wrapper_without_extra_delay():
    policy = _apply_autoscaling_config(TbtSloPolicy(snapshot_source=Source(busy(0.5)), tbt_slo_s=0.1))
    desired, state = policy(ctx(1))
    assert desired == 2 and STATE_KEY in state
    idle = ClusterSnapshot({}, None, None, 0, None, 100.0)
    down = _apply_autoscaling_config(TbtSloPolicy(
        snapshot_source=Source(idle), tbt_slo_s=0.1, downscale_stable_s=0, downscale_cooldown_s=0))
    assert down(ctx(3))[0] == 2


def test_no_upscale_past_what_the_free_devices_place():
    """Two TP=2 replicas run; the nodes have 1 and 3 GPUs free: one more fits (two GPUs on one
    node), so a breach asking for more stops at three and says why once none fits."""
    bundles = [{"CPU": 1, "GPU": 1}, {"GPU": 1}]
    free = [[{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 3}]]
    policy = TbtSloPolicy(snapshot_source=Source(busy(0.9)), tbt_slo_s=0.1, replica_bundles=bundles,
                          free_resources=lambda: free[0], upscale_step=2)
    desired, state = policy(ctx(2, hi=8))
    assert desired == 3 and policy.placeable == 1
    free[0] = [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}]  # that replica took its two
    desired, state = policy(ctx(3, state={}, hi=8, now=200.0))
    assert desired == 3 and state[STATE_KEY]["reason"] == "tbt_p99_over_slo:no_devices" and policy.placeable == 0
    off = TbtSloPolicy(snapshot_source=Source(busy(0.9)), tbt_slo_s=0.1, replica_bundles=bundles,
                       free_resources=lambda: [], within_free_devices=False)
    assert off(ctx(2, hi=8))[0] == 3 and off.placeable is None  # a cluster autoscaler adds nodes
