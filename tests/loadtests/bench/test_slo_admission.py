"""The SLO-admission benchmark runs its three systems on one workload and reports each."""

from __future__ import annotations

import pytest

from loadtests.bench.slo_admission import SYSTEMS, main

pytestmark = pytest.mark.engine


def test_a_tiny_run_reports_every_system() -> None:
    result = main(["--model", "embedded:tiny", "--quick", "--chat-requests", "4", "--threads", "1"])
    assert [r["system"] for r in result["rows"]] == [name for name, _, _ in SYSTEMS]
    for row in result["rows"]:
        assert row["output_tokens"] > 0 and 0 <= row["gaps_within_slo"] <= 1
        assert 1 <= row["decodes_per_pass_max"] <= 4
    assert result["rows"][0]["admission_held"] == 0  # no SLO: nothing held
