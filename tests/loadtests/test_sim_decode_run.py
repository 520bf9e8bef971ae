"""Decode runs in closed form change nothing: with routing and autoscaling on, every request's
TTFT, TBT gaps, finish time and preemptions, every pass, every scaling decision and the summary
equal the pass-by-pass simulation's exactly (same floats, not approximately)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autoscale.scaling import ScalingConfig
from loadtests.sim.deploy import replica_spec
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import make_trace

pytestmark = pytest.mark.unit

PER_REQUEST = ("ttft", "e2e", "max_gap", "mean_gap", "sched_delay", "preemptions")
SCALING = ScalingConfig(window_s=10.0, min_replicas=1, max_replicas=5, token_load_per_replica=6000,
                        upscale_cooldown_s=5.0, downscale_cooldown_s=10.0, downscale_stable_s=5.0)


def simulate(decode_runs: bool, policy: str, kv_tokens: int | None, router: str = "token_load") -> Simulator:
    spec = replica_spec("A100-80GB", "mistral-7b", policy, 512, kv_tokens=kv_tokens)
    duration = 40.0 if kv_tokens is None else 20.0  # preempting passes are many and short
    trace = make_trace("sharegpt", "step", duration_s=duration, lo=2.0, hi=10.0, at_s=duration / 4, seed=1)
    cfg = SimConfig(spec, 2, router=router, scaling=SCALING, scaling_interval_s=1.0, startup_s=8.0,
                    decode_runs=decode_runs, log_iterations=True)
    sim = Simulator(cfg, trace)
    sim.result = sim.run()
    return sim


def same(a: float, b: float) -> bool:
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("policy,kv_tokens,router", [
    ("stall_free", None, "token_load"),  # scales up over the step
    ("stall_free", 6000, "token_load"),  # a small KV cache: runs end where the scheduler preempts
    ("stall_free", None, "power_of_two"),
    ("dynamic", 6000, "token_load"),
    ("static", None, "round_robin"),
])
def test_decode_runs_equal_the_pass_by_pass_simulation(policy, kv_tokens, router):
    ref, fast = simulate(False, policy, kv_tokens, router), simulate(True, policy, kv_tokens, router)
    r, f = ref.result, fast.result
    assert r.summary["decode_run_passes"] == 0
    assert f.summary["decode_run_passes"] > 0  # the closed form did run
    for k, v in r.summary.items():
        if k not in ("sim_cpu_s", "decode_run_passes"):
            assert same(v, f.summary[k]), k
    for name in PER_REQUEST:
        assert np.array_equal(np.array(getattr(ref.rec, name), float), np.array(getattr(fast.rec, name), float),
                              equal_nan=True), name
    assert np.array_equal(ref.rec.hist, fast.rec.hist) and ref.rec.overflow == fast.rec.overflow  # every gap
    assert r.scaling == f.scaling  # every decision: (t, ready, provisioned, desired, reason)
    assert r.replicas == f.replicas  # lifetimes, passes and busy time per replica
    assert [x.log for x in ref.retired + ref.replicas] == [x.log for x in fast.retired + fast.replicas]
    assert r.summary["completed"] == r.summary["num_requests"] - r.summary["rejected"]
    if kv_tokens is not None and policy == "stall_free":
        assert r.summary["preemptions"] > 0
    if router == "token_load" and kv_tokens is None:
        assert r.summary["max_replicas"] > 2  # the scaler acted on what the runs reported
        assert f.summary["decode_run_passes"] > 0.3 * f.summary["iterations"]


def test_a_cut_run_leaves_every_request_as_the_scheduler_would():
    """Stopped mid-trace, the requests still running hold the same tokens and token times."""
    def stop_at(t_stop: float):
        return lambda sim, now: "cut" if now >= t_stop else None

    sims = []
    for decode_runs in (False, True):
        spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512)
        trace = make_trace("sharegpt", "poisson", n=200, rate=6.0, seed=2)
        sim = Simulator(SimConfig(spec, 2, router="token_load", decode_runs=decode_runs), trace)
        assert sim.run(stop=stop_at(12.0), stop_every_s=0.5).stopped == "cut"
        sims.append(sim)
    states = [[(q.request_id, q.num_computed_tokens, len(q.output_token_ids), q.token_times)
               for r in s.replicas for q in r.scheduler.running] for s in sims]
    assert states[0] and states[0] == states[1]


def test_a_decode_run_allocates_blocks_at_the_schedulers_passes():
    """Pass by pass, the run holds the same blocks per request as schedule() + advance()."""
    from loadtests.sim.decode_run import DecodeRun
    from replicas.config import EngineConfig
    from replicas.kv_cache import BlockManager
    from replicas.request import Request, SamplingParams
    from replicas.scheduler import Scheduler

    def decoding(prompts=(5, 16, 17, 30), max_tokens=40) -> tuple[Scheduler, list[Request]]:
        cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=128, max_batch_total_tokens=512,
                           block_size=4, max_num_seqs=8)
        s = Scheduler(cfg, BlockManager(40, 4), lambda: 0.0)
        reqs = [Request(str(i), range(n), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        arrival_time=0.0) for i, n in enumerate(prompts)]
        for r in reqs:
            s.add(r)
        s.advance(s.schedule(), [0] * len(reqs), now=1.0)  # every prompt in one pass: all decode now
        return s, reqs

    ref, ref_reqs = decoding()
    run_sched, run_reqs = decoding()
    run = DecodeRun(run_sched.running, run_sched.blocks)
    for j in range(12):
        batch = ref.schedule()
        ref.advance(batch, [0] * len(batch.decodes), now=2.0 + j)
        assert run.start_pass() is not None
        run.end_pass(2.0 + j, None)
        assert run_sched.blocks.num_free == ref.blocks.num_free, j
        assert [len(run_sched.blocks.block_table(r.request_id)) for r in run_reqs] == \
               [len(ref.blocks.block_table(r.request_id)) for r in ref_reqs], j
    run.apply()
    assert [(r.num_computed_tokens, r.output_token_ids, r.token_times) for r in run_reqs] == \
           [(r.num_computed_tokens, r.output_token_ids, r.token_times) for r in ref_reqs]
