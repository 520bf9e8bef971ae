"""The routing-cost benchmark times the functions Serve runs on a realistic view (the prefix
holder is hinted and wins), and the fleet-scale comparison's verdict is the 5% rule on both
figures, whole trace and warm window."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from loadtests.bench import routing_cost as brc
from loadtests.sim import routing_scale as rs

pytestmark = pytest.mark.unit


def test_each_timed_decision_ranks_the_view():
    view = brc.fleet(200, seed=1)
    assert len(view["keys"]) == 200 and view["holder"] in view["keys"]
    for name in brc.FUNCTIONS:
        full = brc.decision(name, view, None, random.Random(0))()
        sampled = brc.decision(name, view, 16, random.Random(0))()
        assert len(full) == 200 and 16 <= len(sampled) <= 17, name
    assert brc.decision("choose_by_prefix", view, 16, random.Random(0))()[0] == view["holder"]


def test_the_ledger_sweep_and_the_live_view_agree():
    sweep, change = brc.ledger(10, 4, seed=0)
    tokens, kv = sweep()
    assert sum(tokens.values()) <= 40 * brc.REQUEST.tokens
    change()
    assert sweep() == (tokens, kv)  # one request in and out again: as before


def test_table_marks_the_target_at_1000_only():
    rows = [{"function": "choose_replica", "replicas": 64, "full_us": 50.0, "sampled_us": 20.0, "speedup": 2.5},
            {"function": "choose_replica", "replicas": 1000, "full_us": 900.0, "sampled_us": 20.0, "speedup": 45.0},
            {"function": "choose_by_prefix", "replicas": 1000, "full_us": 2000.0, "sampled_us": 80.0,
             "speedup": 25.0}]
    lines = brc.format_table(rows, 16, 50.0).splitlines()
    assert "sample of 16" in lines[0]
    assert lines[1].rstrip().endswith("2.5x")
    assert lines[2].endswith(" met") and lines[3].endswith("NOT met")


def row(n: int, rule: str, p99: float, good: float) -> dict:
    return {"replicas": n, "ranking": "token_load", "rule": rule, "ttft_p99_s": p99, "goodput_rps": good,
            "window_ttft_p99_s": p99, "window_goodput_rps": good}


def test_checks_apply_the_5_percent_rule():
    rows = [row(64, "full", 2.0, 100.0), row(64, "sampled", 2.09, 96.0),
            row(1000, "full", 1.0, 1000.0), row(1000, "sampled", 1.06, 1000.0)]
    by_n = {c["replicas"]: c for c in rs.checks(rows)}
    assert by_n[64]["met"] and by_n[64]["ttft_p99_s_ratio"] == pytest.approx(1.045)
    assert not by_n[1000]["met"] and by_n[1000]["goodput_rps_ratio"] == 1.0


def test_window_counts_only_late_arrivals_that_meet_both_slos():
    nan = math.nan
    rec = SimpleNamespace(arrival=[0.0, 5.0, 6.0, 7.0, 11.0], ttft=[9.0, 0.5, 3.0, 0.2, 0.1],
                          mean_gap=[0.01, 0.05, 0.05, 0.2, nan], ttft_slo_s=2.0, tbt_slo_s=0.1)
    w = rs.window(SimpleNamespace(rec=rec), warm_s=5.0)
    assert w["window_requests"] == 4
    assert w["window_goodput_rps"] == pytest.approx(2 / 6.0)  # 5.0 (ok), 11.0 (one token: ok)
    assert w["window_ttft_p99_s"] == 3.0


def test_trace_sizes_per_fleet():
    assert rs.per_size(None, [64, 1000, 2000], "--x", 250, 60) == [250, 60, 60]
    assert rs.per_size([5], [64, 1000], "--x", 250, 60) == [5, 5]
    assert rs.per_size([5, 6], [64, 1000], "--x", 250, 60) == [5, 6]
    with pytest.raises(ValueError, match="--x"):
        rs.per_size([1, 2, 3], [64, 1000], "--x", 250, 60)
