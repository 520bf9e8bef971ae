"""loadtests/load/overload/: its pure parts (SSE parsing, classification, statistics, the rate search,
recovery, RSS reports, the target and run tables, the workloads, the flags), and one short run
against a server started as `serve run` starts it. Numbers are asserted, never timings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadtests.harness import procs
from loadtests.load.overload import cli, cpu, gauges, phases, records, report, search, sse_client, wire, workload
from loadtests.load.overload import rss as mem
from replicas.serving import startup_gc
from loadtests.load.overload import summary as stats


def rec(**kw: object) -> records.Rec:
    base: dict[str, object] = {"kind": "cmpl", "sched_s": 0.0}
    return records.Rec(**{**base, **kw})  # type: ignore[arg-type]


# ---- SSE ---------------------------------------------------------------------------------------


@pytest.mark.unit
def test_sse_kind_tells_content_from_done_error_and_empty_chunks() -> None:
    assert sse_client.sse_kind(b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}') == "content"
    assert sse_client.sse_kind(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}') == "other"
    assert sse_client.sse_kind(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}') == "other"
    assert sse_client.sse_kind(b'data: {"choices":[{"delta":{"content":"x"}}]}') == "content"
    assert sse_client.sse_kind(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}') == "other"
    assert sse_client.sse_kind(b"data: [DONE]") == "done"
    assert sse_client.sse_kind(b'data: {"error": {"message": "boom"}}') == "error"
    assert sse_client.sse_kind(b'data: {"error":{"message":"boom"}}') == "error"
    assert sse_client.sse_kind(b": keep-alive") == "other"


@pytest.mark.unit
def test_split_events_keeps_the_unfinished_tail() -> None:
    events, rest = sse_client.split_events(b"data: a\n\ndata: b\n\ndata: c")
    assert events == [b"data: a", b"data: b"] and rest == b"data: c"
    events, rest = sse_client.split_events(rest + b"\n\n")
    assert events == [b"data: c"] and rest == b""
    events, rest = sse_client.split_events(b"data: x\r\n\r\n")
    assert events == [b"data: x"] and rest == b""


@pytest.mark.unit
def test_an_answer_times_every_gap_as_read_and_on_arrival_and_when_the_worst_ended() -> None:
    """Reads at t = 10.0 (first token), 10.1, 10.4, 10.5 (+[DONE]) of a request scheduled at 9.9,
    2 s into its phase, whose bytes reached the kernel at 9.99, 10.09, 10.2, 10.3: gaps as read
    0.1, 0.3, 0.1, on arrival 0.1, 0.11, 0.1; the worst ended 2 + 0.5 s into the phase."""
    content = b'data: {"choices":[{"text":"a"}]}\n\n'
    reads = [(10.0, 9.99, content), (10.1, 10.09, content), (10.4, 10.2, content[:9]),
             (10.4, 10.2, content[9:]), (10.5, 10.3, content + b"data: [DONE]\n\n")]
    r = rec(sched_s=2.0)
    answer = sse_client.Answer(records.ReqSpec("/v1/completions", b"{}", stream=True), r, 9.9)
    head = wire.Head(200, {"content-type": "text/event-stream"})
    answer.head(head, 9.95, 9.94)
    for now, at, piece in reads:
        answer.body(piece, now, at)
    answer.end(head)
    assert r.status == 200 and (r.headers_s, r.headers_arrival_s) == (pytest.approx(0.05), pytest.approx(0.04))
    assert r.ttft_s == pytest.approx(0.1) and r.gaps == pytest.approx([0.1, 0.3, 0.1])
    assert r.arrival_gaps == pytest.approx([0.1, 0.11, 0.1])
    assert r.worst_gap_at_s == pytest.approx(2.5) and r.chunks == 4 and r.done and not r.error_event
    assert records.compact(r)["worst_gap_at_s"] == pytest.approx(2.5)
    s = stats.summarize([r], 1.0)
    assert (s["tbt_arrival_p50_s"], s["num_gaps"]) == (pytest.approx(0.1), 3)


@pytest.mark.unit
def test_an_answer_reads_a_refusal_and_a_whole_answer_at_their_end() -> None:
    """A 429 in OpenAI's shape with Retry-After, split over two reads: the bound named, the
    header seen; a non-streamed 200 with choices is done; a 503 with an HTML body is not JSON."""
    body = json.dumps({"error": {"message": "the replica's queue is full (x)", "type": "t",
                                 "param": None, "code": 429}}).encode()
    r = rec()
    answer = sse_client.Answer(records.ReqSpec("/v1/completions", b"{}", stream=True), r, 0.0)
    head = wire.Head(429, {"retry-after": "1"})
    answer.head(head, 0.3, 0.01)  # read late: the 429 arrived at 10 ms
    answer.body(body[:10], 0.02, 0.02)
    answer.body(body[10:], 0.03, 0.03)
    answer.end(head)
    assert (r.status, r.retry_after, r.json_body, r.openai_body) == (429, True, True, True)
    assert r.refused_by == "replica: queue bound" and records.classify(r) == "429"
    s = stats.summarize([r], 1.0)
    assert (s["reject_p99_s"], s["reject_arrival_p99_s"]) == (pytest.approx(0.3), pytest.approx(0.01))
    rows = {t["target"]: t["status"] for t in report.overload_targets(s, None, None, {}, CFG)}
    assert rows["429 p99 latency < 500 ms"] == "PASS" and rows["429 p99 latency on arrival < 500 ms"] == "PASS"
    whole = rec()
    answer = sse_client.Answer(records.ReqSpec("/v1/completions", b"{}", stream=False), whole, 0.0)
    answer.head(wire.Head(200, {}), 0.01, 0.01)
    answer.body(b'{"choices": [{"text": "x"}]}', 0.02, 0.02)
    answer.end(wire.Head(200, {}))
    assert whole.done and records.classify(whole) == "ok" and whole.ttft_s is not None
    html = rec()
    answer = sse_client.Answer(records.ReqSpec("/v1/completions", b"{}", stream=True), html, 0.0)
    answer.head(wire.Head(503, {}), 0.01, 0.01)
    answer.body(b"<html>busy</html>", 0.02, 0.02)
    answer.end(wire.Head(503, {}))
    assert (html.json_body, html.openai_body, records.classify(html)) == (False, False, "5xx")


# ---- classification ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("kw", "category"), [
    ({"status": 200, "done": True}, "ok"),
    ({"status": 200, "done": False}, "cut"),
    ({"status": 200, "done": True, "error_event": True}, "error_event"),
    ({"status": 200, "done": False, "error_event": True}, "error_event"),
    ({"status": 429}, "429"),
    ({"status": 503}, "5xx"),
    ({"status": 500}, "5xx"),
    ({"status": 400}, "4xx"),
    ({"status": None, "exc": "ConnectError"}, "transport_error"),
    ({"status": 200, "timed_out": True}, "timeout"),
    ({"status": None, "timed_out": True}, "timeout"),
    ({"status": 200, "abandoned": True, "timed_out": True}, "abandoned"),
])
def test_classify(kw: dict[str, object], category: str) -> None:
    assert records.classify(rec(**kw)) == category


@pytest.mark.unit
def test_is_openai_error_wants_all_four_fields() -> None:
    good = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "x"}}
    assert records.is_openai_error(good)
    assert not records.is_openai_error({"error": {"message": "busy", "type": "x", "param": None}})
    assert not records.is_openai_error({"error": "busy"})
    assert not records.is_openai_error({"detail": "busy"})
    assert not records.is_openai_error(["error"])


# ---- statistics --------------------------------------------------------------------------------


@pytest.mark.unit
def test_summarize_counts_latencies_and_rejections() -> None:
    recs = [rec(status=200, done=True, headers_s=0.01, ttft_s=0.1, end_s=1.0, gaps=[0.02, 0.04]),
            rec(status=200, done=True, headers_s=0.01, ttft_s=0.3, end_s=1.2, gaps=[0.06]),
            rec(status=200, done=False, headers_s=0.01, ttft_s=None, end_s=5.0),  # cut, waited 5 s
            rec(status=429, headers_s=0.05, end_s=0.05, retry_after=True, json_body=True, openai_body=True,
                refused_by="proxy: queueing"),
            rec(status=429, headers_s=0.15, end_s=0.15, retry_after=False, json_body=True, openai_body=False),
            rec(status=500, headers_s=0.2, end_s=0.2, json_body=False, openai_body=False),
            rec(status=None, exc="ReadError", end_s=0.3)]
    s = stats.summarize(recs, 2.0)
    assert s["sent"] == 7 and s["offered_req_s"] == 3.5
    assert s["counts"]["ok"] == 2 and s["counts"]["cut"] == 1 and s["counts"]["429"] == 2
    assert s["counts"]["5xx"] == 1 and s["counts"]["transport_error"] == 1
    assert sum(s["counts"].values()) == 7
    assert s["completed_ratio"] == pytest.approx(2 / 7)
    assert s["accepted"] == 3
    assert s["ttft_max_s"] == 5.0  # a 200 without a first token counts with its wait
    assert s["tbt_max_s"] == 0.06 and s["num_gaps"] == 3
    assert s["reject_max_s"] == 0.15 and s["reject_p50_s"] == 0.05  # nearest rank of 0.05, 0.15
    assert s["reject_retry_after"] == 1 and s["reject_openai_body"] == 1
    assert s["non_json_error_bodies"] == 1 and s["non_openai_error_bodies"] == 2
    assert s["status_codes"] == {"200": 3, "429": 2, "500": 1, "none": 1}
    assert s["transport_errors"] == {"ReadError": 1}
    assert s["reject_by"] == {"proxy: queueing": {"n": 1, "p50_s": 0.05, "p99_s": 0.05, "max_s": 0.05},
                              "other": {"n": 1, "p50_s": 0.15, "p99_s": 0.15, "max_s": 0.15}}


@pytest.mark.unit
@pytest.mark.parametrize("message, who", [
    ("the server is at capacity: the requests before this one wait 2.3 s for their first token "
     "(the proxy's target 2.0 s); retry after 1 s", "proxy: queueing"),
    ("the server is at capacity: 12 requests are in flight at this ingress, its limit is 8 (...)",
     "ingress: in-flight limit"),
    ("the server is at capacity: 900 prompt tokens wait and this request adds 50, over the bound of "
     "800 the replicas' queues take; retry after 2 s", "ingress: token gate"),
    ("the request was refused after waiting 10.0 s (queue_timeout_s) without being scheduled: the "
     "server is overloaded; retry after 3 s", "replica: queue deadline"),
    ("the request was refused after 1.2 s in the queue: at the rate it drains (300 prompt tokens/s) it "
     "would not be scheduled within queue_timeout_s (5.0 s): the server is overloaded; retry after 3 s",
     "replica: predicted past deadline"),
    ("Service Unavailable", "other")])
def test_refuser_names_the_bound_from_the_message(message: str, who: str) -> None:
    assert records.refuser(message) == who


@pytest.mark.unit
def test_summarize_empty() -> None:
    s = stats.summarize([], 0.0)
    assert s["sent"] == 0 and s["offered_req_s"] == 0.0 and s["ttft_p99_s"] is None


@pytest.mark.unit
def test_step_verdict() -> None:
    good = [rec(status=200, done=True, ttft_s=0.1, end_s=0.5) for _ in range(20)]
    assert search.step_verdict(stats.summarize(good, 1.0), 0.95, 2.0) == (True, "ok")
    slow = good[:-1] + [rec(status=200, done=True, ttft_s=3.0, end_s=3.5)] * 5
    assert not search.step_verdict(stats.summarize(slow, 1.0), 0.95, 2.0)[0]
    behind = good + [rec(status=200, abandoned=True)] * 2
    ok, why = search.step_verdict(stats.summarize(behind, 1.0), 0.95, 2.0)
    assert not ok and "completed" in why
    assert not search.step_verdict(stats.summarize(good + [rec(status=429)], 1.0), 0.9, 2.0)[0]
    assert search.step_verdict(stats.summarize([], 1.0), 0.95, 2.0) == (False, "no requests")


@pytest.mark.unit
def test_next_rate_doubles_then_stops_at_the_first_failure() -> None:
    assert search.next_rate([], 2.0, 6, 256.0) == 2.0
    assert search.next_rate([(2.0, True)], 2.0, 6, 256.0) == 4.0
    assert search.next_rate([(2.0, True), (4.0, False)], 2.0, 6, 256.0) is None
    assert search.next_rate([(2.0, True), (4.0, True)], 2.0, 2, 256.0) is None  # out of steps
    assert search.next_rate([(128.0, True)], 128.0, 6, 200.0) is None  # above max_rate


@pytest.mark.unit
def test_next_rate_halves_while_nothing_passed() -> None:
    assert search.next_rate([(2.0, False)], 2.0, 6, 256.0) == 1.0
    assert search.next_rate([(2.0, False), (1.0, False)], 2.0, 6, 256.0) == 0.5
    assert search.next_rate([(2.0, False), (1.0, True)], 2.0, 6, 256.0) is None  # 2 already failed
    assert search.next_rate([(0.2, False)], 0.2, 6, 256.0) is None  # below min_rate


@pytest.mark.unit
def test_sustainable_rate() -> None:
    assert search.sustainable_rate([(2.0, True), (4.0, True), (8.0, False)]) == 4.0
    assert search.sustainable_rate([(2.0, False), (1.0, False)]) is None


@pytest.mark.unit
def test_recovery_probes_come_no_faster_than_the_sustainable_rate() -> None:
    assert phases.probe_interval_s(None, 1.0) == 1.0  # 1 req/s sustained: a probe a second
    assert phases.probe_interval_s(None, 8.0) == phases.MIN_PROBE_INTERVAL_S == 0.5
    assert phases.probe_interval_s(0.25, 1.0) == 0.25  # as given


@pytest.mark.unit
def test_recovery_seconds_needs_every_later_probe_normal() -> None:
    assert search.recovery_seconds([(0.0, True, 0.02), (0.5, True, 0.02)]) == pytest.approx(0.02)
    probes = [(0.0, False, 9.0), (0.5, True, 0.05), (1.0, False, 3.0), (1.5, True, 0.04),
              (2.0, True, 0.03)]
    assert search.recovery_seconds(probes) == pytest.approx(1.54)
    assert search.recovery_seconds(probes + [(2.5, False, None)]) is None
    assert search.recovery_seconds([]) is None


@pytest.mark.unit
def test_slope_per_min_is_least_squares() -> None:
    ts = [0.0, 60.0, 120.0, 180.0]
    assert mem.slope_per_min(ts, [100.0, 102.0, 104.0, 106.0]) == pytest.approx(2.0)
    assert mem.slope_per_min(ts, [100.0, 100.0, 100.0, 100.0]) == pytest.approx(0.0)
    noisy = [100.0, 103.0, 101.0, 104.0]
    assert mem.slope_per_min(ts, noisy) == pytest.approx(60 * np.polyfit(ts, noisy, 1)[0])
    assert mem.slope_per_min([1.0], [5.0]) is None
    assert mem.slope_per_min([1.0, 1.0], [5.0, 6.0]) is None


# ---- RSS ---------------------------------------------------------------------------------------


MB = mem.MB
SAMPLES: list[mem.Sample] = [(0.0, {"LLMServer": 500 * MB}), (1.0, {"LLMServer": 510 * MB}),
                            (2.0, {"LLMServer": 800 * MB}), (3.0, {"LLMServer": 700 * MB}),
                            (4.0, {"LLMServer": 590 * MB, "OpenAIIngress": 300 * MB})]


@pytest.mark.unit
def test_rss_at_takes_the_last_sample_at_or_before() -> None:
    assert mem.rss_at(SAMPLES, 2.5, "LLMServer") == 800 * MB
    assert mem.rss_at(SAMPLES, 99.0, "LLMServer") == 590 * MB
    assert mem.rss_at(SAMPLES, -1.0, "LLMServer") == 500 * MB  # before the first: the first
    assert mem.rss_at(SAMPLES, 1.0, "OpenAIIngress") == 300 * MB
    assert mem.rss_at(SAMPLES, 1.0, "ProxyActor") is None


@pytest.mark.unit
def test_rss_report() -> None:
    rep = mem.rss_report(SAMPLES, "LLMServer", 1.0, 2.0, 2.0, 0.2)
    assert rep["start_mb"] == 510.0 and rep["peak_mb"] == 800.0 and rep["after_mb"] == 590.0
    assert rep["within"] is True and rep["after_over_start"] == pytest.approx(590 / 510)
    assert mem.rss_report(SAMPLES, "LLMServer", 1.0, 2.0, 1.0, 0.2)["within"] is False  # 700/510
    missing = mem.rss_report(SAMPLES, "ProxyActor", 1.0, 2.0, 2.0, 0.2)
    assert missing["start_mb"] is None and missing["within"] is None


@pytest.mark.unit
@pytest.mark.parametrize(("cmd", "group"), [
    ("ray::ServeReplica:llm:LLMServer", "LLMServer"),
    ("ray::ServeReplica:llm:LLMServer.generate", "LLMServer"),
    ("ray::ServeReplica:llm:OpenAIIngress", "OpenAIIngress"),
    ("ray::ProxyActor", "ProxyActor"),
    ("python -c from replicas.serving.engine_process import child_main; child_main(9)", "LLMServer"),
    ("ray::ServeController.listen_for_change", None),
    ("python -m loadtests.load.overload --set x=LLMServer", None),
])
def test_group_of(cmd: str, group: str | None) -> None:
    assert mem.group_of(cmd) == group


# ---- workload ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_request_bodies() -> None:
    rng = np.random.default_rng(0)
    spec = workload.uniform_specs(rng, 3, "m", 10, 64)[0]
    body = json.loads(spec.payload)
    assert spec.path == "/v1/completions" and spec.stream
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 64
    assert len(body["prompt"].split()) == 10 and body["model"] == "m"
    kinds = set()
    for _ in range(200):
        s = workload.soak_spec(rng, "m", 0.35)
        b = json.loads(s.payload)
        kinds.add((s.path, s.stream))
        assert b["stream"] is s.stream and ("messages" in b) == (s.path == "/v1/chat/completions")
    assert len(kinds) == 4  # completions and chat, streaming and not


# ---- the engine's gauges and the target table ---------------------------------------------------


@pytest.mark.unit
def test_engine_gauges() -> None:
    text = "\n".join([
        "# TYPE ray_stallfree_kv_cache_usage_perc gauge",
        'ray_stallfree_kv_cache_usage_perc{deployment="LLMServer",replica="a"} 0.25',
        'ray_stallfree_kv_cache_usage_perc{deployment="LLMServer",replica="b"} 0.5',
        'ray_stallfree_num_requests_running{deployment="LLMServer",replica="a"} 2',
        'ray_stallfree_num_requests_running{deployment="LLMServer",replica="b"} 3',
        'ray_stallfree_num_requests_waiting{deployment="OpenAIIngress"} 9',
        "ray_other_metric 1"])
    assert gauges.engine_gauges(text) == {"kv_cache_usage_perc": 0.5, "num_requests_running": 5.0}
    assert gauges.engine_gauges("") == {}


CFG = {"timeout_s": 120.0, "reject_p99_s": 0.5, "tbt_factor": 1.5, "queue_deadline_s": 10.0,
       "rss_tolerance": 0.2, "recovery_target_s": 5.0, "rss_slope_mb_min": 1.0}


@pytest.mark.unit
def test_overload_targets_and_table() -> None:
    recs = ([rec(status=200, done=True, ttft_s=0.5, end_s=2.0, gaps=[0.05] * 10)] * 50
            + [rec(status=429, headers_s=0.02, retry_after=True, json_body=True, openai_body=True)] * 50)
    summary = stats.summarize(recs, 10.0)
    rss = {"LLMServer": mem.rss_report(SAMPLES, "LLMServer", 1.0, 2.0, 2.0, 0.2),
           "ProxyActor": mem.rss_report(SAMPLES, "ProxyActor", 1.0, 2.0, 2.0, 0.2)}
    rows = report.overload_targets(summary, 0.04, 1.5, rss, CFG)
    status = {r["target"].split(" ")[0] + " " + r["target"].split(" ")[1]: r["status"] for r in rows}
    assert all(r["status"] in ("PASS", "n/a") for r in rows), rows
    assert status["ProxyActor RSS"] == "n/a" and status["normal service"] == "PASS"
    worse = report.overload_targets(summary, 0.02, None, rss, CFG)  # 50 ms > 1.5 x 20 ms
    miss = {r["target"] for r in worse if r["status"] == "MISS"}
    assert any("TBT" in t for t in miss) and any("normal service" in t for t in miss)
    table = report.format_targets(rows)
    assert table.splitlines()[0].startswith("target") and table.count("PASS") >= 8


@pytest.mark.unit
def test_overload_targets_without_429s_are_not_applicable() -> None:
    summary = stats.summarize([rec(status=200, done=True, ttft_s=0.5, end_s=2.0)], 1.0)
    rows = {r["target"]: r for r in report.overload_targets(summary, None, None, {}, CFG)}
    assert rows["429 p99 latency < 500 ms"]["status"] == "n/a"
    assert next(r for t, r in rows.items() if "TBT" in t)["status"] == "n/a"


@pytest.mark.unit
def test_rss_slopes_separate_a_cache_filling_early_from_a_leak() -> None:
    mb = mem.MB
    # The engine grows 2 MB/min for 10 min, then holds; the ingress grows 0.5 MB/min throughout.
    samples = [(60.0 * m, {"LLMServer": int((500 + 2 * min(m, 10)) * mb), "OpenAIIngress": int((100 + m / 2) * mb)})
               for m in range(31)]
    whole, late = mem.rss_slopes(samples, 0.0, 1800.0), mem.rss_slopes(samples, 900.0, 1800.0)
    assert whole["LLMServer"] > 0.5 and late["LLMServer"] == pytest.approx(0.0, abs=1e-6)
    assert whole["OpenAIIngress"] == pytest.approx(0.5, rel=1e-3)
    assert late["OpenAIIngress"] == pytest.approx(0.5, rel=1e-3)
    assert whole["ProxyActor"] is None


@pytest.mark.unit
def test_soak_targets() -> None:
    sk = {"summary": stats.summarize([rec(status=200, done=True)] * 3 + [rec(status=500)], 60.0),
          "rss_slope_mb_per_min": {"LLMServer": 1.1, "OpenAIIngress": 3.0, "ProxyActor": None},
          "rss_late_slope_mb_per_min": {"LLMServer": 0.2, "OpenAIIngress": 3.0, "ProxyActor": None},
          "engine": {"measured": True, "kv_cache_usage_perc": 0.0, "num_requests_running": 0.0},
          "health": 200}
    rows = {r["target"]: r["status"] for r in report.soak_targets(sk, CFG)}
    assert rows["0 errors (anything but a complete 200)"] == "MISS"
    assert rows["LLMServer RSS slope, 2nd half <= 1 MB/min"] == "PASS"  # grew early, then level: not a leak
    assert rows["OpenAIIngress RSS slope, 2nd half <= 1 MB/min"] == "MISS"
    assert rows["ProxyActor RSS slope, 2nd half <= 1 MB/min"] == "n/a"
    assert rows["KV cache usage 0 after quiet"] == "PASS"
    assert rows["0 requests waiting after quiet"] == "n/a"
    assert rows["healthy after the soak"] == "PASS"


@pytest.mark.unit
def test_quick_fills_only_unset_options() -> None:
    args = cli.parse_args(["--quick", "--duration-s", "7"])
    assert args.duration_s == 7.0 and args.step_s == 3.0 and args.max_steps == 2 and args.baseline_s == 5.0
    full = cli.parse_args([])
    assert full.duration_s == 60.0 and full.soak_minutes == 30.0 and full.factor == 10.0
    assert full.baseline_s == full.duration_s  # the baseline's steady state as long as the overload
    assert cli.parse_args(["--baseline-s", "0"]).baseline_s == 0.0


@pytest.mark.unit
def test_the_steady_phase_becomes_the_baseline_and_the_step_is_kept() -> None:
    found = {"sustainable_req_s": 2.0, "found": True, "baseline_tbt_p99_s": 0.07, "baseline_ttft_p99_s": 0.13}
    st = {"rate": 2.0, "seconds": 60.0, "pass": True, "tbt_p99_s": 0.11, "ttft_p99_s": 0.2,
          "tbt_arrival_p99_s": 0.09}
    out = phases.with_steady_baseline(found, st)
    assert (out["baseline_tbt_p99_s"], out["baseline_ttft_p99_s"]) == (0.11, 0.2)
    assert out["baseline_tbt_arrival_p99_s"] == 0.09
    assert (out["search_tbt_p99_s"], out["search_ttft_p99_s"]) == (0.07, 0.13)
    assert out["steady"] is st and out["sustainable_req_s"] == 2.0
    summary = stats.summarize([rec(status=200, done=True, ttft_s=0.5, end_s=2.0, gaps=[0.15] * 10)], 1.0)
    rows = {r["target"]: r["status"] for r in report.overload_targets(summary, out["baseline_tbt_p99_s"], None,
                                                                  {}, CFG)}
    assert rows["accepted p99 TBT <= 1.5 x sustainable (110 ms)"] == "PASS"  # 150 ms, held to the steady 110
    rows = {r["target"]: r["status"] for r in report.overload_targets(summary, found["baseline_tbt_p99_s"], None,
                                                                  {}, CFG)}
    assert rows["accepted p99 TBT <= 1.5 x sustainable (70 ms)"] == "MISS"  # against the step's 70
    # On arrival (kernel receive times), judged against the steady phase's on arrival.
    summary = stats.summarize([rec(status=200, done=True, ttft_s=0.5, end_s=2.0, gaps=[0.15] * 10,
                                   arrival_gaps=[0.14] * 9 + [0.05])], 1.0)
    rows = {r["target"]: r for r in report.overload_targets(summary, 0.11, None, {}, CFG, None,
                                                             out["baseline_tbt_arrival_p99_s"])}
    arrival = rows["accepted p99 TBT on arrival <= 1.5 x sustainable's (90 ms)"]
    assert (arrival["measured"], arrival["status"]) == ("140 ms", "MISS")  # 140 > 1.5 x 90
    assert not any("on arrival" in t for t in {r["target"] for r in report.overload_targets(summary, 0.11, None,
                                                                                             {}, CFG)})


# ---- the load generator's own side ----------------------------------------------------------


@pytest.mark.unit
def test_door_probe_times_each_answer_on_a_new_connection() -> None:
    """A local server answering 429 then 200: one record per scheduled request, in order, each
    with its status and a latency; a closed port is a None status, not a crash."""
    import http.server
    import socketserver
    import threading
    import time

    statuses = iter([429, 200, 429])
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(next(statuses))
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Handler) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        out = sse_client.door_probe(url, b'{"x": 1}', time.time(), 0.1, 0.05, 10.0)
        srv.shutdown()
    assert [(t, s) for t, s, _ in out] == [(0.0, 429), (0.05, 200), (0.1, 429)]
    assert all(lat > 0 for _, _, lat in out) and bodies == [b'{"x": 1}'] * 3
    closed = sse_client.door_probe(url, b"{}", time.time(), 0.0, 1.0, 5.0)  # the server is gone
    assert [status for _, status, _ in closed] == [None]
    assert sse_client.door_probe(url, b"{}", 0.0, -1.0, 1.0, 1.0) == []  # the warm-up call sends nothing


@pytest.mark.unit
def test_probe_summary() -> None:
    samples = [(0.0, 429, 0.01), (0.25, 429, 0.03), (0.5, 200, 2.0), (0.75, None, 5.0)]
    s = stats.probe_summary(samples)
    assert s["sent"] == 4 and s["n429"] == 2
    assert s["status_codes"] == {"429": 2, "200": 1, "None": 1}
    assert s["reject_p50_s"] == 0.01 and s["reject_p99_s"] == 0.03 and s["reject_max_s"] == 0.03


@pytest.mark.unit
def test_the_door_probe_row_judges_its_own_429s() -> None:
    summary = stats.summarize([rec(status=429, headers_s=2.0, retry_after=True, json_body=True,
                                openai_body=True)] * 10, 1.0)
    probe = stats.probe_summary([(0.0, 429, 0.02)] * 10)
    rows = {r["target"]: r["status"] for r in report.overload_targets(summary, None, None, {}, CFG, probe)}
    assert rows["429 p99 latency < 500 ms"] == "MISS"
    assert rows["429 p99 latency < 500 ms (door probe)"] == "PASS"
    none = stats.probe_summary([(0.0, 200, 0.02)])
    rows = {r["target"]: r["status"] for r in report.overload_targets(summary, None, None, {}, CFG, none)}
    assert rows["429 p99 latency < 500 ms (door probe)"] == "n/a"


@pytest.mark.process
def test_raise_priority_sets_every_thread_and_reports_it() -> None:
    """In a child process (the test run keeps its own priority): a higher niceness is always
    allowed, and the threads started before the call get it too."""
    import subprocess
    import sys

    code = ("import os, threading, time\n"
            "from loadtests.load.overload.sse_client import raise_priority\n"
            "ev = threading.Event(); seen = []\n"
            "def f():\n    ev.wait(); seen.append(os.getpriority(os.PRIO_PROCESS, 0))\n"
            "t = threading.Thread(target=f); t.start()\n"
            "print(raise_priority(7)); ev.set(); t.join(); print(seen[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "7"]


@pytest.mark.unit
def test_the_proxy_doors_own_messages_name_their_rule() -> None:
    """Each refusal the proxy door makes, as the middleware words it, is attributed to its rule
    (the words in REFUSERS must follow app/proxy_door.py's messages)."""
    import asyncio

    from app.proxy_door import Pending, PendingMiddleware

    class Clock:
        t = 100.0

        def __call__(self) -> float:
            return self.t

    async def refusal(pending: Pending) -> str:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def never(*_: object) -> None:
            raise AssertionError("forwarded")

        await PendingMiddleware(never, pending)({"type": "http", "path": "/v1/completions", "headers": []},
                                                receive, send)
        return json.loads(sent[-1]["body"])["error"]["message"]

    def door(**kw: object) -> tuple[Pending, Clock]:
        clock = Clock()
        return Pending(2.0, clock, min_pending=4, gap_target_s=0.25, min_gaps=20, **kw), clock

    queueing, clock = door()
    for _ in range(5):
        queueing.start()
    clock.t += 3.0
    slow, clock = door()
    for _ in range(30):
        slow.gap(1.0)
    capped, _ = door(max_cap=8, min_cap=1)
    for _ in range(8):
        capped.answered(capped.start())
    held, _ = door()
    held.saw_429(1)
    got = {name: records.refuser(asyncio.run(refusal(p)))
           for name, p in (("queueing", queueing), ("slow", slow), ("cap", capped), ("hold", held))}
    assert got == {"queueing": "proxy: queueing", "slow": "proxy: slow streams",
                   "cap": "proxy: stream cap", "hold": "proxy: hold"}


# ---- workloads, the run table, the flags ------------------------------------------------------


@pytest.mark.unit
def test_the_uniform_workload_is_todays_requests_and_short_output_adds_long_prompts() -> None:
    uniform = workload.load_specs("uniform", np.random.default_rng(3), 50, "m", 40, 64, 0.5)
    assert uniform == workload.uniform_specs(np.random.default_rng(3), 50, "m", 40, 64)  # same seed, same bodies
    short = workload.load_specs("short-output", np.random.default_rng(3), 400, "m", 40, 96, 0.5)
    bodies = [json.loads(s.payload) for s in short]
    assert all(b["max_tokens"] == 96 and b["stream"] and b["ignore_eos"] for b in bodies)
    long = [len(b["prompt"].split()) for s, b in zip(short, bodies) if s.kind == "cmpl-long"]
    assert 20 < len(long) < 60  # a tenth of 400
    assert all(512 <= n <= 768 for n in long)  # 1,024-1,536 tokens at 0.5 words a token
    assert {len(b["prompt"].split()) for s, b in zip(short, bodies) if s.kind == "cmpl"} == {40}
    with pytest.raises(ValueError, match="workload"):
        workload.load_specs("long", np.random.default_rng(0), 1, "m", 1, 1, 1.0)


@pytest.mark.unit
def test_the_workload_sets_the_lengths_the_command_line_leaves_open() -> None:
    args = cli.parse_args([])
    assert (args.start, args.workload, args.prompt_tokens, args.max_tokens) == ("make", "uniform", 64, 64)
    short = cli.parse_args(["--workload", "short-output", "--start", "cluster"])
    assert (short.start, short.prompt_tokens, short.max_tokens) == ("cluster", 128, 96)
    assert cli.parse_args(["--workload", "short-output", "--max-tokens", "32"]).max_tokens == 32
    assert cli.parse_args(["--model", "embedded:tiny", "--set", "num_cpus=1"]).sets == ["num_cpus=1",
                                                                                         "model=embedded:tiny"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--start", "local"])  # the launcher is for the other benchmarks


@pytest.mark.unit
def test_the_run_row_sets_each_phase_beside_the_sustainable_rate() -> None:
    recs = ([rec(status=200, done=True, ttft_s=0.4, end_s=2.0, gaps=[0.3], arrival_gaps=[0.25],
                 send_lag_s=0.01)] * 8
            + [rec(status=429, headers_s=0.05, send_lag_s=0.2), rec(status=503, headers_s=0.1, send_lag_s=0.01),
               rec(status=200, done=False, ttft_s=0.5, end_s=3.0, send_lag_s=0.01)])
    s = stats.summarize(recs, 2.0)
    assert (s["send_lag_p50_s"], s["send_lag_p99_s"], s["send_lag_max_s"]) == (0.01, 0.2, 0.2)
    row = report.run_row("overload x10", s, {"baseline_tbt_p99_s": 0.1, "baseline_ttft_p99_s": 0.2,
                                             "baseline_tbt_arrival_p99_s": 0.08})
    assert row == {"run": "overload x10", "offered_req_s": 5.5, "sent": 11, "n429": 1,
                   "reject_p50_s": 0.05, "reject_p99_s": 0.05, "ttft_p99_s": 0.5, "sustainable_ttft_p99_s": 0.2,
                   "tbt_p99_s": 0.3, "sustainable_tbt_p99_s": 0.1, "tbt_arrival_p99_s": 0.25,
                   "sustainable_tbt_arrival_p99_s": 0.08, "n5xx": 1, "cut": 1,
                   "send_lag_p50_s": 0.01, "send_lag_p99_s": 0.2}
    table = report.format_runs([row, report.run_row("steady", s, None)]).splitlines()
    assert table[0].startswith("run") and "lag p99" in table[0]
    assert table[1].split() == ["overload", "x10", "5.50", "11", "1", "50", "50", "500", "200", "300", "100",
                                "250", "80", "1", "1", "10", "200"]
    assert table[2].split()[6:8] == ["500", "-"]  # no sustainable rate to compare with


# ---- one short run against a real server -------------------------------------------------------


@pytest.mark.process
def test_a_short_overload_run_against_serve_run(tmp_path) -> None:  # noqa: ANN001
    """`--start serve-run`: a server started by plain `serve run` from serve_config.yaml, with two
    engine replicas and HAProxy's weights on, a few seconds of the short-output workload at 3x a given rate; the JSON names
    the mode, what /health said before and after (HAProxy's weights set from the replicas' token
    load, without a failure), and one run row per phase; every process the run started has ended."""
    out = tmp_path / "overload.json"
    code = cli.main(["--start", "serve-run", "--model", "embedded:tiny", "--set", "num_cpus=0.5", "--set", "num_replicas=2",
                     "--set", "ingress_num_cpus=0.1", "--set", "engine.kv_cache_memory_bytes=16777216",
                     "--workload", "short-output", "--rate", "2", "--factor", "3", "--step-s", "2",
                     "--duration-s", "3", "--baseline-s", "0", "--recovery-s", "1", "--rss-after-s", "0",
                     "--client-nice", "0", "--timeout-s", "120", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["start"] == data["server"]["start"] == "serve-run" and data["workload"] == "short-output"
    assert data["server"]["health"]["proxy_door"]["enabled"] is True  # serve_config.yaml brings the door
    assert isinstance(data["server"]["health"]["niceness"], int)
    weights = data["server"]["health_after"]["http_path"]["weights"]  # one replica's: the pusher's or the other's
    assert weights["interval_ms"] == 250 and weights["last_error"] is None and weights["pushing"] in (True, False)
    assert data["server"]["health_after"]["gc"]["threshold"][0] == startup_gc.GEN0_THRESHOLD
    assert data["server"]["app_args"]["model"] == "embedded:tiny"
    assert [r["run"] for r in data["runs"]] == ["sustainable", "overload x3"]
    ov = data["overload"]["summary"]
    assert ov["sent"] == sum(ov["counts"].values()) == data["runs"][1]["sent"] > 0
    assert data["runs"][1]["n5xx"] == ov["counts"]["5xx"] and data["runs"][1]["cut"] == ov["counts"]["cut"]
    if ov["num_gaps"]:  # gaps timed on arrival too, never longer in sum than as read
        assert ov["tbt_arrival_p50_s"] is not None and ov["tbt_arrival_p99_s"] is not None
    used = data["overload"]["cpu_core_s"]  # the overload's CPU by role: the engine worked, so did we
    assert used["engine"] > 0 and used["client"] > 0 and set(used) <= {*cpu.ROLES, cpu.ENGINE_LOOP, cpu.CLIENT}
    assert data["warm_up"]["max_tokens"] == 96
    pids = {pid for group in data["rss"]["pids"].values() for pid in group}
    assert pids and not [pid for pid in pids if not procs.ended(pid)]


@pytest.mark.unit
def test_a_measured_phase_runs_without_the_clients_own_collections() -> None:
    """`quiet_gc`: inside, garbage that would trigger collections piles up without one running
    (a full collection stalled the client's loop 0.3 s mid-overload); an explicit collect is
    counted with its pause; after, the collector is on again and nothing stays frozen."""
    import gc

    assert gc.isenabled()
    with phases.quiet_gc() as report:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        cycles = []
        for _ in range(50_000):  # thresholds (700 allocations) passed many times over
            a: list = []
            a.append(a)
            cycles.append(a)
        del cycles
        gc.collect(0)
    assert report["collections"] == {"0": 1, "1": 0, "2": 0} and report["max_s"] >= 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
