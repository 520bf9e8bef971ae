"""The sampler benchmark times every parameter set on fresh logits."""

from __future__ import annotations

import pytest

from loadtests.bench.sampler import CASES, time_case

pytestmark = pytest.mark.unit


def test_every_case_runs() -> None:
    assert [name for name, _ in CASES] == ["top_p 0.9", "top_k 50 + top_p 0.9", "temperature"]
    for _, params in CASES:
        assert time_case(params, vocab=300, rows=4, reps=2) > 0
