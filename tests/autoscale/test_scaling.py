"""Replicas are added when the windowed p99 TBT breaks the SLO or the queue predicts it, removed
one at a time only when the rest would hold the SLO with margin, after a cool-down, and never
outside [min, max]; inside the hysteresis band the count holds."""

from __future__ import annotations

import dataclasses

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad
from autoscale.scaling import (ScalingConfig, ScalingState, can_shrink, decide_replicas, demand_need,
                               refused_share)

pytestmark = pytest.mark.unit

SLO = 0.1
CFG = ScalingConfig(min_replicas=1, max_replicas=4, upscale_cooldown_s=5.0,
                    downscale_cooldown_s=30.0, downscale_stable_s=5.0, downscale_margin=0.7,
                    min_samples=20, queued_tokens_per_replica=4096)
FRESH = ScalingState()


def snap(p99: float | None, samples: int = 100, running: int = 1000, waiting: int = 0,
         replicas: int = 2) -> ClusterSnapshot:
    loads = {f"r{i}": ReplicaLoad(f"r{i}", running_tokens=running // replicas,
                                  waiting_tokens=waiting // replicas) for i in range(replicas)}
    return ClusterSnapshot(loads, p99, p99, samples, None, 0.0)


def test_up_on_p99_breach():
    n, state = decide_replicas(snap(0.15), 2, FRESH, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 3 and state.reason == "tbt_p99_over_slo" and state.last_change_s == 100.0


def test_p99_needs_enough_samples():
    n, _ = decide_replicas(snap(0.5, samples=5), 2, FRESH, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2


def test_up_on_queue_prediction_without_tbt_breach():
    # 20k queued prompt tokens over 2 replicas is 10k each, over 4096: need ceil(20000/4096)=5,
    # capped at max_replicas=4.
    n, state = decide_replicas(snap(0.05, waiting=20_000), 2, FRESH, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 4 and state.reason == "queued_tokens_predict_breach"


def test_up_respects_cooldown_and_max():
    recent = ScalingState(last_change_s=98.0)
    n, state = decide_replicas(snap(0.15), 2, recent, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2 and state.reason.endswith(":cooldown")
    n, _ = decide_replicas(snap(0.15), 2, recent, now=103.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 3
    n, state = decide_replicas(snap(0.9), 4, FRESH, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 4 and state.reason.endswith(":at_max")


def test_hold_inside_the_hysteresis_band():
    # 2 -> 1 would predict p99 = 0.04 * 2 = 0.08, above 0.7 * SLO = 0.07: hold, though under SLO.
    n, state = decide_replicas(snap(0.04), 2, FRESH, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2 and state.reason == "hold" and state.down_since_s is None


def test_down_only_after_stable_period_and_cooldown():
    low = snap(0.02)  # 2 -> 1 predicts 0.04 < 0.07
    state = ScalingState(last_change_s=0.0)
    n, state = decide_replicas(low, 2, state, now=100.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2 and state.reason == "downscale_pending" and state.down_since_s == 100.0
    n, state = decide_replicas(low, 2, state, now=104.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2  # held 4 s of the 5 s needed
    n, state = decide_replicas(low, 2, state, now=105.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 1 and state.reason == "slo_holds_with_fewer" and state.last_change_s == 105.0


def test_a_breach_resets_the_downscale_clock():
    state = ScalingState(last_change_s=0.0, down_since_s=100.0)
    _, state = decide_replicas(snap(0.08), 2, state, now=103.0, cfg=CFG, tbt_slo_s=SLO)  # in band: reset
    assert state.down_since_s is None
    n, state = decide_replicas(snap(0.02), 2, state, now=106.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2 and state.down_since_s == 106.0


def test_down_waits_for_cooldown_after_a_change():
    state = ScalingState(last_change_s=90.0, down_since_s=90.0)
    n, _ = decide_replicas(snap(0.02), 3, state, now=110.0, cfg=CFG, tbt_slo_s=SLO)  # only 20 s of 30 s cool-down
    assert n == 3
    n, _ = decide_replicas(snap(0.02), 3, state, now=120.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2


def test_idle_cluster_shrinks_even_with_old_breach_samples():
    idle = snap(0.5, running=0, waiting=0)
    assert can_shrink(idle, 3, CFG, SLO)
    assert decide_replicas(idle, 3, FRESH, now=0.0, cfg=CFG, tbt_slo_s=SLO)[0] == 3  # and never grows
    state = ScalingState(last_change_s=0.0, down_since_s=100.0)
    n, _ = decide_replicas(idle, 3, state, now=105.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 2


def test_queue_blocks_downscale():
    # p99 is fine but 3000 queued tokens on 1 replica would be > 0.7 * 4096.
    assert not can_shrink(snap(0.01, waiting=3000), 2, CFG, SLO)
    assert can_shrink(snap(0.01, waiting=2000), 2, CFG, SLO)


def test_never_below_min_and_clamps_out_of_bounds():
    state = ScalingState(last_change_s=0.0, down_since_s=0.0)
    n, _ = decide_replicas(snap(0.0, running=0), 1, state, now=1000.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 1
    assert decide_replicas(snap(0.05), 6, FRESH, now=0.0, cfg=CFG, tbt_slo_s=SLO)[0] == 4
    assert decide_replicas(snap(0.05), 0, FRESH, now=0.0, cfg=CFG, tbt_slo_s=SLO)[0] == 1


def test_settling_change_holds_target_and_restarts_cooldown():
    n, state = decide_replicas(snap(0.5), 2, FRESH, now=50.0, cfg=CFG, tbt_slo_s=SLO, target=3)
    assert n == 3 and state.reason == "settling" and state.last_change_s == 50.0
    n, _ = decide_replicas(snap(0.5), 3, state, now=52.0, cfg=CFG, tbt_slo_s=SLO, target=3)
    assert n == 3  # landed, but the up cool-down counts from 50
    n, _ = decide_replicas(snap(0.5), 3, state, now=55.0, cfg=CFG, tbt_slo_s=SLO, target=3)
    assert n == 4


def test_token_load_capacity_model():
    cfg = ScalingConfig(max_replicas=8, token_load_per_replica=10_000,
                        queued_tokens_per_replica=None)
    n, state = decide_replicas(snap(0.01, running=50_000), 2, FRESH, now=0.0, cfg=cfg, tbt_slo_s=SLO)
    assert n == 5 and state.reason == "token_load_predicts_breach"
    assert not can_shrink(snap(0.01, running=15_000), 3, cfg, SLO)  # 7500 each > 0.7 * 10000
    assert can_shrink(snap(0.01, running=10_000), 3, cfg, SLO)


def test_scale_to_zero_only_when_idle():
    cfg = ScalingConfig(min_replicas=0, max_replicas=2, downscale_stable_s=0.0,
                        downscale_cooldown_s=0.0)
    assert decide_replicas(snap(None, samples=0, running=0), 1, FRESH, now=0.0, cfg=cfg, tbt_slo_s=SLO)[0] == 0
    assert decide_replicas(snap(0.01, running=10), 1, FRESH, now=0.0, cfg=cfg, tbt_slo_s=SLO)[0] == 1


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="tbt_slo_s"):
        decide_replicas(snap(0.1), 2, FRESH, now=0.0, cfg=CFG, tbt_slo_s=0)
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="downscale_margin"):
        ScalingConfig(downscale_margin=1.5)
    with pytest.raises(ValueError, match="window_s"):
        ScalingConfig(window_s=0)
    with pytest.raises(ValueError, match="bogus"):
        ScalingConfig.from_dict({"window_s": 10, "bogus": 1})
    with pytest.raises(ValueError, match="tbt_slo_s"):
        ScalingConfig.from_dict({"tbt_slo_s": 0.1})  # the SLO is the engine's, not a scaling knob
    assert ScalingState.from_dict(ScalingState(1.0, 2.0, "x").to_dict()) == ScalingState(1.0, 2.0, "x")


def demand(served: float, refused: float, p99: float = 0.05, replicas: int = 1) -> ClusterSnapshot:
    """A fleet whose admission keeps TBT and queues low while it refuses `refused` tokens/s."""
    return dataclasses.replace(snap(p99, replicas=replicas), served_tps=served, refused_tps=refused)


def test_refused_demand_adds_the_replicas_it_needs_once_refusals_persist():
    # One replica serves 1,000 tokens/s and refuses 2,500: TBT and queue look fine.
    n, state = decide_replicas(demand(1000, 2500), 1, FRESH, now=10.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 1 and state.refusing_since_s == 10.0 and state.capacity_tps == 1000
    n, state = decide_replicas(demand(1000, 2500), 1, state, now=11.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 1  # 1 s of the 2 s refusal_persist_s
    n, state = decide_replicas(demand(1000, 2500), 1, state, now=12.0, cfg=CFG, tbt_slo_s=SLO)
    assert (n, state.reason) == (4, "refused_demand")  # ceil(3,500 / 700 a replica), max 4
    assert state.capacity_tps == 1000 and state.refusing_since_s == 10.0  # the spell goes on
    # A break in the refusals restarts the clock.
    _, s1 = decide_replicas(demand(1000, 2500), 1, FRESH, now=0.0, cfg=CFG, tbt_slo_s=SLO)
    _, s2 = decide_replicas(demand(1000, 0), 1, s1, now=1.0, cfg=CFG, tbt_slo_s=SLO)
    n, _ = decide_replicas(demand(1000, 2500), 1, s2, now=2.5, cfg=CFG, tbt_slo_s=SLO)
    assert n == 1


def test_refusals_under_the_share_or_off_do_not_scale():
    state = dataclasses.replace(FRESH, refusing_since_s=0.0)
    assert decide_replicas(demand(1000, 10), 1, state, now=9.0, cfg=CFG, tbt_slo_s=SLO)[0] == 1  # 1%
    off = dataclasses.replace(CFG, max_refused_share=None)
    assert decide_replicas(demand(1000, 5000), 1, state, now=9.0, cfg=off, tbt_slo_s=SLO)[0] == 1
    assert refused_share(demand(1000, 3000)) == 0.75 and refused_share(demand(0, 0)) == 0.0
    # Refusing with nothing served yet (no measure of capacity): one step.
    assert demand_need(demand(0, 500), 2, CFG) == 1
    # 4,000 tokens/s at 1,000 a replica, sized to run at downscale_margin (0.7): 6 replicas, 4 more.
    assert demand_need(demand(2000, 2000), 2, CFG) == 4
    assert demand_need(demand(2000, 2000), 2, CFG, capacity_tps=2000) == 1  # a measure from before


def test_no_scale_down_while_refusing_or_past_the_measured_capacity():
    low = dict(p99=0.01, replicas=3)
    assert not can_shrink(demand(3000, 100, **low), 3, CFG, SLO)  # refusing: never shrink
    assert can_shrink(demand(3000, 0, **low), 3, CFG, SLO)  # no capacity measured: TBT decides
    assert not can_shrink(demand(3000, 0, **low), 3, CFG, SLO, capacity_tps=2000)  # 1,500 > 0.7 x 2,000
    assert can_shrink(demand(2000, 0, **low), 3, CFG, SLO, capacity_tps=2000)  # 1,000 < 1,400
    # The capacity measured while refusing outlives the change it caused.
    _, state = decide_replicas(demand(1000, 3000), 1, FRESH, now=0.0, cfg=CFG, tbt_slo_s=SLO)
    n, state = decide_replicas(demand(1000, 3000), 1, state, now=3.0, cfg=CFG, tbt_slo_s=SLO)
    assert n == 4
    n, state = decide_replicas(demand(3900, 0, p99=0.01, replicas=4), 4, state, now=100.0, cfg=CFG,
                               tbt_slo_s=SLO)
    assert n == 4 and state.reason == "hold" and state.capacity_tps == 1000  # 1,300 each > 700
    assert ScalingState.from_dict(state.to_dict()) == state


def test_persisting_refusals_raise_a_settling_target_on_the_capacity_seen_this_spell():
    cfg = dataclasses.replace(CFG, max_replicas=10)
    _, state = decide_replicas(demand(2000, 6000), 1, FRESH, now=0.0, cfg=cfg, tbt_slo_s=SLO)
    assert state.capacity_tps == 2000
    n, state = decide_replicas(demand(2000, 6000), 1, state, now=2.0, cfg=cfg, tbt_slo_s=SLO)
    assert (n, state.reason) == (5, "refused_demand")  # ceil(8,000 / 1,400) = 6, 4 more at most
    # Settling (one of four landed): the window since the decision divides 2 replicas' work by 2
    # while one served most of it: the capacity seen this spell (2,000) stands, not 1,500.
    n, state = decide_replicas(demand(3000, 6000), 2, state, now=10.0, cfg=cfg, tbt_slo_s=SLO, target=5)
    assert (n, state.reason, state.capacity_tps) == (6, "refused_demand", 2000)  # ceil(9,000 / 1,400) = 7 > 5: 2 + 4
    # The next second: a window a moment old since that decision does not raise it again.
    n, state = decide_replicas(demand(3000, 9000), 2, state, now=11.0, cfg=cfg, tbt_slo_s=SLO, target=6)
    assert (n, state.reason, state.decided_s) == (6, "settling", 10.0)
    n, state = decide_replicas(demand(3000, 9000), 2, state, now=12.0, cfg=cfg, tbt_slo_s=SLO, target=6)
    assert (n, state.decided_s) == (6, 10.0)  # 9 wanted, but 2 ready + 4 at most: it holds
    assert state.window_start(12.0, 30.0, settling=True) == 10.0  # since the latest decision
    held = dataclasses.replace(state, reason="settling", last_change_s=20.0)
    assert held.window_start(21.0, 30.0, settling=True) == 10.0  # since the decision while settling
    assert held.window_start(21.0, 30.0) == 20.0  # since it landed
    assert FRESH.window_start(100.0, 30.0) == 70.0
