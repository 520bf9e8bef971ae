"""The prefix-cache benchmark runs both workloads with the cache on and off, same tokens either way."""

from __future__ import annotations

import pytest

from loadtests.bench.prefix import main

pytestmark = pytest.mark.engine


def test_a_tiny_run_reports_on_and_off_for_both_workloads() -> None:
    result = main(["--model", "embedded:tiny", "--threads", "1", "--repeats", "1", "--quick"])
    rows = {(r["workload"], r["cache"]): r for r in result["rows"]}
    assert set(rows) == {(w, c) for w in ("shared_system_prompt", "multi_turn") for c in (False, True)}
    for w in ("shared_system_prompt", "multi_turn"):
        on, off = rows[w, True], rows[w, False]
        assert off["hit_rate"] == 0.0 and on["hit_rate"] > 0.5
        assert on["prompt_tokens_run"] < off["prompt_tokens_run"]
        # The same tokens came out, so the runs differ only by what was recomputed.
        assert on["repeats"][0]["output_tokens"] == off["repeats"][0]["output_tokens"]
