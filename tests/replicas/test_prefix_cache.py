"""With the prefix cache on, outputs stay token-identical to HF `generate` while a shared prefix
is computed once: the prompt tokens run through the model are exactly the uncached ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.config import POLICIES
from replicas.scheduling.kv_cache import BlockManager
from replicas.loading.models import load_model
from replicas.request import Request, RequestStatus
from replicas.scheduling.scheduler import Scheduler

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def rand(n: int, seed: int) -> list[int]:
    return torch.randint(5, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model_tok, policy: str, **kw) -> Engine:
    cfg = dict(policy=policy, max_batch_prefill_tokens=100 if policy == "dynamic" else 24,
               max_batch_total_tokens=512, block_size=BS, max_num_seqs=8)
    return Engine(*model_tok, EngineConfig(**{**cfg, **kw}))


def prompt_tokens_run(eng: Engine) -> int:
    return sum(it.num_prefill_tokens for it in eng.iterations)


@pytest.mark.engine
@pytest.mark.parametrize("policy", POLICIES)
def test_shared_prefixes_of_every_length_match_hf_and_run_only_uncached_tokens(llama, policy):
    base = rand(40, 0)
    variants = {  # prompt -> cached tokens it must find (the base's full blocks it starts with)
        "inside a block": (base[:10] + rand(5, 1), 8),
        "at a block boundary": (base[:12] + rand(3, 2), 12),
        "whole prompt cached": (list(base), 36),  # the last token always runs: 9 of 10 blocks
        "longer than the base": (base + rand(7, 3), 40),
        "nothing shared": (rand(9, 4), 0),
    }
    eng = engine(llama, policy)
    first = eng.generate([base], GREEDY)[0]
    assert first.num_cached_tokens == 0 and prompt_tokens_run(eng) == 40
    eng.iterations.clear()
    outs = eng.generate([p for p, _ in variants.values()], GREEDY)
    for (name, (p, cached)), out in zip(variants.items(), outs):
        assert out.token_ids == hf_greedy(llama[0], p, 6), name
        assert out.num_cached_tokens == cached, name
    uncached = sum(len(p) - cached for p, cached in variants.values())
    assert prompt_tokens_run(eng) == uncached
    assert eng.blocks.num_used == 0
    eng.blocks.check()


@pytest.mark.engine
def test_caching_off_recomputes_everything(llama):
    base = rand(40, 0)
    eng = engine(llama, "stall_free", enable_prefix_caching=False)
    a, b = eng.generate([base], GREEDY)[0], eng.generate([base], GREEDY)[0]
    assert a.token_ids == b.token_ids and b.num_cached_tokens == 0
    assert prompt_tokens_run(eng) == 80 and eng.blocks.num_cached == 0


@pytest.mark.engine
def test_evicted_prefix_is_recomputed_and_still_correct(llama):
    base = rand(40, 0)
    eng = engine(llama, "stall_free", max_batch_total_tokens=64)  # 16 blocks
    ref = hf_greedy(llama[0], base, 6)
    assert eng.generate([base], GREEDY)[0].token_ids == ref
    # Others take the blocks: the base's cached blocks are reclaimed, tail first.
    for seed in range(5, 9):
        eng.generate([rand(50, seed)], GREEDY)
    assert eng.blocks.evictions > 0
    again = eng.generate([base], GREEDY)[0]
    assert again.token_ids == ref
    assert again.num_cached_tokens < 36
    eng.blocks.check()


@pytest.mark.unit
def test_admission_charges_only_uncached_tokens_against_both_budgets():
    """A 90%-cached prompt costs 10% of its tokens against MBP and only its new blocks of KV."""
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=16, max_batch_total_tokens=64,
                       block_size=BS, priority_aging_s=1000.0)
    s = Scheduler(cfg, BlockManager(16, BS, enable_caching=True), lambda: 0.0)
    params = SamplingParams(max_tokens=1, temperature=0)
    a = Request("a", list(range(1, 37)), params)  # 36 tokens: three passes of at most 16
    s.add(a)
    while not a.is_finished:
        out = s.schedule()
        for r in s.advance(out, [7] * sum(q.samples for q in out.seqs), now=0.0):
            s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert s.blocks.num_cached == 9 and s.blocks.num_used == 0
    b = Request("b", list(range(1, 37)) + [90, 91, 92, 93], params)  # 40 tokens, 36 cached
    s.add(b)
    free = s.blocks.num_free
    out = s.schedule()
    assert [(q.request.request_id, q.start, q.num_tokens) for q in out.prefills] == [("b", 36, 4)]
    assert b.num_cached_tokens == 36
    # Its 9 cached blocks were idle (in the free pool) and are now referenced; one block is new.
    assert s.blocks.num_free == free - 10 and len(s.blocks.block_table("b")) == 10
    assert s.blocks.hit_tokens == 36 and s.blocks.query_tokens == 36 + 40
    s.blocks.check()


@pytest.mark.engine
@pytest.mark.parametrize("policy", ["stall_free", "dynamic"])
def test_n_samples_share_one_prefill(llama, policy):
    """n=4: the first sample prefills the prompt; the others wait for it, then fork from its
    cached blocks, running only the last (partial) block again."""
    prompt = rand(40, 11)
    eng = engine(llama, policy)
    outs = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=4))
    ref = hf_greedy(llama[0], prompt, 6)
    assert [o.token_ids for o in outs] == [ref] * 4
    assert [o.num_cached_tokens for o in outs] == [0, 36, 36, 36]
    assert prompt_tokens_run(eng) == 40 + 3 * 4
    assert eng.blocks.num_used == 0
    off = engine(llama, policy, enable_prefix_caching=False)
    assert [o.token_ids for o in off.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                                       ignore_eos=True, n=4))] == [ref] * 4
    assert prompt_tokens_run(off) == 4 * 40


@pytest.mark.engine
def test_seeded_samples_are_the_single_requests_with_seed_plus_index(llama):
    prompt = rand(30, 12)
    eng = engine(llama, "stall_free")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    many = eng.generate([prompt], dataclasses.replace(params, n=3))
    singles = [eng.generate([prompt], dataclasses.replace(params, seed=7 + j))[0] for j in range(3)]
    assert [o.token_ids for o in many] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in many}) > 1  # different seeds, different samples


@pytest.mark.unit
def test_a_preempted_first_sample_does_not_strand_its_forks():
    """The first sample is preempted mid-prefill and queues behind its own fork (equal urgency):
    the fork must not wait for a parent that is itself waiting. Every request finishes."""
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=8, max_batch_total_tokens=40,
                       block_size=BS, priority_aging_s=1000.0, kv_watermark=0.0)
    s = Scheduler(cfg, BlockManager(10, BS, enable_caching=True), lambda: 0.0)
    a = Request("a", list(range(1, 7)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                arrival_time=0.0)  # more urgent than p: p is the one preempted
    s.add(a)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=2)
    p = Request("p", list(range(100, 132)), params, arrival_time=1.0)
    fork = Request("p#1", list(p.prompt_token_ids), params, arrival_time=1.0, index=1, forked_from=p)
    stranded = False  # the first sample preempted while prefilling, queued behind its fork
    for step in range(200):
        if step == 1:  # a is decoding now
            s.add(p)
            s.add(fork)
        out = s.schedule()
        if p in out.preempted and not p.output_token_ids:
            stranded = s.waiting.index(fork) < s.waiting.index(p)
        for r in s.advance(out, [7] * sum(q.samples for q in out.seqs), now=0.0):
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        s.blocks.check()
        if all(r.is_finished for r in (a, p, fork)):
            break
    assert stranded, "the scenario needs the first sample preempted mid-prefill behind its fork"
    assert all(r.is_finished for r in (a, p, fork)), [r.status for r in (a, p, fork)]
    assert s.blocks.num_used == 0


@pytest.mark.unit
def test_other_choices_do_not_expire_once_choice_zero_is_scheduled():
    clock = [0.0]
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=64, max_batch_total_tokens=24,
                       block_size=BS, queue_timeout_s=1.0, kv_watermark=0.0)
    s = Scheduler(cfg, BlockManager(6, BS, enable_caching=True), lambda: clock[0])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    lead = Request("r", list(range(1, 25)), params, arrival_time=0.0)  # all 6 blocks
    other = Request("r#1", list(range(50, 74)), params, arrival_time=0.0, index=1, first_choice=lead)  # no room
    stranger = Request("x", list(range(80, 104)), params, arrival_time=0.0)
    for r in (lead, other, stranger):
        s.add(r)
    s.schedule()
    assert lead.first_scheduled_time is not None and other.first_scheduled_time is None
    clock[0] = 5.0
    assert [r.request_id for r in s.expire(clock[0])] == ["x"]  # the stranger times out, the choice waits
    assert other.status == RequestStatus.WAITING
