"""The decode-pass check and the per-pass profile run real passes and account for their time."""

from __future__ import annotations

import pytest
import torch

from loadtests.bench.decode import (FORWARD_PARTS, PHASES, equal_case, fill, hf_decode_step, make_engine,
                                    mixed_case, profile_case)

pytestmark = pytest.mark.engine


@pytest.mark.filterwarnings("error::FutureWarning")  # the cache argument by the name transformers uses now
def test_hf_decode_steps_attend_over_the_same_context_every_time() -> None:
    engine = make_engine("embedded:tiny", [40] * 3, threads=1)
    step = hf_decode_step(engine, batch=3, context=40)
    first, second = step(), step()
    assert first.logits.shape[:2] == (3, 1)
    assert int(first.past_key_values.get_seq_length()) == 40  # cropped back after the step
    torch.testing.assert_close(first.logits, second.logits)  # same input, same context
    # The step attends over the context: it scores the token as the whole sequence would.
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, engine.vocab_size, (3, 40), generator=g)
    last = torch.randint(10, engine.vocab_size, (3, 1), generator=g)
    with torch.inference_mode():
        whole = engine.model(input_ids=torch.cat([ids, last], 1), use_cache=False).logits[:, -1:]
    torch.testing.assert_close(first.logits, whole, atol=1e-4, rtol=1e-4)


def test_the_equal_case_reports_the_pass_against_both_references() -> None:
    row = equal_case("embedded:tiny", batch=4, steps=3, threads=1, compiled=False)
    assert row["bare_ms"] > 0 and row["hf_decode_ms"] > 0
    assert row["pass_over_hf_decode"] == pytest.approx(row["pass_ms"] / row["hf_decode_ms"])


def test_mixed_contexts_are_compared_with_equal_ones_of_the_same_total() -> None:
    row = mixed_case("embedded:tiny", batch=6, num_long=1, long_ctx=300, short_ctx=20, steps=3,
                     threads=1, compiled=False)
    assert row["total_context"] == 300 + 5 * 20 and row["equal_context"] == 400 // 6
    assert row["mixed_forward_ms"] > 0 and row["equal_forward_ms"] > 0
    assert row["pass_ratio"] == pytest.approx(row["mixed_pass_ms"] / row["equal_pass_ms"])


def test_the_profile_splits_a_pass_into_its_phases() -> None:
    contexts = [200] + [16] * 5
    engine = make_engine("embedded:tiny", contexts, threads=1)
    fill(engine, contexts)
    row = profile_case(engine, steps=3)
    assert all(row[p] >= 0 for p in (*PHASES[:2], *FORWARD_PARTS[:3], "kv gather", "sdpa"))
    assert row["linear (GEMMs)"] > 0 and row["attention"] > 0 and row["sdpa"] > 0
    # The forward's parts never exceed it, and the phases account for the pass.
    assert sum(row[p] for p in FORWARD_PARTS[:3]) <= row["forward"] * 1.01
    assert row["forward"] < row["pass_ms"]
    assert len(engine.scheduler.running) == len(contexts)  # the profile left the engine decoding
