"""The simulator drives the engine's own scheduler, block manager, router and scaling decision,
and a hand-worked scenario gives exactly the iterations and token times the policies imply."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

import autoscale.routing
import autoscale.scaling
from autoscale.scaling import ScalingConfig
from loadtests.sim import replica as sim_replica
from loadtests.sim import routers as sim_routers
from loadtests.sim import scaler as sim_scaler
from loadtests.sim.costmodel import CostModel
from loadtests.sim.deploy import replica_spec
from loadtests.sim.replica import ReplicaSpec
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import Trace, make_trace
from replicas.config import EngineConfig
from replicas.scheduling.kv_cache import BlockManager
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduling.scheduler import Scheduler

pytestmark = pytest.mark.unit

ONE_SECOND = CostModel(overhead_s=1.0, form="sum", name="1s per pass")


def tiny(policy: str, mbp: int, arrivals=(0.0, 0.5), prompts=(10, 30), outputs=(3, 2), **kw) -> Simulator:
    spec = ReplicaSpec(EngineConfig(policy=policy, max_batch_prefill_tokens=mbp, max_batch_total_tokens=1024,
                                    block_size=4, max_num_seqs=8), 256, ONE_SECOND, 4096)
    trace = Trace("tiny", np.array(arrivals), np.array(prompts), np.array(outputs))
    return Simulator(SimConfig(spec, kw.pop("replicas", 1), router=kw.pop("router", "round_robin"),
                               tbt_slo_s=1.5, ttft_slo_s=10.0, log_iterations=True, **kw), trace)


def test_the_simulators_parts_are_the_engines_and_the_routers_own():
    sim = tiny("stall_free", 16)
    r = sim.replicas[0]
    assert type(r.scheduler) is Scheduler and sim_replica.Scheduler is Scheduler
    assert type(r.blocks) is BlockManager
    assert sim_routers.choose_replica is autoscale.routing.choose_replica
    assert sim_routers.power_of_two is autoscale.routing.power_of_two
    assert sim_routers.round_robin is autoscale.routing.round_robin
    assert sim_scaler.decide_replicas is autoscale.scaling.decide_replicas


def test_stall_free_tiny_scenario_iterations_by_hand():
    # A (10 prompt, 3 out) at t=0, B (30 prompt, 2 out) at t=0.5, MBP 16, every pass 1 s:
    # [0,1] A prefill 10 -> A tok1 @1 | [1,2] A decode + B chunk 15 | [2,3] A decode + B chunk 15 -> A tok2 @2,
    # A tok3 @3 (done), B tok1 @3 | [3,4] B decode -> B tok2 @4 (done). Four passes.
    sim = tiny("stall_free", 16)
    res = sim.run()
    log = sim.replicas[0].log
    assert [(start, p, d) for start, _, p, d, _, _ in log] == [(0.0, 10, 0), (1.0, 15, 1), (2.0, 15, 1), (3.0, 0, 1)]
    assert res.summary["iterations"] == 4
    assert sim.rec.ttft == [1.0, 2.5]
    assert sim.rec.sched_delay == [0.0, 0.5]
    assert sim.rec.max_gap[0] == 1.0 and sim.rec.max_gap[1] == 1.0  # no stall
    assert res.summary["tbt_bucket_p99_s"] == pytest.approx(1.0, abs=1e-4)  # a 0.1 ms bin edge
    assert res.summary["output_tokens_per_s"] == pytest.approx(5 / 4.0)


def test_dynamic_tiny_scenario_stalls_the_running_decode():
    # [0,1] A prefill | [1,2] B's whole prompt alone (A waits: the stall) | [2,3] A and B decode |
    # [3,4] A decode. A's tokens at 1, 3, 4: a 2 s gap.
    sim = tiny("dynamic", 32)
    res = sim.run()
    assert [(p, d) for _, _, p, d, _, _ in sim.replicas[0].log] == [(10, 0), (30, 0), (0, 2), (0, 1)]
    assert res.summary["iterations"] == 4
    assert sim.rec.ttft == [1.0, 1.5]
    assert sim.rec.max_gap[0] == 2.0
    assert res.summary["max_gap_slo_request_share"] == 0.5  # A's 2 s gap breaks the 1.5 s TBT SLO


def test_static_tiny_scenario_waits_for_the_batch():
    # A alone forms a batch: prefill + 2 decodes ([0,3]); B is admitted only then: prefill + decode.
    sim = tiny("static", 32)
    res = sim.run()
    assert [(p, d) for _, _, p, d, _, _ in sim.replicas[0].log] == [(10, 0), (0, 1), (0, 1), (30, 0), (0, 1)]
    assert sim.rec.ttft == [1.0, 3.5]
    assert sim.rec.sched_delay == [0.0, 2.5]


class LengthOnly(Sequence):
    """Prompt ids that only have a length: any read of a token value fails the test."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise AssertionError("the scheduler read a token id")


@pytest.mark.parametrize("policy", ["static", "dynamic", "stall_free"])
def test_scheduler_reads_only_prompt_lengths(policy):
    # The simulator passes range(n) as prompt ids; that is only sound if nothing reads the values.
    cfg = EngineConfig(policy=policy, max_batch_prefill_tokens=64, max_batch_total_tokens=256, block_size=4)
    s = Scheduler(cfg, BlockManager(64, 4), lambda: 0.0)
    reqs = [Request(str(i), LengthOnly(n), SamplingParams(max_tokens=m, temperature=0.0), arrival_time=i * 1e-3)
            for i, (n, m) in enumerate([(40, 30), (60, 20), (9, 50), (33, 40)])]
    for r in reqs:
        s.add(r)
    for _ in range(500):
        if not s.has_unfinished():
            break
        batch = s.schedule()
        for r in s.advance(batch, [0] * sum(seq.samples for seq in batch.seqs), now=0.0):
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert all(r.is_finished for r in reqs)


@pytest.mark.parametrize("router,cls,real", [
    ("token_load", sim_routers.TokenLoadRouter, autoscale.routing.choose_replica),
    ("ttft", sim_routers.TtftRouter, autoscale.routing.choose_by_ttft)])
def test_token_load_router_calls_the_production_choice(monkeypatch, router, cls, real):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("candidates"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, "rank", staticmethod(spy))
    n = 40
    sim = tiny("stall_free", 64, arrivals=tuple(i * 0.05 for i in range(n)), prompts=(20,) * n, outputs=(5,) * n,
               replicas=4, router=router)
    res = sim.run()
    assert len(calls) == n and all(sorted(c) == ["r0", "r1", "r2", "r3"] for c in calls)
    assert res.summary["completed"] == n
    per_replica = [r["iterations"] for r in res.replicas]
    assert min(per_replica) > 0  # every replica took work


def test_autoscaler_adds_replicas_after_start_up_delay():
    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512)
    trace = make_trace("sharegpt", "step", duration_s=100.0, lo=1.0, hi=10.0, at_s=50.0, seed=3)
    scaling = ScalingConfig(min_replicas=1, max_replicas=6, upscale_cooldown_s=5.0,
                            queued_tokens_per_replica=16384)
    sim = Simulator(SimConfig(spec, 1, router="token_load", scaling=scaling, scaling_interval_s=1.0,
                              startup_s=20.0), trace)
    res = sim.run()
    ups = [p for p in res.scaling if p[3] > p[2]]  # (t, ready, provisioned, desired, reason)
    assert ups and ups[0][0] >= 50.0  # nothing to do before the step
    first_up = ups[0][0]
    late = [r for r in res.replicas if r["start_t"] > 0]
    assert late and all(r["start_t"] >= first_up for r in late)
    # A replica asked for at t takes routed traffic only from t + start-up delay.
    ready_at = {p[0]: p[1] for p in res.scaling}
    assert ready_at[first_up + 19.0] == 1 and ready_at[first_up + 21.0] > 1
    assert res.summary["replica_seconds"] < 6 * res.summary["duration_s"]


def test_a_simulated_replica_with_a_tbt_slo_runs_the_engines_slo_budget():
    """The simulated replica learns its cost model with the engine's pass-time model and picks
    each stall_free chunk with the engine's SloBudget: beside decodes, passes stay under the SLO
    that the fixed 2048-token budget breaks."""
    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 2048)
    seeds = sim_replica.profile_passes(spec.cost, 2048)
    assert len(seeds) == 15 and all(t > 0 for _, t in seeds)
    n = 30
    trace = Trace("long", np.arange(n) * 0.05, np.full(n, 1500), np.full(n, 40))
    hybrid_times = {}
    for slo_ms in (None, 60.0):
        s = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, tbt_slo_ms=slo_ms))
        sim = Simulator(SimConfig(s, 1, router="round_robin", tbt_slo_s=0.06, ttft_slo_s=10.0,
                                  log_iterations=True), trace)
        replica = sim.replicas[0]
        res = sim.run()
        assert res.summary["completed"] == n
        hybrid_times[slo_ms] = [dur for _, dur, p, d, *_ in replica.log if p and d]
        if slo_ms is not None:
            assert replica.pass_time.trusted and replica.scheduler.prefill_budget is replica.slo_budget
    assert max(hybrid_times[None]) > 0.06  # the fixed budget's hybrid passes break the SLO
    within = [t <= 0.06 for t in hybrid_times[60.0]]
    assert hybrid_times[60.0] and sum(within) >= 0.95 * len(within)


def test_slo_goodput_compares_every_system_on_the_same_offered_window():
    """Goodput counts the requests within both SLOs over the window the trace was offered in, for
    every system at the same rates (multiples of fixed 128's capacity), and the checks are the
    rows' own ratios."""
    from loadtests.sim.experiments import GOODPUT_SYSTEMS, slo_goodput

    res = slo_goodput(num_requests=60, slos={"strict": 0.1}, rate_factors=(1.0, 2.0), log=lambda _: None)
    rows = res["rows"]
    assert len(rows) == 2 * len(GOODPUT_SYSTEMS)
    assert [r["mbp"] for r in rows[:5]] == [128, 512, 2048, 2048, 8192]
    assert rows[0]["rate_rps"] > 0 and rows[5]["rate_rps"] == pytest.approx(2 * rows[0]["rate_rps"])
    for r in rows:
        assert r["goodput_rps"] == pytest.approx(r["max_gap_slo_request_share"] * r["rate_rps"])
        assert 0 <= r["goodput_rps"] <= r["rate_rps"]
    slo_row, fixed128, dyn = rows[3], rows[0], rows[4]
    check = res["checks"][0]
    assert check["goodput_vs_fixed128"] == pytest.approx(slo_row["goodput_rps"] / fixed128["goodput_rps"])
    assert check["goodput_vs_dynamic"] == pytest.approx(slo_row["goodput_rps"] / dyn["goodput_rps"])
    assert check["tbt_within_slo"] == (slo_row["tbt_bucket_p99_s"] <= 0.1)
    # Twice the saturating rate: dynamic's long prompts stall every decode, so no strict-SLO request is good.
    assert rows[9]["goodput_rps"] < rows[8]["goodput_rps"]


def test_prefix_router_keeps_each_conversation_where_its_history_is_cached():
    """Multi-turn chat with the prefix cache on: under `prefix` every later turn of a
    conversation goes to the replica that served its first turn (loads stay within the bound)
    and finds its history cached; round robin scatters them and recomputes."""
    from loadtests.sim.traffic import SIM_TOKEN, multi_turn_trace
    from loadtests.harness.workloads import LengthDist

    trace = multi_turn_trace(8, 0.5, turns=3, think_s=5.0, system_tokens=64,
                             user=LengthDist("uniform", 20, 10, 30), output=16, seed=1)
    assert len(trace) == 24 and trace.token_ids is not None
    first = trace.token_ids[0]
    later = next(p for p in trace.token_ids[1:] if p[:64] == first[:64])  # a later turn: history + answer
    assert later[:len(first)] == first and later[len(first):len(first) + 16] == [SIM_TOKEN] * 16
    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512, prefix_caching=True)
    results = {}
    for router in ("prefix", "round_robin"):
        sim = Simulator(SimConfig(spec, 4, router=router, tbt_slo_s=0.1), trace)
        placed: dict[str, str] = {}
        routed = sim.router.routed

        def spy(rid, replica, cost, now, routed=routed, placed=placed):  # noqa: ANN001
            placed[rid] = replica.replica_id
            routed(rid, replica, cost, now)

        sim.router.routed = spy
        assert sim.run().summary["completed"] == 24
        homes: dict[tuple[int, ...], set[str]] = {}
        for i, ids in enumerate(trace.token_ids):
            homes.setdefault(tuple(ids[:64]), set()).add(placed[str(i)])
        queried = sum(r.blocks.query_tokens for r in sim.replicas)
        results[router] = (homes, sum(r.blocks.hit_tokens for r in sim.replicas) / queried)
    homes, hit_rate = results["prefix"]
    assert len(homes) == 8 and all(len(h) == 1 for h in homes.values())
    assert hit_rate > results["round_robin"][1] + 0.2
    assert any(len(h) > 1 for h in results["round_robin"][0].values())


@pytest.mark.parametrize("router", ["token_load", "prefix"])
def test_router_adapters_live_in_flight_view_equals_a_sweep_of_the_book(router):
    """The adapters read the book's live view over no loads; a sweep of the book against the
    latest reports (what production's `unreflected` computes) routes every request the same."""
    class Sweep:  # unpacks to book.unreflected(loads) at each decision
        def __init__(self, r):
            self.r = r

        def __iter__(self):
            return iter(self.r.book.unreflected(self.r.loads))

    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512)
    trace = make_trace("sharegpt", "poisson", n=600, rate=20.0, seed=5)

    def run(sweep: bool) -> dict:
        sim = Simulator(SimConfig(spec, 8, router=router, scaling=ScalingConfig(min_replicas=1, max_replicas=12)),
                        trace)
        if sweep:
            sim.router._in_flight = Sweep(sim.router)
        s = sim.run().summary
        return {k: v for k, v in s.items() if "cpu" not in k and "wall" not in k}

    assert run(sweep=False) == run(sweep=True)


def test_a_report_delay_shows_the_router_each_report_that_much_later():
    """With `report_delay_s` the router sees every report that much later than it was made, and
    routes differently for it; every request is still served."""
    spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512)
    trace = make_trace("sharegpt", "poisson", n=400, rate=20.0, seed=5)

    def run(delay: float) -> tuple[list[tuple[float, float]], dict]:
        sim = Simulator(SimConfig(spec, 4, router="token_load", report_delay_s=delay), trace)
        seen: list[tuple[float, float]] = []  # (when the router saw it, when it was made)
        reported = sim.router.reported

        def spy(r, load, now):  # noqa: ANN001
            seen.append((now, load.timestamp))
            reported(r, load, now)

        sim.router.reported = spy
        return seen, sim.run().summary

    at_once, base = run(0.0)
    late, delayed = run(0.25)
    assert at_once and all(now == made for now, made in at_once)
    assert all(now - made == pytest.approx(0.25) for now, made in late)
    assert delayed["completed"] == base["completed"] == 400
    assert delayed["ttft_p99_s"] != base["ttft_p99_s"]  # routed on older loads


def test_the_settled_what_if_takes_finished_prompts_off_until_the_next_report():
    """A replica whose latest report still holds a request that has since finished: token_load
    ranks it by that report, `settled` without the request's prompt, until the replica reports
    again."""
    from types import SimpleNamespace

    from autoscale.load import ReplicaLoad
    from autoscale.routing import RequestCost

    a, b = SimpleNamespace(replica_id="a"), SimpleNamespace(replica_id="b")

    def routers_after(settle: bool) -> list[str]:
        picks = []
        for name in ("token_load", "settled"):
            r = sim_routers.make_router(name)
            r.routed("q1", a, RequestCost(400, 500), 0.0)
            r.reported(a, ReplicaLoad("a", running_tokens=500, free_blocks=1000, total_blocks=1000, timestamp=1.0), 1.0)
            r.reported(b, ReplicaLoad("b", running_tokens=200, free_blocks=1000, total_blocks=1000, timestamp=1.0), 1.0)
            r.completed("q1", 1.5)
            if settle:  # a reports after the finish: its 300 no longer hold q1 (another request's)
                r.reported(a, ReplicaLoad("a", running_tokens=300, free_blocks=1000, total_blocks=1000,
                                          timestamp=2.0), 2.0)
            picks.append(r.choose(RequestCost(10, 20), [a, b], 2.0).replica_id)
        return picks

    assert routers_after(settle=False) == ["b", "a"]  # 500 against 200; settled: 500 - 400 = 100
    assert routers_after(settle=True) == ["b", "b"]  # 300 against 200: q1 is not taken off again


def test_a_replica_has_a_size_in_devices():
    """A tensor-parallel replica (llama-70b at its profile's tp 4) holds 4 GPUs: the fleet's cost
    counts them (device-seconds), and the description says so."""
    spec = replica_spec("H100-SXM", "llama-70b", "stall_free", 512)
    assert spec.devices == spec.engine.tensor_parallel_size == 4
    assert replica_spec("H100-SXM", "llama-70b", "stall_free", 512, tp=8).devices == 8
    trace = make_trace("sharegpt", "step", duration_s=10.0, lo=1.0, hi=2.0, at_s=5.0, seed=3)
    cfg = SimConfig(spec, 2, router="token_load")
    res = Simulator(cfg, trace).run()
    assert res.summary["device_seconds"] == pytest.approx(4 * res.summary["replica_seconds"])
    assert cfg.describe()["devices_per_replica"] == 4
