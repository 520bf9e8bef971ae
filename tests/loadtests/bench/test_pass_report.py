"""The pass trace's report: ratios by predicted length, CPU share, passes over the SLO."""

from __future__ import annotations

import json

import pytest

from loadtests.bench import pass_report

pytestmark = pytest.mark.unit


def _row(t, duration, predicted, prefill, decode, cpu=None, target=None):
    return {"time": t, "duration_s": duration, "cpu_s": duration if cpu is None else cpu,
            "predicted_s": predicted, "pass_target_s": target, "prefill_budget": None,
            "prefill_tokens": prefill, "decode_tokens": decode, "sequences": decode + 1,
            "context_tokens": 100, "preempted": 0, "stalled": 0, "fallback": False}


def test_the_report_finds_the_overrun_that_became_a_gap_and_the_pass_that_waited_for_a_core(tmp_path):
    rows = [_row(100.0 + i, 0.1, 0.1, 16, 4) for i in range(10)]  # short passes, on prediction
    rows += [_row(120.0, 1.2, 0.8, 900, 8, target=0.8),  # ran 1.5x its prediction, with decodes
             _row(121.5, 1.4, 1.4, 2000, 0),  # over the SLO but nothing decoding: no gap
             _row(123.0, 0.75, 0.75, 800, 8, cpu=0.3, target=0.8)]  # waited for a core
    path = tmp_path / "passes-1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))  # order restored by time
    rep = pass_report.main([str(path), "--slo-ms", "1000", "--json", str(tmp_path / "r.json")])
    assert rep["passes"] == 13 and rep["span_s"] == pytest.approx(23.75)
    assert [o["at_s"] for o in rep["over_slo_with_decodes"]] == [20.0]
    buckets = {tuple(b["predicted_share_of_slo"]): b for b in rep["ratio_by_predicted"]}
    assert buckets[(0.05, 0.2)]["passes"] == 10 and buckets[(0.05, 0.2)]["ratio_max"] == pytest.approx(1.0)
    near = buckets[(0.7, 0.8)]
    assert near["passes"] == 1 and near["ratio_max"] == pytest.approx(1.0)
    assert buckets[(0.8, 1.0)]["ratio_max"] == pytest.approx(1.5)
    busy = 10 * 0.1 + 1.2 + 1.4 + 0.75
    assert rep["busy_s"] == pytest.approx(busy)
    assert rep["cpu_per_wall"] == pytest.approx((busy - 0.45) / busy)
    assert json.loads((tmp_path / "r.json").read_text())["passes"] == 13


def test_the_cadence_replays_chunks_at_the_landings_merging_picks(tmp_path):
    """Full passes of 10 ms landing every 10 ms: a stream's chunks at 50 ms merging go out every
    fifth landing, 50 ms apart; the quieter passes before the full span are left out."""
    rows = [dict(_row(t, 0.004, 0.004, 0, 1), sequences=2) for t in (0.0, 0.5)]
    rows += [dict(_row(1.0 + 0.01 * i, 0.01, 0.008, 0, 127), sequences=128) for i in range(101)]
    path = tmp_path / "passes-1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = pass_report.main([str(path), "--min-seqs", "100", "--stream-interval-ms", "50"])
    c = rep["cadence"]
    assert c["passes"] == 101 and c["span_s"] == pytest.approx(1.0)
    assert c["landing_interval_s"]["p99"] == pytest.approx(0.01)
    assert c["actual_over_predicted"]["p50"] == pytest.approx(1.25)
    assert c["chunk_gap_s"]["p50"] == pytest.approx(0.05) and c["chunk_gap_s"]["p99"] == pytest.approx(0.05)
    assert pass_report.cadence(rows, 1000, 0.05) is None  # no span of full passes
