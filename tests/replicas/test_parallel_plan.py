"""Tensor parallelism's pure parts: the one message a pass (encoded, decoded, 8-byte aligned), the
heads a rank's attention sees under each plan style, the refusals naming the number that fails,
and the settings refused with tensor_parallel_size > 1."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoConfig

from replicas import EngineConfig
from replicas.execution.model_runner import graphs_by_default
from replicas.execution.parallel import PASS, RESIZE, decode, encode
from replicas.loading.model_support import check_tensor_parallel, heads_per_rank

pytestmark = pytest.mark.unit


def config(model_type: str, **over):
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=256)
    if model_type == "gpt_neox":
        shape.pop("num_key_value_heads")
    return AutoConfig.for_model(model_type, **{**shape, **over})


def test_a_message_round_trips_with_its_body_aligned() -> None:
    body = np.arange(11, dtype=np.int64).view(np.uint8)
    for header in ({"parts": [1, 2, 3]}, "x" * 13, None):
        msg = encode(PASS, header, body)
        kind, got, data = decode(np.concatenate([msg, np.zeros(40, np.uint8)]))  # a buffer's slack ignored
        assert kind == PASS and got == header
        assert data.nbytes == body.nbytes and (data.view(np.int64) == np.arange(11)).all()
        assert (msg.nbytes - data.nbytes) % 8 == 0  # the body starts 8-byte aligned
    kind, size, data = decode(encode(RESIZE, 1 << 20))
    assert (kind, size, data.nbytes) == (RESIZE, 1 << 20, 0)


@pytest.mark.parametrize(("model_type", "tp", "expected"), [
    ("llama", 1, (4, 2)), ("llama", 2, (2, 1)), ("qwen3", 2, (2, 1)), ("gemma", 2, (2, 1)),
    ("gpt_neox", 2, (2, 2)),  # a fused q/k/v split by heads: 4 heads, 4 KV heads, 2 each
    ("olmo2", 2, (4, 2)), ("phi3", 2, (4, 2)),  # their plans gather q/k/v: every rank has all heads
])
def test_the_heads_a_rank_holds_follow_the_plan(model_type: str, tp: int, expected: tuple[int, int]) -> None:
    assert heads_per_rank(config(model_type), tp) == expected


@pytest.mark.parametrize(("model_type", "tp", "over", "message"), [
    ("gpt2", 2, {}, "'gpt2' ships no tensor-parallel plan"),
    ("opt", 2, {}, "'opt' ships no tensor-parallel plan"),
    ("llama", 4, {}, "tensor_parallel_size=4 is above the model's 2 KV heads"),
    ("llama", 2, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, "does not divide the model's 3 KV heads"),
    ("llama", 2, {"vocab_size": 255}, "does not divide the model's 255 vocabulary"),
    ("llama", 2, {"intermediate_size": 129}, "does not divide the model's 129 MLP width"),
    ("llama", 0, {}, "tensor_parallel_size must be >= 1"),
])
def test_what_cannot_be_sharded_is_refused_naming_the_number(model_type, tp, over, message) -> None:
    cfg = AutoConfig.for_model(model_type, vocab_size=256) if model_type in ("gpt2", "opt") else config(model_type, **over)
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(cfg, tp)


def test_what_shards_passes() -> None:
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gpt_neox", "olmo2", "phi3"):
        check_tensor_parallel(config(model_type), 2)
    check_tensor_parallel(AutoConfig.for_model("gpt2"), 1)  # tp 1 needs no plan


def test_tensor_parallel_settings() -> None:
    assert EngineConfig().tensor_parallel_size == 1
    for overlap in ("auto", "on", "off"):  # the overlapped loop shares its tokens (test_tensor_parallel)
        assert EngineConfig(tensor_parallel_size=2, overlap=overlap).overlap == overlap
    assert EngineConfig(tensor_parallel_size=2, cuda_graphs=True).cuda_graphs  # opted in (test_tensor_parallel)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_a_tensor_parallel_replica_captures_no_decode_step_by_default() -> None:
    assert graphs_by_default("cuda", "flex", 1)
    assert not graphs_by_default("cuda", "flex", 2)
    assert not graphs_by_default("cpu", "flex", 1) and not graphs_by_default("cuda", "sdpa", 1)
