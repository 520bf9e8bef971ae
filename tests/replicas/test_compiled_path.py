"""The flex path compiled as it is on a GPU, traced here with dynamo's eager backend (the graphs
and guards dynamo makes for inductor, no code generated):

- every shape group compiles at start and nothing after, over a schedule with one row alone,
  mixed passes, chunked prefill with context, decode-only passes in every bucket, and
  preemption; the tokens are the SDPA path's;
- the decode step is one graph per bucket (compiled with fullgraph=True: a graph break fails);
- a flex path that fails to start leaves a runner serving on SDPA that says so.
"""

from __future__ import annotations

import logging
import shutil
import types

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.cuda_graphs import DecodeGraphs
from replicas.loading.models import load_model

pytestmark = pytest.mark.engine

LENS = [1, 70, 5, 33, 150, 12, 9, 64, 2, 40, 21, 3]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def config(**overrides) -> EngineConfig:
    cfg = dict(max_batch_prefill_tokens=32, max_batch_total_tokens=1024, block_size=4, max_num_seqs=12)
    return EngineConfig(**(cfg | overrides))


def run_schedule(eng: Engine) -> tuple[dict[str, list[int]], list[int]]:
    """One short prompt alone for a few passes, then the rest arriving two a pass; outputs of
    different lengths, so the batch grows to all twelve and shrinks back to one. Returns each
    request's tokens and the bucket of every decode-only pass."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 1900, (n,), generator=g).tolist() for n in LENS]
    buckets: list[int] = []
    graphs = eng.runner.graphs
    if graphs is not None:
        plan = graphs.plan

        def spy(tokens, rows, lens, bucket, pack):
            buckets.append(bucket)
            return plan(tokens, rows, lens, bucket, pack)

        graphs.plan = spy
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or eng.has_unfinished():
        if steps >= 3:
            for i, p in pending[:2]:
                eng.add_request(p, SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True),
                                request_id=f"r{i}")
            pending = pending[2:]
        elif steps == 0:
            i, p = pending.pop(0)
            eng.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id=f"r{i}")
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
        steps += 1
    return tokens, buckets


def test_nothing_compiles_after_warm_up_over_a_realistic_schedule(llama):
    eng = Engine(*llama, config(attention_backend="flex", cuda_graphs=True, compile_backend="eager"))
    runner = eng.runner
    assert runner.path == "flex+graphs" and runner.fallback_error is None
    warm, after = runner.compiles
    # the decodes' attention call per bucket (1, 2, 4, 8, 12: static, flex's decoding kernel),
    # 2 chunk shape groups (1 / several rows) and one decode step per bucket
    assert (warm, after) == (5 + 2 + 5 + 1, 0)  # + the first bucket again (see ModelRunner.warm_up)
    decode_calls: list[tuple[int, int]] = []  # (decodes, their bucket) of each pass through the backend
    buckets_of = runner.backend.decode_buckets
    plan = buckets_of.plan

    def spy(table, rows, lens, pos, bs, pack):
        parts = plan(table, rows, lens, pos, bs, pack)
        decode_calls.append((len(rows), parts["padded"].shape[1] if parts else 0))
        return parts

    buckets_of.plan = spy
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, buckets = run_schedule(eng)
    assert runner.compiles == (warm, 0)
    assert set(buckets) == {1, 2, 4, 8, 12}  # decode-only passes in every bucket
    its = list(eng.iterations)
    mixed = [it for it in its if it.num_prefill_tokens and it.num_decode_tokens]
    assert mixed  # mixed passes: their decodes padded to a static bucket each (flex decoding)
    assert len(decode_calls) == len(mixed) and all(
        n <= b == min(x for x in buckets_of.buckets if x >= n) for n, b in decode_calls)
    assert eng.blocks.num_used == 0
    want, _ = run_schedule(Engine(*llama, config()))
    assert got == want


def test_preemption_and_chunked_context_compile_nothing_new(llama):
    """KV for a few requests only: requests are preempted and recomputed (chunks with context
    again), and still nothing compiles after warm-up."""
    eng = Engine(*llama, config(attention_backend="flex", cuda_graphs=True, compile_backend="eager",
                                max_batch_total_tokens=240))
    got, _ = run_schedule(eng)
    assert sum(it.num_preempted for it in eng.iterations) > 0
    assert eng.runner.compiles[1] == 0
    want, _ = run_schedule(Engine(*llama, config(max_batch_total_tokens=240)))
    assert got == want


def test_the_decode_step_is_one_graph(llama):
    """fullgraph=True under aot_eager (functionalized, as inductor receives it): a graph break
    in the model's forward, the attention or the mask raises, and the runner falls back."""
    torch._dynamo.utils.counters.clear()
    eng = Engine(*llama, config(attention_backend="flex", cuda_graphs=True, compile_backend="aot_eager",
                                max_num_seqs=2))
    assert eng.runner.path == "flex+graphs", eng.runner.fallback_error
    assert not torch._dynamo.utils.counters["graph_break"]
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    ref = Engine(*llama, config()).generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0,
                                                                           ignore_eos=True))
    assert out[0].token_ids == ref[0].token_ids


def test_a_flex_path_that_fails_to_start_falls_back_to_sdpa(llama, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("NoValidChoicesError: injected")

    monkeypatch.setattr(DecodeGraphs, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="replicas.execution.model_runner"):
        eng = Engine(*llama, config(attention_backend="flex", cuda_graphs=True, compile_backend="eager"))
    runner = eng.runner
    assert runner.path == "sdpa (fallback)" and runner.attention_backend == "sdpa"
    assert runner.graphs is None and "NoValidChoicesError: injected" in runner.fallback_error
    assert any("NoValidChoicesError: injected" in r.getMessage() for r in caplog.records)
    ps = [[5, 6, 7], list(range(40, 75))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert ([o.token_ids for o in eng.generate(ps, params)]
            == [o.token_ids for o in Engine(*llama, config()).generate(ps, params)])


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")
def test_a_compiled_pass_writes_the_kv_cache_in_place(llama):
    """Under inductor (its CPU code here), a pass's k/v go into the runner's cache in place: no
    loop over a whole layer's cache in the generated code. Selecting the layer from the one
    cache tensor inside the graph (what the runner did before) copies the cache in and back."""
    from torch._inductor.utils import run_and_get_code

    from replicas.execution.attention import PassMeta, paged_attention

    class Echo:
        def attend(self, module, q, k, v, kc, vc, scaling):  # noqa: ANN001, ANN201
            return q

    runner = Engine(*llama, config(max_batch_total_tokens=4096)).runner
    layer_numel = runner.k_cache[0].numel()
    layers = [types.SimpleNamespace(layer_idx=i) for i in range(runner.k_cache.shape[0])]

    def generated(k_cache, v_cache) -> str:
        def step(q, k, v, slots):  # noqa: ANN001, ANN202
            meta = PassMeta(k_cache, v_cache, slots, Echo())
            for m in layers:
                q = paged_attention(m, q, k, v, None, attn_meta=meta)[0].transpose(1, 2)
            return q

        torch._dynamo.reset()
        _, _, kv_heads, d = runner.k_cache.shape
        q, k = torch.randn(1, 2 * kv_heads, 3, d), torch.randn(1, kv_heads, 3, d)
        with torch.inference_mode():
            _, codes = run_and_get_code(torch.compile(step, fullgraph=True), q, k, k.clone(),
                                        torch.tensor([5, 9, 100]))
        return "\n".join(codes)

    assert f"{layer_numel}L" not in generated(runner.k_layers, runner.v_layers)
    assert f"{layer_numel}L" in generated(runner.k_cache, runner.v_cache)  # the test can tell


def test_serving_stays_compiled_past_the_recompile_limit(llama):
    """9 decode buckets (max_num_seqs 256), past dynamo's 8 graphs per code object (a shared step
    failed the 9th, and the runner fell back to SDPA; at the default 128 too, whose first bucket
    compiles twice): each bucket's step and decode attention are code objects of their own, so
    none falls back, and a batch in the ninth bucket compiles nothing."""
    max_num_seqs = 256
    eng = Engine(*llama, config(attention_backend="flex", cuda_graphs=True, compile_backend="eager",
                                max_num_seqs=max_num_seqs, max_batch_prefill_tokens=2 * max_num_seqs,
                                max_batch_total_tokens=2048))
    runner = eng.runner
    assert runner.path == "flex+graphs", runner.fallback_error
    assert len(runner.graphs.buckets) == 9  # 1, 2, 4, ..., 128, 256
    # dynamo keeps graphs on the code object itself: ten objects (equal in content, so by id)
    assert len({id(step._torchdynamo_orig_callable.__code__) for step in runner.graphs.steps.values()}) == 9
    n = 136  # decode-only passes in bucket 256, the ninth (a prefill chunk per request: costly here)
    buckets: list[int] = []
    plan = runner.graphs.plan

    def spy(tokens, rows, lens, bucket, pack):
        buckets.append(bucket)
        return plan(tokens, rows, lens, bucket, pack)

    runner.graphs.plan = spy
    prompts = [[5 + i % 50, 7] for i in range(n)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs = eng.generate(prompts, [SamplingParams(max_tokens=2 + i % 3, temperature=0, ignore_eos=True)
                                      for i in range(n)])
    assert runner.compiles[1] == 0 and runner.path == "flex+graphs"
    assert 256 in buckets and [len(o.token_ids) for o in outs] == [2 + i % 3 for i in range(n)]
