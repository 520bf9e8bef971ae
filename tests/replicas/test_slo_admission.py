"""SLO admission: under a TBT SLO a waiting request starts only while the running requests'
decodes and its own, beside the least prefill chunk, are predicted within the target. The rule
with a known cost model, the scheduler holding the queue in order, and the engine keeping its
running set at exactly the size the model allows, outputs unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.scheduling.kv_cache import BlockManager
from replicas.loading.models import load_model
from replicas.scheduling.pass_time import PassTimeModel, SloAdmission
from replicas.request import Request
from replicas.scheduling.scheduler import Scheduler

# 1 ms per pass + 2 ms per decoding sequence (nothing else costs): target 10 ms.
COEF = np.array([1e-3, 0.0, 2e-3, 0.0, 0.0, 0.0])


def known_model(coef: np.ndarray = COEF) -> PassTimeModel:
    model = PassTimeModel()
    model.coef = coef.copy()
    model.seeded = True  # as after the engine's start-up profile
    return model


def request(rid: str, n: int = 10, **params: object) -> Request:
    return Request(rid, [5] * n, SamplingParams(max_tokens=20, **params), 0, 0.0)  # type: ignore[arg-type]


@pytest.mark.unit
def test_admits_exactly_while_the_decodes_fit_the_target() -> None:
    admit = SloAdmission(known_model(), target_s=0.010, floor=16)
    # n running + this one decode: 1 + 2 (n + 1) ms <= 10 ms  <=>  n <= 3.
    assert [admit(n, 100 * n, request("r")) for n in range(1, 7)] == [True, True, True, False, False, False]
    assert admit.held == 3
    assert admit(0, 0, request("r"))  # nothing running: no gap to protect
    profiling = known_model()
    profiling.seeded = False  # the start-up profile runs every shape it needs
    assert SloAdmission(profiling, target_s=0.010, floor=16)(6, 600, request("r"))


@pytest.mark.unit
def test_context_and_the_floor_chunk_count() -> None:
    # 0.01 ms per prefill token and per context token: a longer prompt tips the same count over.
    admit = SloAdmission(known_model(np.array([1e-3, 1e-5, 2e-3, 0.0, 1e-5, 0.0])), target_s=0.010, floor=16)
    # 2 running + 1: 1 + 0.16 + 6 + 0.01 * (ctx) ms: ctx = 100 + 10 + 16 -> 8.42 ms; 300-token prompt -> 10.32.
    assert admit(2, 100, request("short", 10))
    assert not admit(2, 100, request("long", 300))


@pytest.mark.unit
def test_an_untrusted_model_admits() -> None:
    model = known_model()
    model.errors.extend([0.9] * 32)
    assert not model.trusted
    assert SloAdmission(model, target_s=0.010, floor=16)(10, 1000, request("r"))


def scheduler(may_admit) -> Scheduler:  # noqa: ANN001
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=512, max_batch_total_tokens=4096,
                       block_size=8, max_num_seqs=16)
    sched = Scheduler(cfg, BlockManager(num_blocks=512, block_size=8), clock=lambda: 0.0)
    sched.may_admit = may_admit
    return sched


@pytest.mark.unit
def test_the_scheduler_holds_the_queue_in_order_and_lets_started_streams_back() -> None:
    sched = scheduler(lambda n, tokens, req: n < 3)
    for i in range(5):
        sched.add(request(f"r{i}"))
    out = sched.schedule()
    assert [s.request.request_id for s in out.prefills] == ["r0", "r1", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r4"]
    assert out.head_held  # the pass says so: the replica's drain rate reads it as a stalled queue
    # A preempted request has a stream running: it is not held back.
    back = request("back")
    back.num_preemptions = 1
    back.arrival_time = -1.0  # most urgent: first in line
    sched.add(back)
    assert sched.waiting[0] is back
    sched.schedule()
    assert back in sched.running and len(sched.running) == 4
    assert [r.request_id for r in sched.waiting] == ["r3", "r4"]


@pytest.mark.unit
def test_the_hook_sees_the_running_count_and_their_tokens() -> None:
    seen = []
    sched = scheduler(lambda n, tokens, req: seen.append((n, tokens, req.request_id)) or True)
    for i, n in enumerate([10, 20, 30]):
        sched.add(request(f"r{i}", n))
    assert not sched.schedule().head_held
    assert seen == [(0, 0, "r0"), (1, 10, "r1"), (2, 30, "r2")]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


@pytest.mark.engine
def test_the_engine_runs_exactly_as_many_as_the_model_allows_outputs_unchanged(llama) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in [12, 30, 7, 25, 18, 9]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=256, max_batch_total_tokens=4096,
                       block_size=8, max_num_seqs=8, tbt_slo_ms=1.0, slo_admission=True)
    free = Engine(*llama, cfg.replace(tbt_slo_ms=None)).generate(prompts, params)
    eng = Engine(*llama, cfg)
    assert eng.scheduler.may_admit is eng.slo_admission
    # 0.1 ms per pass + 0.2 ms per decode, target 0.8 ms: 1 + 2 (n + 1) <= 8 -> n <= 2 running,
    # so 3 at a time.
    eng.pass_time.coef = np.array([1e-4, 0.0, 2e-4, 0.0, 0.0, 0.0])
    eng.pass_time.errors.clear()
    eng.pass_time.observe = lambda *a, **k: None  # keep the injected model (and its trust)
    running: list[int] = []
    step = eng.step

    def counting_step():  # noqa: ANN202
        out = step()
        running.append(len(eng.scheduler.running) + sum(1 for o in out if o.finished))
        return out

    eng.step = counting_step
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    assert max(running) == 3 and eng.slo_admission.held > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    # slo_admission off (the default): the same SLO budget, every request admitted at once.
    off = Engine(*llama, cfg.replace(slo_admission=False))
    assert not EngineConfig().slo_admission
    assert off.scheduler.may_admit is None and off.slo_budget is not None
