"""A short Locust run against a live server ends with zero failures and TTFT/TBT/E2E entries;
the summary's numbers (percentiles, goodput, censored TTFTs) are computed as documented. Real
chat prompts change the prompts of the mix and nothing else, and reach the server as sent.

The server runs in a subprocess on its own Ray instance (`loadtests/harness/serve_local.py`), so this
test may share a pytest session with tests/app, whose Ray lives in the pytest process.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.harness import serve_local
from loadtests.load.loadtest import main as loadtest_main
from loadtests.load.loadtest import parse_duration, summarize
from loadtests.harness.mix import MixSpec, mixed_requests
from loadtests.load.sweep import whole_prompt_mbp
from loadtests.harness.workloads import ChatPromptPool
from replicas.loading.model_files import load_tokenizer

SERVER_ARGS = {"model": "embedded:tiny", "num_cpus": 1, "ingress_num_cpus": 0.1,
               "engine": {"policy": "stall_free", "max_batch_prefill_tokens": 256,
                          "max_batch_total_tokens": 8192, "max_num_seqs": 32},
               "replica": {"stream_interval_ms": 0}}  # a chunk per pass: the TBT entries are gaps
SMOKE_MIX = ["--prompt-median", "24", "--output-median", "12", "--long-share", "0.2",
             "--long-min", "200", "--long-max", "300", "--seed", "3"]


# ---- pure parts --------------------------------------------------------------------------


def _req(ttft: float | None, gaps: list[float], *, finished: bool = True, error: str | None = None,
         start: float = 0.0, end: float = 10.0, tokens: int | None = None, kind: str = "short") -> dict:
    return {"kind": kind, "ttft_s": ttft, "gaps_s": gaps, "finished": finished, "error": error,
            "start_s": start, "end_s": end, "e2e_s": end - start if finished else None,
            "completion_tokens": tokens if tokens is not None else len(gaps) + 1,
            "num_chunks": len(gaps) + (ttft is not None)}


@pytest.mark.unit
def test_summary_counts_goodput_errors_and_censored_ttft() -> None:
    reqs = [_req(0.5, [0.1, 0.1], end=4.0),             # meets both SLOs
            _req(0.5, [0.1, 0.9], end=5.0),             # one gap over the TBT SLO
            _req(3.0, [0.1], end=6.0),                  # TTFT over the SLO
            _req(None, [], finished=False, start=2.0),  # never got a token: TTFT >= 8 s
            _req(None, [], finished=False, error="HTTP 429: full", end=2.5)]
    s = summarize(reqs, ttft_slo_s=1.0, tbt_slo_s=0.5)
    assert (s["requests"], s["finished"], s["errors"], s["unfinished"]) == (5, 3, 1, 1)
    assert s["good"] == 1 and s["goodput_req_s"] == pytest.approx(1 / 10)
    assert s["max_gap_slo_request_share"] == pytest.approx(1 / 5)
    assert s["window_s"] == pytest.approx(10.0)
    assert s["ttft_p50_s"] == 0.5  # nearest rank of 0.5, 0.5, 3.0 and the censored 8.0
    assert s["tbt_max_s"] == pytest.approx(0.9) and s["num_tbt"] == 5
    assert s["output_tokens"] == 3 + 3 + 2
    assert s["error_messages"] == {"HTTP 429: full": 1}


@pytest.mark.unit
def test_parse_duration() -> None:
    assert [parse_duration(x) for x in ("60s", "2m", "1m30s", "90", "1h")] == [60, 120, 90, 90, 3600]
    with pytest.raises(Exception, match="not a duration"):
        parse_duration("soon")


@pytest.mark.unit
def test_mix_is_the_same_sequence_at_every_rate() -> None:
    slow = [r for r, _ in zip(mixed_requests(MixSpec(rps=0.5, seed=7)), range(150))]
    fast = [r for r, _ in zip(mixed_requests(MixSpec(rps=2.0, seed=7)), range(150))]
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.max_tokens for r in slow] == [r.max_tokens for r in fast]
    assert [4 * f.arrival_s for f in fast] == pytest.approx([s.arrival_s for s in slow])
    longs = [r for r in slow if r.kind == "long"]
    assert 0.03 < len(longs) / len(slow) < 0.2  # long_share 0.1
    assert all(1024 <= r.prompt_len <= 1536 for r in longs)
    assert all(min(r.prompt_token_ids) > 2 and max(r.prompt_token_ids) < 2048 for r in slow)


@pytest.mark.unit
def test_whole_prompt_budget_admits_the_longest_prompt() -> None:
    mix = MixSpec(long_max=1300)
    assert whole_prompt_mbp(mix) == 1536 >= mix.long_max


@pytest.mark.real_model
def test_real_mix_is_the_random_mix_with_chat_prompts() -> None:
    """Same ids, kinds, output lengths and arrivals; a short request gets a question, a long
    one a passage task, both from the pool."""
    pool = ChatPromptPool.for_model("embedded:smollm2", seed=7)
    spec = MixSpec(rps=2.0, seed=7, long_share=0.2)
    rand = [r for r, _ in zip(mixed_requests(spec), range(150))]
    real = [r for r, _ in zip(mixed_requests(dataclasses.replace(spec, prompts="real"), pool=pool), range(150))]
    keep = lambda reqs: [(r.request_id, r.kind, r.max_tokens, r.arrival_s) for r in reqs]  # noqa: E731
    assert keep(real) == keep(rand)
    assert real == [r for r, _ in zip(mixed_requests(dataclasses.replace(spec, prompts="real"), pool=pool),
                                     range(150))]
    assert all(tuple(r.prompt_token_ids) in (pool.long if r.kind == "long" else pool.short) for r in real)
    assert 0.1 < sum(r.kind == "long" for r in real) / 150 < 0.3
    assert whole_prompt_mbp(spec, pool) == 512 >= pool.max_prompt_len
    with pytest.raises(ValueError, match="ChatPromptPool"):
        next(mixed_requests(dataclasses.replace(spec, prompts="real")))
    with pytest.raises(ValueError, match="prompts"):
        MixSpec(prompts="text")  # type: ignore[arg-type]


# ---- against a live server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with serve_local.served(SERVER_ARGS, str(log)) as server:
        yield server.url


@pytest.mark.process
def test_short_locust_run_has_no_failures_and_reports_ttft_tbt_e2e(live_server: str, tmp_path: Path) -> None:
    code = loadtest_main(["--host", live_server, "--duration", "5s", "--drain", "30s", "--rps", "2",
                          "--out", str(tmp_path), *SMOKE_MIX])
    assert code == 0
    with open(tmp_path / "loadtest_stats.csv") as f:
        stats = {row["Type"]: row for row in csv.DictReader(f) if row["Type"]}
    assert {"POST", "TTFT", "TBT", "E2E"} <= set(stats)
    assert all(int(row["Failure Count"]) == 0 for row in stats.values())
    sent = int(stats["POST"]["Request Count"])
    assert sent > 0
    assert int(stats["TTFT"]["Request Count"]) == int(stats["E2E"]["Request Count"]) == sent
    num_tbt = int(stats["TBT"]["Request Count"])
    assert num_tbt > 0

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == summary["finished"] == sent
    assert summary["errors"] == summary["unfinished"] == 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"]
    assert 0 < summary["tbt_p50_s"] <= summary["tbt_p99_s"] <= summary["tbt_max_s"]
    assert summary["output_tok_s"] > 0 and summary["num_tbt"] == int(stats["TBT"]["Request Count"])
    samples = [json.loads(line) for line in (tmp_path / "loadtest_samples.jsonl").read_text().splitlines()]
    assert samples[0]["type"] == "meta" and samples[0]["mix"]["long_min"] == 200
    assert all(r["completion_tokens"] == r["max_tokens"] for r in samples[1:])  # ignore_eos: exact
    assert num_tbt == sum(len(r["gaps_s"]) for r in samples[1:])  # one Locust TBT entry per gap
    assert (tmp_path / "loadtest.html").stat().st_size > 0


@pytest.mark.process
def test_real_prompts_reach_the_server_as_sent(live_server: str, tmp_path: Path) -> None:
    """`--prompts real`: the Locust process builds the pool from --model's tokenizer; every
    request is one of its prompts and gets exactly its max_tokens."""
    pool = ChatPromptPool.from_tokenizer(load_tokenizer("embedded:tiny"), seed=3)
    code = loadtest_main(["--host", live_server, "--duration", "4s", "--drain", "30s", "--rps", "2",
                          "--out", str(tmp_path), "--prompts", "real", "--model", "embedded:tiny",
                          *SMOKE_MIX])
    assert code == 0
    samples = [json.loads(line) for line in (tmp_path / "loadtest_samples.jsonl").read_text().splitlines()]
    assert samples[0]["mix"]["prompts"] == "real"
    reqs = samples[1:]
    assert reqs and all(r["finished"] and r["completion_tokens"] == r["max_tokens"] for r in reqs)
    for r in reqs:
        assert r["prompt_len"] in {len(p) for p in (pool.long if r["kind"] == "long" else pool.short)}
        assert r["prompt_tokens"] == r["prompt_len"]  # the server's count of the ids it got
    with pytest.raises(SystemExit):
        loadtest_main(["--host", live_server, "--prompts", "real"])  # which tokenizer? no --model


@pytest.mark.unit
def test_the_sweep_lets_only_its_slo_line_choose_the_budget() -> None:
    from app.args import AppArgs
    from loadtests.load.sweep import SLO_POLICY, SWEEP_MIX, app_args, parse_args

    args = parse_args(["--quick", "--policies", f"dynamic,stall_free,{SLO_POLICY}"])
    fixed, slo = app_args(args, "stall_free", SWEEP_MIX), app_args(args, SLO_POLICY, SWEEP_MIX)
    assert fixed["engine"]["policy"] == slo["engine"]["policy"] == "stall_free"
    assert fixed["engine"]["max_batch_prefill_tokens"] == args.chunk and not fixed["engine"]["slo_budget"]
    assert slo["engine"]["max_batch_prefill_tokens"] == whole_prompt_mbp(SWEEP_MIX) and slo["engine"]["slo_budget"]
    for kwargs in (fixed, slo):
        engine = AppArgs(**kwargs).engine
        assert engine.tbt_slo_ms == args.tbt_slo_ms and engine.slo_budget == kwargs["engine"]["slo_budget"]
        assert engine.budget_margin == 0.8  # the engine's default unless asked
    assert fixed["replica"]["pass_trace_dir"].endswith("passes_stall_free")
    assert slo["replica"]["pass_trace_dir"].endswith(SLO_POLICY)
    narrow = parse_args(["--quick", "--budget-margin", "0.7"])
    assert AppArgs(**app_args(narrow, SLO_POLICY, SWEEP_MIX)).engine.budget_margin == 0.7


@pytest.mark.real_model
def test_the_sweep_sends_real_prompts_on_a_real_model() -> None:
    """The prompt source follows the model; whole-prompt policies get a budget that admits the
    longest real prompt; the prefix cache stays off unless asked (real prompts repeat)."""
    from app.args import AppArgs
    from loadtests.load.loadtest import mix_from_args
    from loadtests.load.sweep import app_args, parse_args

    assert parse_args(["--quick"]).prompts == "random"  # embedded:mid, random weights
    args = parse_args(["--quick", "--model", "embedded:smollm2"])
    assert args.prompts == "real" and parse_args(["--model", "embedded:smollm2", "--prompts", "random"]).prompts == "random"
    mix = mix_from_args(args, 1.0)
    pool = ChatPromptPool.for_model(args.model, mix.seed)
    dynamic = app_args(args, "dynamic", mix, pool)
    assert dynamic["engine"]["max_batch_prefill_tokens"] == 512 >= pool.max_prompt_len
    assert dynamic["engine"]["enable_prefix_caching"] is False and dynamic["model"] == "embedded:smollm2"
    assert AppArgs(**dynamic).engine.enable_prefix_caching is False
    cached = parse_args(["--quick", "--model", "embedded:smollm2", "--prefix-caching"])
    assert app_args(cached, "stall_free", mix, pool)["engine"]["enable_prefix_caching"] is True
