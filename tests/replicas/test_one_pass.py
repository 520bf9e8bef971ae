"""One pass through the replica: `Engine.step` launches the pass in the model runner (which plans
the sampling into the pass's upload, runs the forward and samples once) and collects its token ids;
the engine never enters the sampler itself. A request is checked once, by the engine, and a
refusal reaches the async caller before any stream starts (a duplicate id never touches the
request that holds it)."""

from __future__ import annotations

from collections import Counter

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.serving.async_engine import AsyncEngine
from replicas.loading.models import load_model
from replicas.protocol import InvalidRequestError
from replicas.scheduling.batch import SchedulerOutput


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def engine_for(llama, **config) -> Engine:
    return Engine(*llama, EngineConfig(max_batch_prefill_tokens=32, max_batch_total_tokens=1024, **config))


def counting(calls: Counter, name: str, fn):  # noqa: ANN001, ANN202
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapper


MIXED = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=2),
         SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True, prompt_logprobs=1)]


@pytest.mark.engine
def test_each_step_calls_the_runner_once_and_the_runner_samples_once(llama) -> None:
    eng = engine_for(llama)
    runner, sampler = eng.runner, eng.runner.sampler
    calls: Counter = Counter()
    for name in ("launch", "collect", "prepare", "forward"):
        setattr(runner, name, counting(calls, name, getattr(runner, name)))
    for name in ("plan", "sample_on_device", "read_back"):
        setattr(sampler, name, counting(calls, name, getattr(sampler, name)))
    for i, params in enumerate(MIXED):  # prompts of 40 tokens: chunked over passes, then decodes
        eng.add_request(list(range(5 + i, 45 + i)), params)
    passes = 0
    while eng.has_unfinished():
        before = dict(calls)
        eng.step()
        passes += 1
        assert {k: calls[k] - before.get(k, 0) for k in calls} == {
            "launch": 1, "collect": 1, "prepare": 1, "forward": 1, "plan": 1, "sample_on_device": 1, "read_back": 1}
    assert passes == len(eng.iterations) and passes > 6


class FakeRunner:
    """A runner that returns token 7 for every sequence that samples, counting its calls: the
    engine needs nothing else from it (no sampler, no logits)."""

    def __init__(self) -> None:
        self.calls = 0

    def launch(self, batch: SchedulerOutput) -> list[int]:
        self.calls += 1
        return [7 for s in batch.seqs if s.samples]

    def collect(self, launched: list[int]) -> list[int]:
        return launched


@pytest.mark.engine
def test_the_engine_takes_its_tokens_from_the_runner_alone(llama) -> None:
    eng = engine_for(llama)
    eng.runner = fake = FakeRunner()
    [out] = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.7, ignore_eos=True))
    assert out.token_ids == [7, 7, 7] and fake.calls == 3 == len(eng.iterations)


@pytest.mark.engine
async def test_the_engine_refuses_a_duplicate_id_before_its_stream_starts(llama) -> None:
    ae = AsyncEngine(engine_for(llama))
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        first = await ae.add_request([[5, 6, 7, 8]], params, "dup")  # queued: the id is taken
        with pytest.raises(InvalidRequestError, match="already in use") as dup:
            await ae.add_request([[9, 10]], params, "dup")
        assert dup.value.param == "request_id"
        with pytest.raises(InvalidRequestError, match="SamplingParams") as bad:
            await ae.add_request([[9, 10]], {"max_tokens": 3}, "bad")  # type: ignore[arg-type]
        assert bad.value.param == "params"
        outs = [o async for o in first]  # the original streams on, untouched
        assert sum(len(o.delta_token_ids) for o in outs) == 30 and outs[-1].finish_reason == "length"
        assert not ae.engine.requests
    finally:
        ae.shutdown()
