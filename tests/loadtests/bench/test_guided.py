"""The structured-output benchmark runs the same workload at each share, every constrained
request doing its plain twin's tokens (the script checks), and reports ratios to plain."""

from __future__ import annotations

import pytest

from loadtests.bench.guided import SHARES, main

pytestmark = pytest.mark.engine


def test_a_quick_run_reports_every_share(tmp_path) -> None:
    result = main(["--quick", "--threads", "1", "--json", str(tmp_path / "guided.json")])
    rows = result["rows"]
    assert [r["share"] for r in rows] == list(SHARES)
    assert [r["constrained"] for r in rows] == [0, 16, 32]  # of the quick chat workload's 32
    assert rows[0]["vs_plain"] == 1.0 and all(r["output_tok_s"] > 0 for r in rows)
    assert rows[0]["mask_share"] < rows[2]["mask_share"] < 1.0
    assert (tmp_path / "guided.json").exists()
