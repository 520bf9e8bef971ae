"""The engine's greedy output must be token-identical to HF `generate`, under every policy,
with budgets small enough that prompts are split across iterations and KV runs out."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from replicas import Engine, EngineConfig, SamplingParams
from replicas.protocol import InvalidRequestError
from replicas.serving.async_engine import AsyncEngine
from replicas.loading.models import load_model

POLICIES = ["static", "dynamic", "stall_free"]
PROMPT_LENS = [5, 17, 40, 3, 64, 9, 33, 100, 1, 70]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def _tiny(cls, config, tokenizer, path):
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return load_model(str(path))


@pytest.fixture(scope="module")
def gpt2(llama, tmp_path_factory):
    tok = llama[1]
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=len(tok),
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    return _tiny(GPT2LMHeadModel, cfg, tok, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def qwen2(llama, tmp_path_factory):
    tok = llama[1]
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id)
    return _tiny(Qwen2ForCausalLM, cfg, tok, tmp_path_factory.mktemp("qwen2"))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_for(model_tok, policy: str, **overrides) -> Engine:
    cfg = dict(policy=policy, max_batch_prefill_tokens=100 if policy == "dynamic" else 24,
               max_batch_total_tokens=192, block_size=4, max_num_seqs=6)
    cfg.update(overrides)
    return Engine(*model_tok, EngineConfig(**cfg))


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_greedy_matches_hf_generate_under_every_policy(arch, request):
    model_tok = request.getfixturevalue(arch)
    model = model_tok[0]
    ps = prompts(min(2000, model.config.vocab_size))
    refs = [hf_greedy(model, p, MAX_TOKENS) for p in ps]
    for policy in POLICIES:
        eng = engine_for(model_tok, policy)
        outs = eng.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        for i, (o, ref) in enumerate(zip(outs, refs)):
            assert o.token_ids == ref, f"{arch}/{policy}: prompt {i} ({len(ps[i])} tokens) diverged"
            assert o.finish_reason == "length" and len(o.token_times) == MAX_TOKENS
        chunked = [it for it in eng.iterations if it.num_prefill_tokens and it.num_decode_tokens]
        if policy == "stall_free":
            assert chunked, "stall_free never ran a hybrid decode + prefill pass"
        assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.engine
@pytest.mark.parametrize("arch,compiled", [("llama", False), ("llama", True), ("gpt2", True),
                                           ("qwen2", True)])
def test_a_long_context_decoding_beside_short_ones_matches_hf(arch, compiled, request):
    """Decodes are attended in groups of similar context length (one long request does not pad
    the short ones); the outputs stay HF's, eager or with the compiled in-place decode kernel
    (GPT-2: no GQA; Qwen2 here: four query heads per KV head)."""
    model_tok = request.getfixturevalue(arch)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in [450, 6, 11, 3, 19, 8, 14, 2]]
    refs = [hf_greedy(model_tok[0], p, 10) for p in ps]
    eng = engine_for(model_tok, "stall_free", max_batch_prefill_tokens=256, max_batch_total_tokens=1024,
                     max_num_seqs=8, compile_decode_attention=compiled)
    groups_per_pass = []
    make_groups = eng.runner._decode_groups

    def spy(seqs, rows):
        groups = make_groups(seqs, rows)
        groups_per_pass.append([g.blocks.shape for g in groups])
        return groups

    eng.runner._decode_groups = spy
    # Compiled: every shape class was compiled at start; a recompile mid-stream would raise here.
    with torch._dynamo.config.patch(error_on_recompile=compiled):
        outs = eng.generate(ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    # Once every request decodes: the long one alone, the seven short ones in one padded group
    # of a few blocks (not 700 tokens wide).
    full = [shapes for shapes in groups_per_pass if sum(s[0] for s in shapes) == len(ps)]
    assert full, "no pass decoded every request at once"
    for shapes in full:
        assert sorted(s[0] for s in shapes) == [1, 7]
        widths = sorted(s[1] for s in shapes)  # in blocks of 4 tokens
        assert widths[0] <= 8 and widths[1] >= 450 // 4
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.engine
@pytest.mark.parametrize("caching", [False, True])
def test_preemption_keeps_outputs_correct(llama, caching):
    """A preempted request frees its references; recomputed (finding its own prefix again
    when cached), it produces the same tokens."""
    ps = prompts(2000)[:6]
    refs = [hf_greedy(llama[0], p, 20) for p in ps]
    expected = {False: {"stall_free": 10, "dynamic": 3}, True: {"stall_free": 6, "dynamic": 3}}
    for policy, preemptions in expected[caching].items():
        # 24 blocks of 4 tokens: a few requests at once, then KV runs out mid-generation.
        eng = engine_for(llama, policy, max_batch_total_tokens=96, max_batch_prefill_tokens=96,
                         enable_prefix_caching=caching)
        outs = eng.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == refs
        # Scheduling depends on lengths only (ignore_eos), so the count is exact.
        assert sum(o.num_preemptions for o in outs) == preemptions, policy
        assert sum(it.num_preempted for it in eng.iterations) == preemptions
        assert eng.blocks.num_used == 0
        eng.blocks.check()


@pytest.mark.engine
def test_sampling_is_reproducible_with_a_seed(llama):
    eng = engine_for(llama, "stall_free")
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = eng.generate(["the quick brown fox"] * 3, p)
    b = eng.generate(["the quick brown fox"], p)
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids == b[0].token_ids
    other = eng.generate(["the quick brown fox"], SamplingParams(**{**p.__dict__, "seed": 99}))
    assert other[0].token_ids != a[0].token_ids


@pytest.mark.engine
def test_stop_strings_token_ids_and_text(llama):
    eng = engine_for(llama, "stall_free")
    full = eng.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert full.text == llama[1].decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[10:13]
    cut = eng.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    tid = full.token_ids[4]
    by_id = eng.generate(["hello there"], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[tid]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:full.token_ids.index(tid) + 1]
    eos = llama[1].eos_token_id
    forced = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[]))[0]
    # These five greedy tokens of the fixed-seed model contain no EOS: the length stop ends it.
    assert forced.finish_reason == "length" and len(forced.token_ids) == 5 and eos not in forced.token_ids


@pytest.mark.engine
@pytest.mark.parametrize("bad, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 10**9]), "token ids"),
    (dict(max_tokens=10_000), "context length"),
    (dict(max_tokens=300), "KV cache capacity"),
    (dict(priority=10**6), "priority"),
])
def test_bad_input_is_a_value_error_and_nothing_is_admitted(llama, bad, field):
    eng = engine_for(llama, "stall_free", max_batch_total_tokens=256)
    prompt = bad.pop("prompt", "hi")
    priority = bad.pop("priority", 0)
    with pytest.raises(ValueError, match=field):
        eng.add_request(prompt, SamplingParams(temperature=0, **bad), priority=priority)
    assert not eng.has_unfinished() and not eng.requests


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=10**7), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(seed=-5), "seed"),
    (dict(stop=[""]), "stop"), (dict(stop=["x"] * 17), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_absurd_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.engine
def test_dynamic_refuses_prompts_longer_than_mbp(llama):
    eng = engine_for(llama, "dynamic", max_batch_prefill_tokens=32)
    with pytest.raises(ValueError, match="max_batch_prefill_tokens"):
        eng.add_request(list(range(5, 45)), SamplingParams(max_tokens=4))
    batch = eng.generate([[5, 6, 7], list(range(5, 35))], SamplingParams(max_tokens=2, temperature=0))
    assert [len(o.token_ids) for o in batch] == [2, 2] and [o.finish_reason for o in batch] == ["length"] * 2


@pytest.mark.engine
async def test_async_stream_abort_frees_blocks_and_loop_survives(llama):
    eng = engine_for(llama, "stall_free", max_batch_total_tokens=512)
    ae = AsyncEngine(eng)
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = await ae.add_request([[5, 6, 7, 8]], params, "gone")
        got = 0
        async for out in stream:
            got += len(out.delta_token_ids)
            if got >= 3:
                break
        await stream.aclose()  # the client went away
        with pytest.raises(InvalidRequestError, match="prompt must not be empty") as bad:
            await ae.add_request([[]], params, "bad")
        assert bad.value.param == "prompt"
        with pytest.raises(TypeError, match="token ids"):  # the tokenizer is the loop's
            await ae.add_request("text", params, "text")
        finished = [o async for o in await ae.add_request([[9, 10]], SamplingParams(max_tokens=5, temperature=0,
                                                                                  ignore_eos=True), "ok")]
        assert sum(len(o.delta_token_ids) for o in finished) == 5 and finished[-1].finish_reason == "length"
        for _ in range(100):
            if eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests:
                break
            await asyncio.sleep(0.02)
        assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests
        assert ae.is_healthy()
    finally:
        ae.shutdown()


@pytest.mark.engine
async def test_async_stream_of_n_samples_carries_each_and_aborts_all(llama):
    """One stream for the n samples of a prompt: every delta names its sample (index), deltas of
    different samples are never merged, and a caller that leaves aborts every sample."""
    eng = engine_for(llama, "stall_free", max_batch_total_tokens=512)
    ae = AsyncEngine(eng)
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=3)
        outs = [o async for o in await ae.add_request([[5, 6, 7, 8, 9]], params, "n3")]
        by = {j: [o for o in outs if o.index == j] for j in range(3)}
        assert {o.request_id for o in by[1]} == {"n3#1"} and {o.request_id for o in by[0]} == {"n3"}
        tokens = [[t for o in by[j] for t in o.delta_token_ids] for j in range(3)]
        assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 5  # greedy: equal samples
        assert [sum(o.finished for o in by[j]) for j in range(3)] == [1, 1, 1]
        stream = await ae.add_request([[5, 6, 7, 8]], dataclasses.replace(params, max_tokens=200), "gone")
        async for out in stream:
            if out.num_output_tokens >= 2:
                break
        await stream.aclose()  # the client went away: all three samples are aborted
        for _ in range(200):
            if not eng.requests:
                break
            await asyncio.sleep(0.02)
        assert not eng.requests and eng.blocks.num_used == 0
    finally:
        ae.shutdown()


@pytest.mark.engine
async def test_a_stream_interval_merges_the_tokens_between_deltas(llama):
    """With stream_interval_s each stream's first delta goes at once and later ones at most once
    an interval, carrying every token since: the same tokens and text, in a handful of deltas."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=2)
    runs = {}
    for interval in (0.0, 2.0):
        ae = AsyncEngine(engine_for(llama, "stall_free", max_batch_total_tokens=512), stream_interval_s=interval)
        try:
            runs[interval] = [o async for o in await ae.add_request([[5, 6, 7, 8]], params, "s")]
        finally:
            ae.shutdown()
    for j in range(2):
        every, merged = ([o for o in runs[i] if o.index == j] for i in (0.0, 2.0))
        assert [t for o in merged for t in o.delta_token_ids] == [t for o in every for t in o.delta_token_ids]
        assert "".join(o.delta_text for o in merged) == "".join(o.delta_text for o in every)
        assert sum(len(o.delta_token_ids) for o in merged) == 40
        if j == 0:  # the first delta goes at once, not held for the interval: with what the engine
            # had produced by the time the caller read it (one token, or more on a busy machine)
            assert 1 <= len(merged[0].delta_token_ids) < 40 and len(merged) >= 2
        # 40 tokens take well under 2 s here: a handful of deltas (generous for a slow machine).
        assert len(merged) <= 10 and merged[-1].finished and sum(o.finished for o in merged) == 1


@pytest.mark.engine
@pytest.mark.parametrize("policy, stalls", [("dynamic", True), ("stall_free", False)])
def test_generation_stalls_are_counted_only_where_they_happen(llama, policy, stalls):
    """A long prompt arriving while others decode stalls them under dynamic, never under stall_free."""
    eng = engine_for(llama, policy, max_batch_prefill_tokens=64, max_batch_total_tokens=512)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    short = [eng.add_request([5 + i, 6, 7], params) for i in range(3)]
    for _ in range(3):
        eng.step()
    eng.add_request(list(range(5, 65)), params)
    while eng.has_unfinished():
        eng.step()
    stalled = [it.num_stalled for it in eng.iterations]
    if stalls:
        assert 3 in stalled  # the long prompt's pass gave the 3 streams nothing
    else:
        assert set(stalled) == {0}
    assert all(len(r.output_token_ids) == 10 for r in short)


@pytest.mark.engine
def test_a_request_never_scheduled_within_the_queue_deadline_is_refused_with_queue_timeout():
    """One sequence slot: the second request waits; past queue_timeout_s it leaves, unscheduled,
    holding no KV; the running one is not affected."""
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(max_num_seqs=1, max_batch_total_tokens=512,
                                                               queue_timeout_s=5.0))
    now = [100.0]
    eng.scheduler.clock = lambda: now[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    running = eng.add_request([5, 6, 7], params, "running", arrival_time=100.0)
    eng.add_request([8, 9], params, "late", arrival_time=100.0)
    eng.step()
    now[0] = 105.0  # exactly the deadline: still waiting
    assert [o.request_id for o in eng.step() if o.finished] == []
    now[0] = 105.01
    outs = eng.step()
    late = [o for o in outs if o.request_id == "late"]
    assert len(late) == 1 and late[0].finished and late[0].finish_reason == "queue_timeout"
    assert late[0].num_output_tokens == 0 and "late" not in eng.requests
    while eng.has_unfinished():
        eng.step()
    assert len(running.output_token_ids) == 20 and running.finish_reason == "length"
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.engine
def test_a_slow_caller_gets_the_queued_deltas_merged_in_order():
    """Deltas that pile up while the caller is busy arrive as one, text and ids in order."""
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_total_tokens=512))
    reference = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    loop = AsyncEngine(eng)

    async def run() -> list:
        stream = await loop.add_request([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0,
                                                                  ignore_eos=True), "slow")
        first = await anext(stream)
        while "slow" in loop._streams:  # the loop delivers the rest (finished last) while we wait
            await asyncio.sleep(0.01)
        return [first] + [out async for out in stream]

    try:
        outs = asyncio.run(run())
    finally:
        loop.shutdown()
    assert 1 <= len(outs) < 40  # deltas that queued up behind the caller came merged
    assert [t for o in outs for t in o.delta_token_ids] == reference.token_ids
    assert "".join(o.delta_text for o in outs) == reference.text
    assert outs[-1].finished and outs[-1].num_output_tokens == 40 and outs[-1].finish_reason == "length"


@pytest.mark.engine
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_logprobs_are_the_models_own_log_softmax(llama, temperature):
    """Each generated token's logprob and its top-5 alternatives equal log_softmax of HF's own
    forward over the same sequence (raw: before temperature/top-k/top-p), with prompts split
    into chunks and decodes batched; requests without logprobs get none."""
    model = llama[0]
    ps = prompts(2000)[:5]
    eng = engine_for(llama, "stall_free")
    params = [SamplingParams(max_tokens=8, temperature=temperature, top_k=50, seed=i, ignore_eos=True,
                             logprobs=5 if i != 2 else None) for i in range(len(ps))]
    outs = eng.generate(ps, params)
    assert outs[2].logprobs is None
    for i, (p, o) in enumerate(zip(ps, outs)):
        if i == 2:
            continue
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([p + o.token_ids])).logits[0].float(), dim=-1)
        assert len(o.logprobs) == len(o.token_ids) == 8
        for j, (tok, (lp, top)) in enumerate(zip(o.token_ids, o.logprobs)):
            row = ref[len(p) + j - 1]
            assert lp == pytest.approx(row[tok].item(), abs=1e-4)
            values, ids = row.topk(5)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
            if temperature == 0.0:
                assert tok == top[0][0]  # greedy picks the most likely token


@pytest.mark.engine
def test_logprobs_stream_with_their_tokens(llama):
    eng = engine_for(llama, "stall_free")
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    streamed = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.delta_token_ids)
            streamed += out.logprobs
    assert len(streamed) == 6 and all(len(t.top) == 2 and t.top[0][0] == t.token_id for t in streamed)
    assert all(isinstance(t.token, str) and t.logprob <= 0 for t in streamed)
    assert streamed[0].token == eng.tokenizer.decode([streamed[0].token_id])


@pytest.mark.unit
def test_logprobs_out_of_range_name_the_field():
    with pytest.raises(InvalidRequestError, match="logprobs") as e:
        SamplingParams(logprobs=21)
    assert e.value.param == "logprobs"


@pytest.mark.engine
def test_the_pass_in_progress_is_visible_to_the_engines_drain_rate(llama):
    """`pass_started` holds when the running pass began (the engine's drain rate judges a backlog
    up to then: a long pass is not a stall) and is cleared once it ended."""
    eng = engine_for(llama, "stall_free")
    seen = []
    prepare = eng.runner.prepare

    def watched(batch, *args):  # noqa: ANN001, ANN002, ANN202
        seen.append(eng.pass_started)
        return prepare(batch, *args)

    eng.runner.prepare = watched
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "a")
    while eng.has_unfinished():
        eng.step()
    assert seen and all(t is not None for t in seen) and eng.pass_started is None
    assert [round(t, 9) for t in seen] == [round(s.start, 9) for s in list(eng.iterations)[-len(seen):]]
