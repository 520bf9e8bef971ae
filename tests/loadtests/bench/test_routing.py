"""bench_routing's pure parts: per-replica metric parsing, the ratio, the table and the JSON."""

from __future__ import annotations

import json

import pytest

from loadtests.bench import routing as br

pytestmark = pytest.mark.unit

METRICS_TEXT = """\
# HELP ray_stallfree_request_success_total Finished requests by finish reason.
# TYPE ray_stallfree_request_success_total counter
ray_stallfree_request_success_total{Component="core_worker",application="llm",deployment="LLMServer",finished_reason="length",model_name="embedded:tiny",replica="abc123",route="/"} 41.0
ray_stallfree_request_success_total{Component="core_worker",application="llm",deployment="LLMServer",finished_reason="abort",model_name="embedded:tiny",replica="abc123",route="/"} 2.0
ray_stallfree_request_success_total{Component="core_worker",application="llm",deployment="LLMServer",finished_reason="length",model_name="embedded:tiny",replica="xyz789",route="/"} 37.0
ray_stallfree_request_success_total{application="llm",deployment="OpenAIIngress",replica="ing1"} 5.0
ray_stallfree_request_success_total_created{replica="abc123"} 1.7e9
ray_stallfree_generation_tokens_total{deployment="LLMServer",replica="abc123"} 999.0
ray_stallfree_request_success_total{deployment="LLMServer"} 3.0
"""


def test_requests_per_replica_sums_finish_reasons_per_replica():
    assert br.requests_per_replica(METRICS_TEXT) == {"abc123": 43.0, "xyz789": 37.0}


def test_requests_per_replica_empty_and_timestamped_lines():
    assert br.requests_per_replica("") == {}
    text = 'ray_stallfree_request_success_total{replica="r1",deployment="LLMServer"} 4 1700000000000\n'
    assert br.requests_per_replica(text) == {"r1": 4.0}


def test_per_replica_delta_subtracts_the_baseline():
    before = {"abc123": 3.0}
    after = {"xyz789": 10.0, "abc123": 43.0}
    assert br.per_replica_delta(before, after) == {"abc123": 40, "xyz789": 10}


def row(router: str, ttft99: float | None, per: dict[str, int]) -> dict:
    return {"router": router, "requests": 150, "finished": 148, "errors": 0, "unfinished": 2,
            "ttft_p50_s": 0.12, "ttft_p99_s": ttft99, "tbt_p50_s": 0.03, "tbt_p99_s": 0.2,
            "output_tok_s": 250.0, "req_s": 4.9, "per_replica": per}


def test_ratio_and_table():
    rows = [row("token_load", 0.6, {"a": 75, "b": 73}), row("power_of_two", 1.5, {"a": 90, "b": 58})]
    assert br.ttft_p99_ratio(rows) == pytest.approx(0.4)
    table = br.format_table(rows)
    lines = table.splitlines()
    assert lines[0] == br.HEADER
    assert lines[1].startswith("token_load") and "75/73" in lines[1] and "600" in lines[1]
    assert lines[2].startswith("power_of_two") and "90/58" in lines[2] and "1500" in lines[2]
    assert "= 0.40" in lines[3] and "60% lower" in lines[3] and "met" in lines[3]
    assert "not met" not in lines[3]


def test_ratio_missing_router_or_data():
    assert br.ttft_p99_ratio([row("token_load", 0.6, {})]) is None
    assert br.ttft_p99_ratio([row("token_load", 0.6, {}), row("power_of_two", None, {})]) is None
    table = br.format_table([row("token_load", None, {})])
    assert "      -" in table and "p99 TTFT" not in table


def test_result_doc_is_json_and_flags_the_target():
    rows = [row("token_load", 1.2, {"a": 1}), row("power_of_two", 1.5, {"a": 1})]
    doc = json.loads(json.dumps(br.result_doc({"rps": 5.0}, rows)))
    assert doc["ttft_p99_ratio"] == pytest.approx(0.8)
    assert doc["target_met"] is False
    assert doc["rows"][0]["per_replica"] == {"a": 1}


def test_parse_args_quick_defaults():
    args = br.parse_args(["--quick"])
    assert (args.duration_s, args.drain_s, args.routers) == (30.0, 20.0, ["token_load", "power_of_two"])
    full = br.parse_args([])
    assert full.duration_s == 90.0 and str(full.json) == "loadtests/out/bench_routing.json"


def test_app_args_are_valid_for_both_routers():
    from app.args import AppArgs

    args = br.parse_args(["--quick"])
    for router in br.ROUTERS:
        a = AppArgs.model_validate(br.app_args(args, router))
        assert a.router == router and a.num_replicas == 2 and args.start == "local"


def test_the_haproxy_path_weighs_for_token_load_and_not_for_power_of_two():
    """`--start make --set ingress_in_replica=true --set haproxy_weight_interval_ms=250`: the
    engine replicas behind HAProxy push token-load weights under token_load, and leave HAProxy's
    least connections plain under power_of_two; a `--set` goes over the bench's own settings."""
    from app.args import AppArgs

    args = br.parse_args(["--quick", "--start", "make", "--set", "ingress_in_replica=true",
                          "--set", "haproxy_weight_interval_ms=250", "--set", "engine.max_batch_prefill_tokens=128"])
    assert "-" in br.format_row({**row("token_load", 1.0, {}), "per_replica": None})  # no counts on that path
    weighed = {router: AppArgs.model_validate(br.app_args(args, router)).haproxy_weights() for router in br.ROUTERS}
    assert weighed == {"token_load": True, "power_of_two": False}
    assert br.app_args(args, "token_load")["engine"] == {"num_threads": 1, "max_batch_prefill_tokens": 128,
                                                         "max_batch_total_tokens": 16384, "tbt_slo_ms": 500.0}
