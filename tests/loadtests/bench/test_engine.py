"""The engine benchmark runs end to end on the tiny model: every system produces a row with
positive throughput on every workload, the JSON holds the rows and config, the workloads are
what they claim, and the metrics and target ratios are computed right. On the real model the
chat workloads send its chat-templated prompts to every system, HF baselines included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loadtests.bench.engine import (POISSON_RATE, WORKLOADS, Trace, build_workloads, check_targets,
                                    kv_capacity, main, summarize)
from loadtests.harness.workloads import ChatPromptPool, long_prompt_workload
from replicas.loading.model_files import load_tokenizer

ENGINE = ["engine_static", "engine_dynamic", "engine_stall_free"]
ALL = ["hf_generate_static16", "hf_generate_batch", *ENGINE]
SYSTEMS = {"chat": ALL, "chat_poisson": ALL, "long_prompt": ENGINE, "long_context": ALL}
VOCAB = 32000


@pytest.mark.unit
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


@pytest.mark.unit
def test_kv_capacity_is_what_sixteen_padded_sequences_hold() -> None:
    w = long_prompt_workload(32000, seed=0, num_short=2, num_long=1)
    assert kv_capacity(w, 16) == 16 * w.max_total_len // 16 * 16
    assert kv_capacity(w, 16) <= 16 * w.max_total_len


@pytest.mark.unit
@pytest.mark.parametrize("quick", [True, False])
def test_workloads_are_deterministic_and_chat_poisson_is_chat_retimed(quick: bool) -> None:
    ws = build_workloads(VOCAB, [0, 1, 2], quick, seed=0)
    assert tuple(w.name for w in ws) == WORKLOADS
    assert [w.requests for w in ws] == [w.requests for w in build_workloads(VOCAB, [0, 1, 2], quick, seed=0)]
    chat, poisson = ws[0], ws[1]
    assert [dataclasses.replace(r, arrival_s=0.0) for r in poisson.requests] == chat.requests
    arrivals = [r.arrival_s for r in poisson.requests]
    rate = POISSON_RATE["quick" if quick else "full"]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] < 5 / rate  # starts within a few gaps
    assert 0.5 * len(chat) / rate < arrivals[-1] < 2 * len(chat) / rate
    assert poisson.settings["poisson_rate"] == rate
    assert build_workloads(VOCAB, [], quick, 0, poisson_rate=3.0)[1].settings["poisson_rate"] == 3.0


@pytest.mark.real_model
def test_real_prompts_go_to_chat_and_chat_poisson_only() -> None:
    """With a pool, chat carries real prompts (arrivals and output lengths unchanged) and
    chat_poisson is still chat re-timed; long_prompt and long_context keep their random ids."""
    pool = ChatPromptPool.from_tokenizer(load_tokenizer("embedded:smollm2"), seed=0)
    random, real = (build_workloads(VOCAB, [0, 1, 2], True, seed=0, pool=p) for p in (None, pool))
    chat, poisson = real[0], real[1]
    assert chat.output_lens == random[0].output_lens and poisson.output_lens == random[1].output_lens
    assert [r.arrival_s for r in poisson.requests] == [r.arrival_s for r in random[1].requests]
    assert [dataclasses.replace(r, arrival_s=0.0) for r in poisson.requests] == chat.requests
    prompts = set(pool.short + pool.long)
    assert all(tuple(r.prompt_token_ids) in prompts for r in chat.requests)
    assert {r.kind for r in chat.requests} == {"short", "long"}
    assert chat.settings["prompt"]["source"] == "real"
    assert [w.requests for w in real[2:]] == [w.requests for w in random[2:]]


@pytest.mark.unit
def test_long_context_sizes_and_kv_capacity() -> None:
    """Quick: 2 longs of 1000-1200 + 96 out, 16 shorts; flags override the counts. Every system's
    KV (16 x longest) holds all requests at once several times over: nothing is KV-bound."""
    context = build_workloads(VOCAB, [], quick=True, seed=0)[3]
    longs = [r for r in context.requests if r.kind == "long"]
    shorts = [r for r in context.requests if r.kind == "short"]
    assert len(longs) == 2 and len(shorts) == 16
    assert all(1000 <= r.prompt_len <= 1200 and r.max_tokens == 96 for r in longs)
    assert all(64 <= r.prompt_len <= 128 and 48 <= r.max_tokens <= 96 for r in shorts)
    full = build_workloads(VOCAB, [], quick=False, seed=0, context_longs=3, context_shorts=20)[3]
    assert [r.kind for r in full.requests].count("long") == 3 and len(full) == 23
    for w in (context, full):
        assert kv_capacity(w, 16) > 3 * sum(r.total_len for r in w.requests)


@pytest.mark.unit
def test_targets_compare_ratios() -> None:
    rows = [{"workload": "long_prompt", "system": "engine_stall_free", "output_tok_s": 95.0,
             "tbt_p99_s": 0.1},
            {"workload": "long_prompt", "system": "engine_dynamic", "output_tok_s": 100.0,
             "tbt_p99_s": 0.5}]
    t = {x["ratio"]: x for x in check_targets(rows)}
    assert t["engine_stall_free / engine_dynamic tbt_p99_s"]["met"] is True
    assert t["engine_stall_free / engine_dynamic output_tok_s"]["value"] == pytest.approx(0.95)
    assert t["engine_stall_free / hf_generate_batch output_tok_s"]["met"] is None


@pytest.mark.unit
def test_targets_on_chat_poisson_and_long_context() -> None:
    """stall_free >= 4x HF static and >= 1.5x generate_batch on chat; >= 1.5x generate_batch
    on chat_poisson and long_context."""
    def row(workload: str, system: str, tok_s: float) -> dict:
        return {"workload": workload, "system": system, "output_tok_s": tok_s, "tbt_p99_s": 0.1}

    rows = [row("chat", "engine_stall_free", 300.0), row("chat", "hf_generate_static16", 80.0),
            row("chat", "hf_generate_batch", 150.0),
            row("chat_poisson", "engine_stall_free", 200.0), row("chat_poisson", "hf_generate_batch", 160.0),
            row("long_context", "engine_stall_free", 240.0), row("long_context", "hf_generate_batch", 100.0),
            {"workload": "long_context", "system": "hf_generate_static16", "error": "failed"}]
    t = {(x["workload"], x["ratio"]): x for x in check_targets(rows)}
    vs_batch = "engine_stall_free / hf_generate_batch output_tok_s"
    static = t[("chat", "engine_stall_free / hf_generate_static16 output_tok_s")]
    assert static["value"] == pytest.approx(3.75) and static["met"] is False and static["target"] == ">= 4"
    assert t[("chat", vs_batch)]["value"] == pytest.approx(2.0) and t[("chat", vs_batch)]["met"] is True
    assert t[("chat_poisson", vs_batch)]["value"] == pytest.approx(1.25)
    assert t[("chat_poisson", vs_batch)]["met"] is False
    context = t[("long_context", vs_batch)]
    assert context["value"] == pytest.approx(2.4) and context["met"] is True and context["target"] == ">= 1.5"


@pytest.mark.engine
def test_bench_smoke_on_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = main(["--model", "embedded:tiny", "--quick", "--chat-requests", "6",
                   "--long-shorts", "3", "--context-shorts", "3", "--json", str(out)])
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
    assert got[("long_context", "engine_stall_free")]["mbp"] == 512
    assert got[("chat_poisson", "hf_generate_batch")]["mbp"] == 512
    assert data["workloads"]["chat_poisson"]["last_arrival_s"] > 0
    assert data["workloads"]["long_context"]["num_requests"] == 2 + 3
    assert "Poisson arrivals at 12 req/s" in data["table"]
    assert got[("long_prompt", "engine_dynamic")]["mbp"] >= data["workloads"]["long_prompt"]["prompt_len_max"]
    assert data["config"]["model"] == "embedded:tiny"
    assert "engine_stall_free" in data["table"]


@pytest.mark.real_model
def test_bench_smoke_on_the_real_model_with_real_prompts(tmp_path: Path) -> None:
    """Two chat requests (seed 22: a question and a passage task, 10 and 18 tokens out) on
    SmolLM2 through HF static batches, generate_batch and stall_free: every system makes every
    token of the same real prompts, and the config says which prompts and model ran."""
    out = tmp_path / "bench.json"
    systems = ["hf_generate_static16", "hf_generate_batch", "engine_stall_free"]
    main(["--model", "embedded:smollm2", "--quick", "--workloads", "chat", "--chat-requests", "2",
          "--seed", "22", "--systems", ",".join(systems), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["model"] == "embedded:smollm2" and data["config"]["prompts"] == "real"
    assert data["config"]["prefix_caching"] is False
    short, long = data["config"]["real_prompt_lens"]["short"], data["config"]["real_prompt_lens"]["long"]
    chat = data["workloads"]["chat"]
    assert chat["settings"]["prompt"]["source"] == "real" and chat["num_requests"] == 2
    assert short[0] <= chat["prompt_len_p50"] <= short[1] and long[0] <= chat["prompt_len_max"] <= long[1]
    rows = {r["system"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(systems)
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["output_tokens"] == chat["output_tokens"] == 10 + 18
    assert rows["hf_generate_batch"]["allow_block_sharing"] is False
    assert "embedded:smollm2, real chat prompts" in data["table"]
