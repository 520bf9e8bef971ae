"""The overlapped loop (`engine.overlap: on`) gives every client what the synchronous loop gives:
the same greedy tokens, the same seeded samples, logprobs within 1e-6, the same usage, and no
token after a stop; and each rule of the scheduler's in-flight accounting holds (one test each)."""

from __future__ import annotations

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.engine import CompletionOutput
from replicas.loading.models import load_model
from replicas.protocol import GuidedDecoding, RequestOutput
from replicas.request import RequestStatus

pytestmark = pytest.mark.engine

PROMPTS = [list(range(5 + 3 * i, 45 + 3 * i)) for i in range(8)]
SHARED = list(range(100, 148))  # three full blocks: the second request's prompt hits the cache


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def engine_for(llama, overlap: str, **config) -> Engine:
    cfg = dict(max_batch_prefill_tokens=32, max_batch_total_tokens=1024) | config
    return Engine(*llama, EngineConfig(overlap=overlap, **cfg))


def reference(llama) -> list[CompletionOutput]:
    """Greedy outputs without stops, to pick stop tokens and strings that do occur mid-output."""
    eng = engine_for(llama, "off")
    return eng.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def mixed(llama) -> tuple[list[list[int]], list[SamplingParams]]:
    """The mixed workload: EOS-style stop tokens, stop strings, max_tokens, prefix hits, n > 1,
    penalties and logit_bias, logprobs, seeded samples and a guided request."""
    ref = reference(llama)
    stop_token = ref[0].token_ids[4]
    stop_text = ref[1].text[len(ref[1].text) // 2:][:2]
    assert stop_text.strip(), "the reference output must give a stop string"
    prompts = PROMPTS[:2] + PROMPTS[2:7] + [SHARED + [1, 2, 3], SHARED + [4, 5], PROMPTS[7]]
    params = [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token]),  # a stop token
        SamplingParams(max_tokens=12, temperature=0, stop=[stop_text]),  # a stop string
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),  # max_tokens
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=11, logprobs=3),  # seeded + logprobs
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=5, n=3),  # n > 1
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5,
                       logit_bias={7: 5.0}),  # penalties
        SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=2, logprobs=1),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),  # prefix: first holder
        SamplingParams(max_tokens=10, temperature=0.7, seed=2, ignore_eos=True),  # prefix hit
        SamplingParams(max_tokens=12, temperature=0,
                       guided=GuidedDecoding("regex", r"[a-z]{2,5}@[a-z]{2,4}\.com", "guided_regex")),
    ]
    return prompts, params


def assert_same(a: list[CompletionOutput], b: list[CompletionOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids, x.request_id
        # usage: prompt and completion tokens (cached tokens depend on when a request is admitted
        # beside the one computing its prefix: scheduling, which the lag may move by a pass)
        assert (x.text, x.finish_reason, len(x.prompt_token_ids)) == (y.text, y.finish_reason, len(y.prompt_token_ids))
        for lx, ly in ((x.logprobs, y.logprobs), (x.prompt_logprobs, y.prompt_logprobs)):
            assert (lx is None) == (ly is None)
            for (vx, tx), (vy, ty) in zip(lx or [], ly or [], strict=True):
                assert abs(vx - vy) <= 1e-6 and [i for i, _ in tx] == [i for i, _ in ty]
                assert all(abs(p - q) <= 1e-6 for (_, p), (_, q) in zip(tx, ty, strict=True))


def test_the_mixed_workload_is_the_same_overlapped(llama) -> None:
    prompts, params = mixed(llama)
    sync = engine_for(llama, "off").generate(prompts, params)
    eng = engine_for(llama, "on")
    over = eng.generate(prompts, params)
    assert_same(sync, over)
    assert {o.finish_reason for o in sync} == {"stop", "length"}
    hits = [o.num_cached_tokens for outs in (sync, over) for o in outs if o.prompt_token_ids[:len(SHARED)] == SHARED]
    assert hits[1] > 0 and hits[3] > 0, "no prefix hit: nothing was tested"
    assert eng.blocks.num_free == engine_for(llama, "off").blocks.num_free  # every block back


def test_preemption_overlapped_gives_the_same_tokens(llama) -> None:
    """A KV cache too small for every stream: running decodes are preempted (some while their
    pass is in flight) and recomputed, with the same tokens as the synchronous loop."""
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=9, ignore_eos=True, logprobs=2)] * 3
    prompts = [PROMPTS[i] for i in range(6)]
    cfg = dict(max_batch_total_tokens=320, kv_watermark=0.0)
    sync_eng, over_eng = engine_for(llama, "off", **cfg), engine_for(llama, "on", **cfg)
    sync, over = sync_eng.generate(prompts, params), over_eng.generate(prompts, params)
    assert_same(sync, over)
    assert sum(o.num_preemptions for o in over) > 0, "nothing was preempted: nothing was tested"


def test_in_flight_tokens_count_toward_max_tokens(llama) -> None:
    """No pass computes a token past max_tokens: each request samples exactly its max_tokens."""
    eng = engine_for(llama, "on")
    sampled: dict[str, int] = {}
    launched = eng.scheduler.launched

    def counting(batch):  # noqa: ANN001, ANN202
        for seq in batch.seqs:
            if seq.samples:
                sampled[seq.request.request_id] = sampled.get(seq.request.request_id, 0) + 1
        return launched(batch)

    eng.scheduler.launched = counting
    outs = eng.generate(PROMPTS[:4], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 5, 9)])
    assert [len(o.token_ids) for o in outs] == [1, 2, 5, 9]
    assert [sampled[o.request_id] for o in outs] == [1, 2, 5, 9]


def test_a_non_final_prefill_chunk_makes_no_in_flight_token(llama) -> None:
    eng = engine_for(llama, "on", max_batch_prefill_tokens=16)
    req = eng.add_request(list(range(5, 55)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append((req.num_computed_tokens, req.num_inflight))
    # 50 prompt tokens in chunks of 16: three chunks with nothing in flight, then the last one's token
    assert seen[:3] == [(16, 0), (32, 0), (48, 0)] and seen[3] == (50, 1)


def test_kv_is_reserved_for_the_in_flight_token(llama) -> None:
    """A decode scheduled while its previous token is in flight has KV for that token's position."""
    eng = engine_for(llama, "on")
    schedule, checked = eng.scheduler.schedule, []

    def checking():  # noqa: ANN202
        out = schedule()
        for seq in out.decodes:
            req = seq.request
            if req.num_inflight:
                capacity = len(eng.blocks.block_table(req.request_id)) * eng.blocks.block_size
                assert seq.start == req.num_tokens - 1 and capacity >= req.num_tokens
                checked.append(seq)
        return out

    eng.scheduler.schedule = checking
    eng.generate(PROMPTS[:3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(checked) > 20


def test_a_stopped_requests_next_token_is_dropped(llama) -> None:
    """The pass launched before the stop was seen computes one more token for the request: it is
    never streamed, counted, or kept in the prefix cache, and the request's blocks are freed when
    that pass lands."""
    stop_token = reference(llama)[0].token_ids[4]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token], logprobs=1)
    eng = engine_for(llama, "on", block_size=5)  # the stop's position ends a block
    free = eng.blocks.num_free
    req = eng.add_request(PROMPTS[0], params)
    streamed: list[RequestOutput] = []
    dropped_at = None
    while eng.has_unfinished():
        streamed += [o for o in eng.step() if o.request_id == req.request_id]
        if req.is_finished and dropped_at is None:
            dropped_at = req.num_inflight  # its next pass is still in flight
            assert eng.blocks.block_table(req.request_id), "blocks freed before the pass landed"
    assert dropped_at == 1, "no pass was in flight at the stop: nothing was tested"
    tokens = [t for o in streamed for t in o.delta_token_ids]
    assert tokens == req.output_token_ids and tokens[-1] == stop_token and len(tokens) == 5
    assert streamed[-1].finished and streamed[-1].num_output_tokens == 5 and len(req.output_logprobs) == 5
    assert req.num_computed_tokens == len(PROMPTS[0]) + 4  # the dropped pass's KV is not counted
    assert not eng.blocks.block_table(req.request_id) and eng.blocks.num_free == free
    # the cached blocks hash only the request's own tokens (prompt + 5 outputs: 9 full blocks of 5)
    assert len(req.block_hashes) <= (len(PROMPTS[0]) + 5) // 5


def test_an_abort_in_flight_takes_effect_once_the_pass_drained(llama) -> None:
    eng = engine_for(llama, "on")
    a = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), "a")
    b = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), "b")
    streamed: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for o in eng.step():
            streamed[o.request_id] += o.delta_token_ids
    assert a.num_inflight == 1
    final = eng.abort("a")
    assert final is not None and final.finished and final.finish_reason == "abort"
    streamed["a"] += final.delta_token_ids
    assert eng.blocks.block_table("a"), "its pass is in flight: its blocks stay until it lands"
    while eng.has_unfinished():
        for o in eng.step():
            streamed[o.request_id] += o.delta_token_ids
    assert not eng.blocks.block_table("a") and a.status == RequestStatus.FINISHED_ABORTED
    assert streamed["a"] == a.output_token_ids and len(streamed["a"]) < 20  # nothing after the abort
    sync = engine_for(llama, "off").generate(PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0,
                                                                         ignore_eos=True))
    assert streamed["b"] == sync[1].token_ids and streamed["a"] == sync[0].token_ids[:len(streamed["a"])]


def test_passes_that_read_the_output_history_run_synchronously(llama) -> None:
    """Penalties and grammars read the whole output on the host: no pass is in flight when one of
    their passes is planned; plain decodes overlap."""
    eng = engine_for(llama, "on")
    prepare, lagged = eng.runner.prepare, []

    def watching(batch):  # noqa: ANN001, ANN202
        history = any(s.request.params.processes_logits for s in batch.seqs if s.request.output_token_ids)
        lagged.append((history, eng._in_flight is not None))
        return prepare(batch)

    eng.runner.prepare = watching
    eng.generate(PROMPTS[:2], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               SamplingParams(max_tokens=4, temperature=0, presence_penalty=1.0, ignore_eos=True)])
    assert not any(h and lag for h, lag in lagged)
    assert any(lag for h, lag in lagged), "no pass overlapped"


def test_auto_overlaps_with_cuda_only(llama) -> None:
    import torch

    from replicas.engine import resolve_overlap
    assert not resolve_overlap("auto", torch.device("cpu")) and resolve_overlap("auto", torch.device("cuda"))
    assert resolve_overlap("on", torch.device("cpu")) and not resolve_overlap("off", torch.device("cuda"))
    assert not engine_for(llama, "auto").overlap and engine_for(llama, "on").overlap


def test_a_failed_pass_in_flight_leaves_no_token_in_flight(llama) -> None:
    """A pass that fails on the device: its requests' in-flight counts go, the caller aborts them,
    and every block comes back."""
    eng = engine_for(llama, "on")
    free = eng.blocks.num_free
    for p in PROMPTS[:2]:
        eng.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    collect = eng.runner.collect

    def failing(handle):  # noqa: ANN001, ANN202
        eng.runner.collect = collect
        raise RuntimeError("device fault")

    eng.runner.collect = failing
    with pytest.raises(RuntimeError, match="device fault"):
        eng.step()
    for rid in list(eng.requests):  # what the async engine does after a failed step
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free == free and not eng.requests


def test_the_pass_in_progress_stays_visible_between_steps(llama) -> None:
    """Overlapped, a step returns while the next pass runs: `pass_started` (the drain rate's
    pass in progress) is that pass's start, and None only once nothing is in flight."""
    eng = engine_for(llama, "on")
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append((eng._in_flight is not None, eng.pass_started is not None))
    assert all(busy == started for busy, started in seen) and seen[0] == (True, True) and seen[-1] == (False, False)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_failed_pass_leaves_nothing_in_the_prefix_cache(llama, overlap: str) -> None:
    """The forward of a pass fails (its KV never written): none of its chunks' blocks joins the
    prefix cache, so the same prompt sent again is computed, not read from unwritten blocks, and
    gets the tokens it gets on a fresh engine."""
    prompt = list(range(40, 90))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = engine_for(llama, overlap).generate([prompt], params)[0].token_ids
    eng = engine_for(llama, overlap)
    forward = eng.runner.forward

    def failing(prep):  # noqa: ANN001, ANN202
        eng.runner.forward = forward
        raise RuntimeError("device fault")

    eng.runner.forward = failing
    eng.add_request(prompt, params)
    with pytest.raises(RuntimeError, match="device fault"):
        while eng.has_unfinished():
            eng.step()
    for rid in list(eng.requests):  # what the async engine does after a failed step
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    out = eng.generate([prompt], params)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == want


def test_an_id_is_not_reused_while_its_request_still_holds_blocks(llama) -> None:
    """A request that stopped keeps its blocks until its in-flight pass lands: its id is refused
    until then (the block manager keys tables by id), and accepted after."""
    from replicas.protocol import InvalidRequestError

    eng = engine_for(llama, "on")
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id="a")
    for _ in range(3):
        eng.step()
    eng.abort("a")
    assert "a" not in eng.requests and eng.blocks.block_table("a")  # the pass in flight still writes them
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(PROMPTS[1], SamplingParams(max_tokens=2), request_id="a")
    while eng.has_unfinished():
        eng.step()
    assert not eng.blocks.block_table("a")
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), request_id="a")
