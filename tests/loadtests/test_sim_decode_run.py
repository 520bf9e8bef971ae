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
        assert f.summary["decode_run_passes"] > 0.9 * f.summary["iterations"]  # prompts too


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


def test_a_decode_set_allocates_blocks_at_the_schedulers_passes():
    """Pass by pass, the set holds the same blocks per request as schedule() + advance(), and
    a request that finishes leaves it up to date."""
    from loadtests.sim.decode_run import DecodeSet
    from replicas.config import EngineConfig
    from replicas.scheduling.kv_cache import BlockManager
    from loadtests.sim.costmodel import batch_features
    from replicas.request import Request, RequestStatus, SamplingParams
    from replicas.scheduling.scheduler import Scheduler

    def decoding(prompts=(5, 16, 17, 30), max_tokens=(40, 9, 40, 40)) -> tuple[Scheduler, list[Request]]:
        cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=128, max_batch_total_tokens=512,
                           block_size=4, max_num_seqs=8)
        s = Scheduler(cfg, BlockManager(40, 4), lambda: 0.0)
        reqs = [Request(str(i), range(n), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
                        arrival_time=i * 1e-3) for i, (n, m) in enumerate(zip(prompts, max_tokens))]
        for r in reqs:
            s.add(r)
        s.advance(s.schedule(), [0] * len(reqs), now=1.0)  # every prompt in one pass: all decode now
        return s, reqs

    ref, ref_reqs = decoding()
    run_sched, run_reqs = decoding()
    ds = DecodeSet(run_sched)
    assert ds.size == 4 and not ds.prefilling
    for j in range(12):
        batch = ref.schedule()
        for r in ref.advance(batch, [0] * len(batch.decodes), now=2.0 + j):
            if len(r.output_token_ids) >= r.params.max_tokens:
                ref.finish(r, RequestStatus.FINISHED_LENGTH)
        prefills, features = ds.start_pass()
        assert not prefills and features == batch_features(batch)
        for r in ds.end_pass(2.0 + j, None):
            assert (r.request_id, j, r.token_times) == ("1", 7, ref_reqs[1].token_times)  # its 9th token
            run_sched.finish(r, RequestStatus.FINISHED_LENGTH)
        assert run_sched.blocks.num_free == ref.blocks.num_free, j
        assert [len(run_sched.blocks.block_table(r.request_id)) for r in run_reqs] == \
               [len(ref.blocks.block_table(r.request_id)) for r in ref_reqs], j
    ds.apply_all()
    assert [(r.num_computed_tokens, r.output_token_ids, r.token_times) for r in run_reqs] == \
           [(r.num_computed_tokens, r.output_token_ids, r.token_times) for r in ref_reqs]


def test_a_recomputed_request_left_one_token_short_joins_the_decodes():
    """A preempted request recomputes prompt + outputs; a chunk that stops one token short
    leaves it decoding (no token sampled): the set takes it in as the scheduler would."""
    from loadtests.sim.costmodel import CostModel
    from loadtests.sim.metrics import Recorder
    from loadtests.sim.replica import ReplicaSpec, SimClock, SimReplica
    from replicas.config import EngineConfig
    from replicas.request import Request, SamplingParams

    # MBP 13 with one decode running: a 12-token chunk of the 13 tokens B must recompute.
    spec = ReplicaSpec(EngineConfig(policy="stall_free", max_batch_prefill_tokens=13, max_batch_total_tokens=1024,
                                    block_size=4, max_num_seqs=8, enable_prefix_caching=False), 256,
                        CostModel(overhead_s=1.0, form="sum"), 4096)

    def drive(decode_runs: bool) -> tuple[SimReplica, list[Request]]:
        clock, rec = SimClock(), Recorder(2, 1.5, 10.0)
        r = SimReplica("r0", spec, clock, rec, lambda *_: None, 10.0, True, decode_runs)
        a = Request("0", range(8), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), arrival_time=0.0)
        b = Request("1", range(10), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), arrival_time=0.1,
                    output_token_ids=[0, 0, 0], token_times=[0.6, 0.7, 0.8], num_preemptions=1,
                    first_scheduled_time=0.2)
        r.add(a)
        end = r.start_iteration(0.0)
        while end is not None:
            clock.t = end
            r.finish_iteration(end)
            if end == 2.0:
                r.add(b)
            end = r.start_iteration(end)
        r.sync()
        return r, [a, b]

    (ref, ref_reqs), (fast, fast_reqs) = drive(False), drive(True)
    assert fast.num_run_passes > 0
    assert ref.log[2:4] == [(2.0, 1.0, 12, 1, 22, 2), (3.0, 1.0, 0, 2, 24, 2)]  # B: 12 of 13, then decodes
    assert fast.log == ref.log
    assert [(q.token_times, q.num_computed_tokens, q.is_finished) for q in fast_reqs] == \
           [(q.token_times, q.num_computed_tokens, q.is_finished) for q in ref_reqs]
    assert fast.rec.max_gap == ref.rec.max_gap and fast.pending_tbt == ref.pending_tbt


def test_with_the_slo_budget_only_pure_decode_passes_are_played_and_nothing_changes():
    """The SLO budget reads the decodes and learns from every pass: the set plays only passes
    without prompts there, and the pass-time model sees the same passes in the same order."""
    import dataclasses

    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 2048)
    spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, tbt_slo_ms=100.0))
    trace = make_trace("sharegpt", "poisson", n=300, rate=8.0, seed=3)
    runs = []
    for decode_runs in (False, True):
        sim = Simulator(SimConfig(spec, 2, router="token_load", decode_runs=decode_runs, log_iterations=True,
                                  scaling=ScalingConfig(min_replicas=1, max_replicas=4)), trace)
        res = sim.run()
        runs.append((sim, res))
    (ref, r), (fast, f) = runs
    assert 0 < f.summary["decode_run_passes"] < f.summary["iterations"]
    assert [x.log for x in ref.retired + ref.replicas] == [x.log for x in fast.retired + fast.replicas]
    assert ref.rec.ttft == fast.rec.ttft and ref.rec.max_gap == fast.rec.max_gap and r.scaling == f.scaling
    assert [list(x.pass_time.window) for x in ref.replicas] == [list(x.pass_time.window) for x in fast.replicas]
