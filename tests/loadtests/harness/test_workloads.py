"""Workloads are pure functions of their seed: same seed, same requests; lengths stay in bounds
and keep the heavy tail and arrival rate they are built to have. Real chat prompts replace a
workload's prompts and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.real_text import LONG_FRACTION
from loadtests.harness.stats import percentile
from loadtests.harness.workloads import (CHAT_OUTPUT, CHAT_PROMPT, ChatPromptPool, LengthDist, Workload,
                                 chat_workload, default_prompt_source, long_context_workload,
                                 long_prompt_workload, random_prompt,
                                 with_chat_prompts, with_poisson_arrivals)
from replicas.loading.model_files import load_tokenizer

VOCAB = 32000
REAL_MODEL = "embedded:smollm2"


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(REAL_MODEL)  # the tokenizer only: no weights, no torch


@pytest.mark.unit
def test_chat_workload_is_deterministic_under_its_seed() -> None:
    a, b = chat_workload(64, VOCAB, seed=7), chat_workload(64, VOCAB, seed=7)
    assert a.requests == b.requests
    c = chat_workload(64, VOCAB, seed=8)
    assert a.prompt_lens != c.prompt_lens
    assert a.requests[0].prompt_token_ids != c.requests[0].prompt_token_ids


@pytest.mark.unit
def test_long_prompt_workload_is_deterministic_under_its_seed() -> None:
    assert long_prompt_workload(VOCAB, seed=3).requests == long_prompt_workload(VOCAB, seed=3).requests


@pytest.mark.unit
def test_long_context_workload_is_deterministic_under_its_seed() -> None:
    a, b = long_context_workload(VOCAB, seed=3), long_context_workload(VOCAB, seed=3)
    assert a.requests == b.requests
    assert a.prompt_lens != long_context_workload(VOCAB, seed=4).prompt_lens


@pytest.mark.unit
def test_chat_lengths_stay_in_bounds_and_ids_in_vocab() -> None:
    w = chat_workload(500, VOCAB, seed=0, avoid_ids=[0, 1, 2])
    assert all(CHAT_PROMPT.lo <= n <= CHAT_PROMPT.hi for n in w.prompt_lens)
    assert all(CHAT_OUTPUT.lo <= n <= CHAT_OUTPUT.hi for n in w.output_lens)
    ids = np.concatenate([r.prompt_token_ids for r in w.requests])
    assert ids.min() >= 3 and ids.max() < VOCAB
    assert all(r.arrival_s == 0.0 for r in w.requests)
    assert len({r.request_id for r in w.requests}) == 500


@pytest.mark.unit
def test_chat_lengths_are_heavy_tailed() -> None:
    """ShareGPT-like: p99 several times the median, mean above the median (right skew)."""
    w = chat_workload(4000, VOCAB, seed=0)
    for lens in (w.prompt_lens, w.output_lens):
        p50, p99 = percentile(lens, 50), percentile(lens, 99)
        assert 4.0 < p99 / p50 < 10.0  # lognormal sigma 0.9: exp(2.326 * 0.9) = 8.1 before clipping
        assert np.mean(lens) > 1.2 * p50
    assert abs(percentile(w.prompt_lens, 50) - CHAT_PROMPT.median) / CHAT_PROMPT.median < 0.1
    assert abs(percentile(w.output_lens, 50) - CHAT_OUTPUT.median) / CHAT_OUTPUT.median < 0.1


@pytest.mark.unit
def test_pareto_median_and_tail() -> None:
    d = LengthDist("pareto", median=100, lo=1, hi=100_000, alpha=1.5)
    x = list(d.sample(np.random.default_rng(0), 20_000))
    p50 = percentile(x, 50)
    assert abs(p50 - 100) < 5
    # Pareto: P(X > x) = (scale / x) ** alpha, so p99 / p50 = (100 / 2) ** (1 / alpha) = 13.6.
    assert 11 < percentile(x, 99) / p50 < 16


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["lognormal", "pareto", "uniform", "fixed"])
def test_every_length_dist_is_clipped(kind: str) -> None:
    d = LengthDist(kind, median=50, lo=10, hi=60, sigma=2.0, alpha=0.5)
    x = d.sample(np.random.default_rng(1), 2000)
    assert min(x) >= 10 and max(x) <= 60 and all(isinstance(v, int) for v in x)


@pytest.mark.unit
def test_length_dist_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="lo"):
        LengthDist("lognormal", median=10, lo=20, hi=10)
    with pytest.raises(ValueError, match="kind"):
        LengthDist("zipf", median=10, lo=1, hi=10)  # type: ignore[arg-type]


@pytest.mark.unit
def test_random_prompt_avoids_ids_and_covers_the_rest() -> None:
    ids = random_prompt(np.random.default_rng(0), 20_000, vocab_size=10, avoid_ids=[0, 4, 9])
    assert set(ids) == {1, 2, 3, 5, 6, 7, 8}
    counts = np.bincount(ids, minlength=10)[[1, 2, 3, 5, 6, 7, 8]]
    assert counts.min() > 0.8 * 20_000 / 7  # still uniform over the allowed ids


@pytest.mark.unit
def test_with_poisson_arrivals_keeps_requests_and_retimes_them() -> None:
    w = chat_workload(200, VOCAB, seed=0)
    p = with_poisson_arrivals(w, rate=10.0)
    assert [r.prompt_token_ids for r in p.requests] == [r.prompt_token_ids for r in w.requests]
    assert p.requests == with_poisson_arrivals(w, rate=10.0).requests
    assert 10.0 < p.duration_s < 30.0  # 200 requests at 10/s: about 20 s
    assert p.settings["poisson_rate"] == 10.0
    assert p.name == "chat" and with_poisson_arrivals(w, 10.0, name="chat_poisson").name == "chat_poisson"


@pytest.mark.unit
def test_chat_with_rate_arrives_over_time() -> None:
    w = chat_workload(100, VOCAB, seed=0, rate=5.0)
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert w.requests[-1].arrival_s > 10.0


@pytest.mark.unit
def test_long_prompt_workload_shape() -> None:
    """Short requests at t=0; long prompts later, one interval apart, while shorts decode."""
    w = long_prompt_workload(VOCAB, seed=0, num_short=16, num_long=4, first_long_s=0.5,
                             long_interval_s=1.0)
    shorts = [r for r in w.requests if r.kind == "short"]
    longs = [r for r in w.requests if r.kind == "long"]
    assert len(shorts) == 16 and len(longs) == 4
    assert all(r.arrival_s == 0.0 and 32 <= r.prompt_len <= 128 and 96 <= r.max_tokens <= 192
               for r in shorts)
    assert [r.arrival_s for r in longs] == [0.5, 1.5, 2.5, 3.5]
    assert all(1500 <= r.prompt_len <= 2000 and r.max_tokens == 16 for r in longs)
    assert w.max_total_len == max(r.prompt_len for r in longs) + 16


@pytest.mark.unit
def test_long_context_workload_shape() -> None:
    """All at t=0, the long-context requests first: after the prefills every decode pass
    carries the few long contexts beside the many short ones."""
    w = long_context_workload(VOCAB, seed=0, num_long=2, num_short=32)
    assert [r.kind for r in w.requests] == ["long"] * 2 + ["short"] * 32
    assert all(r.arrival_s == 0.0 for r in w.requests)
    assert all(1500 <= r.prompt_len <= 1900 and r.max_tokens == 128 for r in w.requests[:2])
    assert all(64 <= r.prompt_len <= 128 and 64 <= r.max_tokens <= 128 for r in w.requests[2:])
    assert w.max_total_len <= 2048  # fits a 2048-position model
    assert len({r.request_id for r in w.requests}) == 34


@pytest.mark.unit
def test_workload_round_trips_through_a_dict() -> None:
    w = long_prompt_workload(VOCAB, seed=0, num_short=2, num_long=1)
    assert Workload.from_dict(w.to_dict()) == w
    s = w.summary()
    assert s["num_requests"] == 3 and s["output_tokens"] == sum(w.output_lens)


@pytest.mark.unit
def test_shared_prefix_and_multi_turn_workloads_repeat_exactly_what_they_say():
    from loadtests.harness.workloads import multi_turn_conversations, shared_prefix_workload

    w = shared_prefix_workload(1000, 3, num_requests=5, system_tokens=64)
    system = w.requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == system and 20 <= r.prompt_len - 64 <= 80 for r in w.requests)
    assert shared_prefix_workload(1000, 3, num_requests=5, system_tokens=64) == w  # seeded
    convs = multi_turn_conversations(1000, 1, num_conversations=2, num_turns=3, system_tokens=16)
    assert convs[0].system != convs[1].system
    c = convs[0]
    answers = [[1, 2], [3]]
    p2 = c.prompt(2, answers)
    assert p2 == c.system + c.turns[0][0] + [1, 2] + c.turns[1][0] + [3] + c.turns[2][0]
    assert c.prompt(1, answers[:1]) == p2[:len(c.prompt(1, answers[:1]))]  # each turn extends the last


@pytest.mark.unit
def test_real_prompts_are_the_default_only_for_real_models() -> None:
    assert default_prompt_source("embedded:tiny") == default_prompt_source("embedded:mid") == "random"
    assert default_prompt_source(REAL_MODEL) == default_prompt_source("/models/x.gguf") == "real"
    assert default_prompt_source("tiny") == "real"  # a path or hub id, not the test model


@pytest.mark.real_model
def test_chat_prompt_pool_is_chat_templated_short_and_long(smol_tokenizer) -> None:
    pool = ChatPromptPool.from_tokenizer(smol_tokenizer, seed=0)
    assert pool == ChatPromptPool.from_tokenizer(smol_tokenizer, seed=0)
    assert pool != ChatPromptPool.from_tokenizer(smol_tokenizer, seed=1)
    for prompt in pool.short + pool.long:
        text = smol_tokenizer.decode(prompt)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert all(len(p) < 64 for p in pool.short) and all(len(p) > 256 for p in pool.long)
    assert "text above" in smol_tokenizer.decode(pool.long[0])  # a passage and a task about it
    lens = pool.summary()
    assert lens["short"][1] < 64 < 256 < lens["long"][0] and pool.max_prompt_len == lens["long"][1]


@pytest.mark.real_model
def test_chat_prompt_pool_needs_a_chat_template(smol_tokenizer) -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        ChatPromptPool.from_tokenizer(NoTemplate())


@pytest.mark.real_model
def test_with_chat_prompts_replaces_prompts_only(smol_tokenizer) -> None:
    """Ids, arrivals and output lengths stay; a LONG_FRACTION share are passage tasks; the same
    workload and pool give the same prompts."""
    pool = ChatPromptPool.from_tokenizer(smol_tokenizer, seed=0)
    base = with_poisson_arrivals(chat_workload(400, VOCAB, seed=3), rate=5.0)
    real = with_chat_prompts(base, pool)
    assert real.requests == with_chat_prompts(base, pool).requests
    assert real.requests != with_chat_prompts(with_poisson_arrivals(chat_workload(400, VOCAB, seed=4),
                                                                    rate=5.0), pool).requests
    keep = lambda w: [(r.request_id, r.arrival_s, r.max_tokens) for r in w.requests]  # noqa: E731
    assert keep(real) == keep(base) and real.name == base.name and real.seed == base.seed
    shorts = [r for r in real.requests if r.kind == "short"]
    longs = [r for r in real.requests if r.kind == "long"]
    assert len(shorts) + len(longs) == 400
    assert abs(len(longs) / 400 - LONG_FRACTION) < 0.07
    assert {tuple(r.prompt_token_ids) for r in shorts} <= set(pool.short)
    assert {tuple(r.prompt_token_ids) for r in longs} <= set(pool.long)
    assert real.settings["prompt"] == {"source": "real", "long_fraction": LONG_FRACTION,
                                       "lengths": pool.summary()}
    assert real.settings["poisson_rate"] == 5.0  # the rest of the settings stay
