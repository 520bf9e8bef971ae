"""The SLO-budget benchmark runs fixed and SLO budgets on one workload and checks the issue's target."""

from __future__ import annotations

import pytest

from loadtests.bench.slo_budget import check, main


def row(mbp, slo, tbt_p99_ms, long_ttft):
    return {"mbp": mbp, "tbt_slo_ms": slo, "tbt_p99_s": tbt_p99_ms / 1e3, "long_ttft_s": long_ttft}


@pytest.mark.unit
def test_the_target_compares_with_the_best_fixed_budget_that_meets_the_slo() -> None:
    rows = [row(128, None, 80, 0.8), row(512, None, 140, 0.6), row(2048, None, 500, 0.4),
            row(2048, 150.0, 130, 0.65), row(2048, 100.0, 120, 0.7)]
    by = {c["slo_ms"]: c for c in check(rows, [150.0, 100.0])}
    assert by[150.0]["best_fixed_mbp"] == 512 and by[150.0]["met"]  # 0.65 / 0.6 = 1.08
    assert by[150.0]["long_ttft_vs_best_fixed"] == 0.65 / 0.6
    assert by[100.0]["best_fixed_mbp"] == 128 and not by[100.0]["tbt_within_slo"] and not by[100.0]["met"]


@pytest.mark.engine
def test_a_tiny_run_reports_every_system() -> None:
    result = main(["--model", "embedded:tiny", "--quick", "--long-shorts", "3", "--slos", "50",
                   "--threads", "1"])
    systems = [(r["mbp"], r["tbt_slo_ms"]) for r in result["rows"]]
    assert systems == [(128, None), (256, None), (512, None), (1024, None), (2048, None), (2048, 50.0)]
    slo_row = result["rows"][-1]
    assert slo_row["coefficients"]["prefill_tokens"] > 0 and slo_row["iterations"] > 0
    assert len(result["checks"]) == 1
