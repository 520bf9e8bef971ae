"""Every tensor a pass makes is on the pass's device. With torch's default device set to `meta`,
any tensor created without an explicit device lands on `meta`, and the first op that mixes it
with the model's (CPU) tensors raises, as the same line would on CUDA. Run over every sampling
feature, the engine must finish and give the same seeded and greedy tokens as without it."""

from __future__ import annotations

import json

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.protocol import GuidedDecoding

pytestmark = pytest.mark.engine

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.8),  # unseeded: only finishing is compared
    SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=1),
    SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=2),
    SamplingParams(max_tokens=6, temperature=0.9, top_k=20, top_p=0.8, seed=4),
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=6, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
                   repetition_penalty=1.2, seed=5),
    SamplingParams(max_tokens=6, temperature=0.0, logit_bias={5: 3.0}, min_tokens=4),
    SamplingParams(max_tokens=12, temperature=0.0, guided=GuidedDecoding("json_schema", SCHEMA)),
    SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_prefill_tokens=64,
                                                                max_batch_total_tokens=1024))


def run(engine: Engine) -> list:
    return engine.generate(["Hello world", "A longer prompt about serving systems and their batches"]
                           * (len(PARAMS) // 2) + ["Hello world"], PARAMS)


def test_no_pass_makes_a_tensor_off_the_model_device(engine: Engine) -> None:
    expected = run(engine)
    with torch.device("meta"):
        got = run(engine)
    assert len(got) == len(expected) == len(PARAMS) + 1  # n=2 gives two outputs
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.finish_reason in ("length", "stop")
        if i == 0:
            continue  # unseeded sampling
        assert g.token_ids == e.token_ids, f"output {i} differs under the meta default device"
        assert g.logprobs == e.logprobs and g.prompt_logprobs == e.prompt_logprobs
    assert got[7].text.startswith('{"a":')  # the schema row (a random model may run out of tokens)
