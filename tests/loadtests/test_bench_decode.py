"""The decode-pass check and the per-pass profile run real passes and account for their time."""

from __future__ import annotations

import pytest

from loadtests.bench_decode import FORWARD_PARTS, PHASES, fill, make_engine, mixed_case, profile_case


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
