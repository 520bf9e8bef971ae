"""Tensor parallelism on CPU (gloo, two processes: this one is rank 0, rank 1 a worker forked from a
server that has imported torch): every architecture the loader accepts that ships a plan gives
TP=1's logits within 1e-5 and its greedy tokens; a whole continuous-batching run (chunked prefill,
prefix hits, preemption, n > 1, seeded sampling, logprobs) gives identical tokens; a model the plan
cannot shard is refused before any worker starts; a worker killed mid-run fails the pass at once and
breaks the group for good (the replica turns unhealthy), and closing still returns."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.parallel import WorkerLost
from replicas.loading.model_files import planned_build
from replicas.loading.model_support import VERIFIED_MODEL_TYPES, tensor_parallel_plan
from replicas.loading.models import resolve_model_path

pytestmark = pytest.mark.process

PLANNED = sorted(t for t in VERIFIED_MODEL_TYPES if tensor_parallel_plan(AutoConfig.for_model(t)))
PROMPTS = [[3, 17, 99, 42, 250, 7, 7, 19, 201, 64, 33, 12, 5, 180, 77, 2, 141, 9], [8, 15, 16, 23, 42]]


def tiny_model(model_type: str, root: Path) -> str:
    """A tiny random model of `model_type` (fp32, 4 heads, 2 KV heads) saved with a tokenizer."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256)
    if model_type != "gpt_neox":
        shape.update(num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model(model_type, vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **shape)
    torch.manual_seed(0)
    path = root / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny")).save_pretrained(path)
    return str(path)


def run(model: str, tp: int, params: SamplingParams, prompts=PROMPTS, **config) -> list:
    engine = Engine.from_pretrained(model, EngineConfig(tensor_parallel_size=tp, num_threads=1, **config))
    try:
        return engine.generate(prompts, params)
    finally:
        engine.close()


def test_every_planned_architecture_is_sharded_and_the_rest_named() -> None:
    assert set(PLANNED) == {"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "olmo2", "phi3", "gemma"}


@pytest.mark.parametrize("model_type", PLANNED)
def test_tp2_gives_tp1_logits_and_tokens(model_type: str, tmp_path: Path) -> None:
    model = tiny_model(model_type, tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    one, two = run(model, 1, params), run(model, 2, params)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.prompt_logprobs + a.logprobs, b.prompt_logprobs + b.logprobs, strict=True):
            assert abs(x[0] - y[0]) <= 1e-5
            assert [t for t, _ in x[1]] == [t for t, _ in y[1]]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x[1], y[1])) <= 1e-5


def test_a_whole_continuous_batching_run_is_identical(tmp_path: Path) -> None:
    """Chunks of 16 tokens, a KV cache of 10 blocks for 5 streams of 4-5 (preemption), a shared prefix (hits), two
    seeded samples per prompt with logprobs, greedy beside them."""
    model = tiny_model("llama", tmp_path)
    prefix = list(range(30, 62))
    prompts = [prefix + [5, 6, 7], prefix + [9, 10], PROMPTS[0], prefix + [11]]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=7, n=2, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)]
    config = dict(max_batch_prefill_tokens=16, max_batch_total_tokens=160, block_size=16, kv_watermark=0.0)
    one, two = run(model, 1, params, prompts, **config), run(model, 2, params, prompts, **config)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert sum(o.num_preemptions for o in one) > 0, "nothing was preempted: nothing was tested"
    assert sum(o.num_cached_tokens for o in one) > 0, "no prefix hit: nothing was tested"
    assert [o.num_preemptions for o in one] == [o.num_preemptions for o in two]
    for a, b in zip(one, two, strict=True):
        if a.logprobs:
            assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5


def test_a_worker_takes_the_environment_of_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers fork from a server started with the process's first group. A later group's worker
    still sees the environment of its own start: here a model cache set after the server began,
    in which `embedded:tiny` is another model (with the server's cache, rank 1 would load the
    real one, and the group could not agree)."""
    run(tiny_model("llama", tmp_path), 2, SamplingParams(max_tokens=1))  # the server is up
    other = tiny_model("qwen2", tmp_path)
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    planted = planned_build("embedded:tiny").dir  # where the new cache keeps it: planted, not built
    planted.parent.mkdir(parents=True)
    Path(other).rename(planted)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    one, two = run("embedded:tiny", 1, params), run("embedded:tiny", 2, params)
    assert one[0].logprobs[0][1][0][0] < 256  # the planted model's vocabulary, not the real tiny's
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert max(abs(x[0] - y[0]) for x, y in zip(one[0].logprobs, two[0].logprobs, strict=True)) <= 1e-5


def test_a_model_the_plan_cannot_shard_is_refused_before_any_worker(tmp_path: Path) -> None:
    config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4, n_positions=64, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    started = time.monotonic()
    with pytest.raises(ValueError, match="'gpt2' ships no tensor-parallel plan"):
        Engine.from_pretrained(str(tmp_path / "gpt2"), EngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 is above the model's 2 KV heads"):
        Engine.from_pretrained(tiny_model("llama", tmp_path), EngineConfig(tensor_parallel_size=4))
    assert time.monotonic() - started < 60  # no worker was waited for


def test_a_killed_worker_fails_the_pass_and_breaks_the_group(tmp_path: Path) -> None:
    engine = Engine.from_pretrained(tiny_model("llama", tmp_path), EngineConfig(tensor_parallel_size=2, num_threads=1))
    try:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.peers.workers.kill(1)
        deadline = time.monotonic() + 60
        with pytest.raises((WorkerLost, RuntimeError)):
            while time.monotonic() < deadline:  # the pass fails (or the next one is refused)
                engine.step()
        with pytest.raises(WorkerLost, match="tensor-parallel group broken"):
            engine.peers.check()
    finally:
        engine.close()
    assert engine.peers.stopped


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the loop ends, logged once
def test_a_replica_whose_worker_dies_mid_stream_ends_it_with_an_error_and_turns_unhealthy(tmp_path: Path) -> None:
    """The Serve replica class over a TP=2 engine: a stream in flight ends with an error (the
    ingress sends it as an error event), health fails (Serve replaces the replica), and a new
    request is refused as by a dead engine (503: the ingress tries another replica)."""
    import asyncio

    from replicas.config import ReplicaConfig
    from replicas.protocol import ReplicaUnhealthyError, RequestOutput
    from replicas.serving.deployment import LLMServer

    model = tiny_model("llama", tmp_path)
    config = EngineConfig(tensor_parallel_size=2, num_threads=1)
    server = LLMServer(ReplicaConfig(model=model, engine=config),
                       engine_factory=lambda: Engine.from_pretrained(model, config))

    async def scenario() -> tuple[list, BaseException | None, list]:
        stream = server.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), 0, "a")
        items, error = [await anext(stream) for _ in range(3)], None
        server.engine.engine.peers.workers.kill(1)
        try:
            async with asyncio.timeout(30):
                items += [item async for item in stream]
        except Exception as exc:  # noqa: BLE001 - what the ingress turns into an error event
            error = exc
        for _ in range(300):  # the loop ends at its next pass or health probe
            try:
                server.check_health()
            except Exception:  # noqa: BLE001
                break
            await asyncio.sleep(0.1)
        after = [item async for item in server.generate([5, 6], SamplingParams(max_tokens=2), 0, "b")]
        return items, error, after

    try:
        items, error, after = asyncio.run(scenario())
        assert error is not None and not items[-1].finished  # no silent end: an error, never a hang
        with pytest.raises(Exception, match="tensor-parallel group broken|unhealthy"):
            server.check_health()
        # refused as by a dead engine, before any token (at intake, or once the loop meets the group)
        assert isinstance(after[-1], ReplicaUnhealthyError) and not any(isinstance(i, RequestOutput) for i in after)
    finally:
        server.shutdown()
    assert server.engine.engine.peers.stopped


def test_the_overlapped_loop_across_ranks_gives_the_synchronous_tokens(tmp_path: Path) -> None:
    """overlap on with TP=2: each decode's input is the token rank 0 sampled in the pass before,
    read from every rank's own slots (rank 0 broadcasts the pass's tokens); the same tokens as
    TP=1's synchronous loop through chunked prefill, preemption, prefix hits and seeded samples."""
    model = tiny_model("llama", tmp_path)
    prefix = list(range(30, 62))
    prompts = [prefix + [5, 6, 7], prefix + [9, 10], PROMPTS[0], prefix + [11]]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=7, n=2, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, logprobs=1, ignore_eos=True)]
    config = dict(max_batch_prefill_tokens=16, max_batch_total_tokens=160, block_size=16, kv_watermark=0.0)
    one = run(model, 1, params, prompts, overlap="off", **config)
    engine = Engine.from_pretrained(model, EngineConfig(tensor_parallel_size=2, num_threads=1, overlap="on",
                                                        **config))
    try:
        assert engine.overlap and engine.runner.token_slots is not None
        two = engine.generate(prompts, params)
        filled = engine.runner.token_slots.tokens
        assert int(filled.count_nonzero()) > 0  # rank 0's slots were written
    finally:
        engine.close()
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert sum(o.num_preemptions for o in two) > 0, "nothing was preempted: nothing was tested"
    assert sum(o.num_cached_tokens for o in two) > 0, "no prefix hit: nothing was tested"


def test_each_rank_runs_its_own_compiled_decode_step(tmp_path: Path) -> None:
    """cuda_graphs true with TP=2 (flex attention, the decode step compiled per bucket: on CPU run,
    not captured): every rank warms up as many rounds as the others (they meet in the model's
    collectives inside; this process ran TP=1 first, so rank 0 alone would stop a round early and
    leave the worker waiting), decode-only passes replay the bucket's step on both ranks, and the
    tokens are TP=1's."""
    model = tiny_model("llama", tmp_path)
    prompts = [list(range(30, 62)) + [5, 6, 7], PROMPTS[0], PROMPTS[1]]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    config = dict(attention_backend="flex", cuda_graphs=True, compile_backend="eager", max_num_seqs=4,
                  max_batch_prefill_tokens=16, max_batch_total_tokens=320, block_size=16)
    one = run(model, 1, params, prompts, **config)
    engine = Engine.from_pretrained(model, EngineConfig(tensor_parallel_size=2, num_threads=1, **config))
    try:
        assert engine.runner.path == "flex+graphs" and engine.runner.graphs.buckets == [1, 2, 4]
        graphs, replays = engine.runner.graphs, []
        graph_run = graphs.run
        graphs.run = lambda *a: replays.append(a[0]) or graph_run(*a)
        two = engine.generate(prompts, params)
        assert engine.runner.compiles[1] == 0  # nothing compiled after the warm-up
    finally:
        engine.close()
    assert len(replays) >= 15 and set(replays) <= {1, 2, 4}  # the decode-only passes ran the buckets' steps
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
