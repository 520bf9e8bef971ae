"""The engine benchmark runs end to end on the tiny model: every system produces a row with
positive throughput, the JSON holds the rows and config, and the metrics are computed right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench_engine import Trace, check_targets, kv_capacity, main, summarize
from loadtests.workloads import long_prompt_workload

SYSTEMS = {
    "chat": ["hf_generate_static16", "hf_generate_batch", "engine_static", "engine_dynamic",
             "engine_stall_free"],
    "long_prompt": ["engine_static", "engine_dynamic", "engine_stall_free"],
}


def test_summarize_computes_ttft_tbt_and_throughput() -> None:
    traces = [Trace("a", "short", 0.0, [1.0, 1.5, 2.0]), Trace("b", "long", 1.0, [4.0, 6.0])]
    row = summarize(traces)
    assert row["output_tokens"] == 5
    assert row["elapsed_s"] == pytest.approx(6.0)
    assert row["output_tok_s"] == pytest.approx(5 / 6)
    assert row["ttft_p50_s"] == 1.0  # TTFTs 1.0 and 3.0: nearest rank, an observed one, no midpoint
    assert row["tbt_p50_s"] == pytest.approx(0.5)  # gaps 0.5, 0.5, 2.0 pooled
    assert row["tbt_max_s"] == pytest.approx(2.0)
    assert row["ttft_p50_long_s"] == pytest.approx(3.0)


def test_kv_capacity_is_what_sixteen_padded_sequences_hold() -> None:
    w = long_prompt_workload(32000, seed=0, num_short=2, num_long=1)
    assert kv_capacity(w, 16) == 16 * w.max_total_len // 16 * 16
    assert kv_capacity(w, 16) <= 16 * w.max_total_len


def test_targets_compare_ratios() -> None:
    rows = [{"workload": "long_prompt", "system": "engine_stall_free", "output_tok_s": 95.0,
             "tbt_p99_s": 0.1},
            {"workload": "long_prompt", "system": "engine_dynamic", "output_tok_s": 100.0,
             "tbt_p99_s": 0.5}]
    t = {x["ratio"]: x for x in check_targets(rows)}
    assert t["engine_stall_free / engine_dynamic tbt_p99_s"]["met"] is True
    assert t["engine_stall_free / engine_dynamic output_tok_s"]["value"] == pytest.approx(0.95)
    assert t["engine_stall_free / hf_generate_batch output_tok_s"]["met"] is None


def test_bench_smoke_on_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = main(["--model", "embedded:tiny", "--quick", "--chat-requests", "8",
                   "--long-shorts", "4", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    got = {(r["workload"], r["system"]): r for r in data["rows"]}
    for workload, systems in SYSTEMS.items():
        for system in systems:
            row = got[(workload, system)]
            assert "error" not in row, row.get("error")
            assert row["output_tok_s"] > 0
            assert row["output_tokens"] == data["workloads"][workload]["output_tokens"]
            assert 0 <= row["ttft_p50_s"] <= row["ttft_p99_s"]
            assert 0 < row["tbt_p50_s"] <= row["tbt_p99_s"] <= row["tbt_max_s"]
    assert got[("long_prompt", "engine_stall_free")]["mbp"] == 256
    assert got[("long_prompt", "engine_dynamic")]["mbp"] >= data["workloads"]["long_prompt"]["prompt_len_max"]
    assert data["config"]["model"] == "embedded:tiny"
    assert "engine_stall_free" in data["table"]
