"""The runner computes logits only for the rows someone reads: each sampling sequence's last
position, plus every prompt position of the requests that score their prompt; those prompt
scores equal log_softmax of HF's own forward over the same sequence, chunk by chunk, under every
policy and across preemption. max_tokens 0 scores the prompt and generates nothing."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.attention import PassLayout
from replicas.execution.attention_sdpa import SdpaBackend
from replicas.execution.model_runner import PAD_MIN, PAD_SLACK, ModelRunner
from replicas.loading.models import load_model
from replicas.execution.transfer import HostPack, Staging

pytestmark = pytest.mark.engine

PROMPT_LENS = [5, 40, 100, 1, 33, 64]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 2000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def engine(llama, policy: str = "stall_free", **overrides) -> Engine:
    cfg = dict(policy=policy, max_batch_prefill_tokens=100 if policy == "dynamic" else 24,
               max_batch_total_tokens=512, block_size=4, max_num_seqs=6)
    cfg.update(overrides)
    return Engine(*llama, EngineConfig(**cfg))


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)


def assert_prompt_scores(model, prompt: list[int], scores, k: int) -> None:
    """Entry i scores prompt token i + 1 from the logits at position i; top-k is the true top-k."""
    ref = hf_log_softmax(model, prompt)
    assert len(scores) == len(prompt) - 1
    for i, (lp, top) in enumerate(scores):
        row = ref[i]
        assert lp == pytest.approx(row[prompt[i + 1]].item(), abs=2e-5)
        values, ids = row.topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-5)


@pytest.mark.parametrize("policy", ["stall_free", "dynamic", "static"])
def test_prompt_logprobs_equal_hf_forward_chunk_by_chunk(llama, policy):
    model = llama[0]
    ps = prompts()
    params = [SamplingParams(max_tokens=0 if i % 2 else 4, temperature=0, ignore_eos=True,
                             prompt_logprobs=None if i == 2 else 3, logprobs=2 if i == 4 else None)
              for i in range(len(ps))]
    eng = engine(llama, policy)
    outs = eng.generate(ps, params)
    if policy != "dynamic":  # prompts cut into chunks of at most 24 tokens
        assert max(it.num_prefill_tokens for it in eng.iterations) <= 24
    for i, (p, sp, o) in enumerate(zip(ps, params, outs)):
        assert o.finish_reason == "length" and len(o.token_ids) == sp.max_tokens
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
            continue
        assert_prompt_scores(model, p, o.prompt_logprobs, 3)
    # A generated token's logprob after a scored prompt is the next position's, as before.
    ref = hf_log_softmax(model, ps[4] + outs[4].token_ids)
    assert outs[4].logprobs[0][0] == pytest.approx(ref[len(ps[4]) - 1, outs[4].token_ids[0]].item(), abs=2e-5)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def kept_rows(eng: Engine) -> list[int]:
    """Logits rows the model computes in each pass (the length of its logits_to_keep)."""
    rows: list[int] = []
    forward = eng.runner.model

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        rows.append(out.logits.shape[1])
        return out

    eng.runner.model = spy
    return rows


def test_only_the_rows_someone_reads_are_computed(llama):
    """Without prompt_logprobs a pass computes one row per sampling sequence; with it, one more
    per prompt token after the first (each once, even when the prompt is split into chunks)."""
    ps = prompts()
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng = engine(llama)
    rows = kept_rows(eng)
    eng.generate(ps, plain)
    assert sum(rows) == 3 * len(ps)  # one row per generated token, nothing for the prompts
    assert len(rows) == len(eng.iterations)
    rows.clear()
    scored = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0 if i < 2 else None)
              for i in range(len(ps))]
    eng.generate(ps, scored)
    assert sum(rows) == 3 * len(ps) + (len(ps[0]) - 1) + (len(ps[1]) - 1)


def test_prompt_logprobs_survive_preemption_unrepeated(llama):
    """KV for a few requests only: recomputed prompts are not scored twice, and scores stay HF's."""
    model = llama[0]
    ps = prompts()[:4]
    eng = engine(llama, max_batch_total_tokens=128, max_batch_prefill_tokens=48)
    outs = eng.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert sum(o.num_preemptions for o in outs) > 0
    for p, o in zip(ps, outs):
        assert_prompt_scores(model, p, o.prompt_logprobs, 1)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_prompt_logprobs_come_once_with_the_first_output(llama):
    eng = engine(llama)
    ids = prompts()[1]
    scored = eng.add_request(ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2))
    only = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    outputs: dict[str, list] = {scored.request_id: [], only.request_id: []}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id].append(out)
    first, *rest = outputs[scored.request_id]
    assert first.delta_token_ids and all(o.prompt_logprobs is None for o in rest)
    entries = first.prompt_logprobs
    assert [t.token_id for t in entries] == ids
    assert entries[0].logprob is None and entries[0].top == ()
    assert [(t.logprob, tuple((i, v) for i, _, v in t.top)) for t in entries[1:]] == scored.prompt_logprobs
    assert all(t.token == eng.tokenizer.decode([t.token_id]) for t in entries)
    [final] = outputs[only.request_id]  # max_tokens 0: one output, finished, the prompt scored
    assert final.finished and final.finish_reason == "length" and final.delta_token_ids == []
    assert final.num_output_tokens == 0 and final.delta_text == ""
    assert final.prompt_logprobs[0].logprob is None  # chunked differently: equal to fp32 noise
    assert [t.logprob for t in final.prompt_logprobs[1:]] == pytest.approx([t.logprob for t in entries[1:]],
                                                                         abs=2e-5)
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests


def test_decode_groups_cover_every_decode_once_and_bound_their_padding() -> None:
    """Over random context lengths (sorted, as the runner packs them): groups are contiguous, in
    order, cover each decode once; each pads to its longest at most PAD_SLACK x its real tokens
    + PAD_MIN; masks mark exactly each decode's context; block rows come from the table."""
    bs = 4
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        n = int(torch.randint(1, 64, (1,), generator=g))
        spread = [8, 64, 600][trial % 3]
        lens = sorted(int(x) for x in torch.randint(1, spread, (n,), generator=g))
        table = np.arange(n * 200).reshape(n, 200)  # row r holds blocks r*200, r*200+1, ...
        runner = types.SimpleNamespace(blocks=types.SimpleNamespace(block_size=bs), _table=table,
                                       _tensor=torch.from_numpy)
        groups = ModelRunner._decode_groups(runner, np.array(lens), np.arange(n))
        assert groups[0].start == 0
        covered = 0
        for grp in groups:
            b = grp.blocks.shape[0]
            assert grp.start == covered
            mine = lens[grp.start:grp.start + b]
            assert grp.lens.tolist() == mine
            assert b * mine[-1] <= PAD_SLACK * sum(mine) + PAD_MIN
            assert grp.blocks.shape[1] == -(-mine[-1] // bs)
            assert grp.blocks[:, 0].tolist() == [r * 200 for r in range(grp.start, grp.start + b)]
            covered += b
        assert covered == n
        # On the device: each group's mask marks exactly its decodes' contexts.
        pack = HostPack()
        layout = PassLayout(table, bs, list(range(n)), lens, [], n, groups)
        plan = SdpaBackend(bs).plan(layout, pack)
        pack.send(torch.device("cpu"), Staging(torch.device("cpu")))
        for grp, dev in zip(groups, SdpaBackend(bs).metadata(plan, pack, None).decodes):
            b = grp.blocks.shape[0]
            assert dev.blocks.tolist() == grp.blocks.tolist()
            assert dev.mask.shape == (b, 1, 1, grp.blocks.shape[1] * bs)
            assert dev.mask.sum(dim=-1).flatten().tolist() == grp.lens.tolist()


def test_compiled_decode_kernels_of_two_engines_in_one_process_stay_their_own(llama):
    """Each runner compiles its decode kernel for its own cache (sizes fixed in an engine are
    static in the kernel): two engines with different caches in one process never share graphs,
    so neither pushes the other past torch.compile's recompile limit (past it the kernel would
    silently run eagerly, materialising every context), and neither recompiles mid-stream."""
    ps = prompts()
    want = engine(llama).generate(ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    with torch._dynamo.config.patch(recompile_limit=4, fail_on_recompile_limit_hit=True):
        first = engine(llama, compile_decode_attention=True)
        second = engine(llama, compile_decode_attention=True, max_batch_total_tokens=768)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for eng in (first, second, first):
                outs = eng.generate(ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                assert [o.token_ids for o in outs] == [o.token_ids for o in want]
