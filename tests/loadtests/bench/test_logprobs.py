"""The logprobs-cost benchmark runs the same workload at each share and reports ratios."""

from __future__ import annotations

import pytest

from loadtests.bench.logprobs import SHARES, main

pytestmark = pytest.mark.engine


def test_a_tiny_run_reports_every_share() -> None:
    result = main(["--model", "embedded:tiny", "--threads", "1", "--repeats", "1"])
    assert [r["share"] for r in result["rows"]] == list(SHARES)
    assert result["rows"][0]["vs_none"] == 1.0 and all(r["output_tok_s"] > 0 for r in result["rows"])
