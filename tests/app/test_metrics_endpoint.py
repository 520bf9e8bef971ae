"""Prometheus metrics on Ray's real export port move by exactly what the requests did."""

from __future__ import annotations

import re
import time

import httpx

PREFIX = "ray_stallfree_"


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Parse the text exposition: {(name, labels): value}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$', line)
        if not m or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_metrics_are_exported_with_names_labels_and_counts(serve_app, ray_serve):
    port = ray_serve.metrics_port
    before = scrape(port)
    n, max_tokens = 3, 5
    for i in range(n):
        r = httpx.post(f"{serve_app.base_url}/v1/completions", timeout=60, json={
            "model": serve_app.args.name, "prompt": f"metrics test {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    bad = httpx.post(f"{serve_app.base_url}/v1/completions", timeout=60,
                     json={"model": serve_app.args.name, "prompt": "", "max_tokens": 5})
    assert bad.status_code == 400

    def moved(samples: dict) -> bool:
        """Both the replica's and the ingress's metrics have been exported (separate processes)."""
        done = total(samples, PREFIX + "request_success_total", finished_reason="length")
        answered = total(samples, PREFIX + "http_responses_total", route="/v1/completions")
        return (done - total(before, PREFIX + "request_success_total", finished_reason="length") >= n
                and answered - total(before, PREFIX + "http_responses_total", route="/v1/completions") >= n + 1)

    deadline = time.monotonic() + 45
    after = scrape(port)
    while not moved(after) and time.monotonic() < deadline:
        time.sleep(1.0)
        after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta(PREFIX + "request_success_total", finished_reason="length") == n
    assert delta(PREFIX + "http_responses_total", route="/v1/completions", status_code="200") == n
    assert delta(PREFIX + "http_responses_total", route="/v1/completions", status_code="400") == 1
    assert delta(PREFIX + "time_to_first_token_seconds_count") == n
    assert delta(PREFIX + "e2e_request_latency_seconds_count") == n
    assert delta(PREFIX + "request_queue_time_seconds_count") == n
    assert delta(PREFIX + "inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert delta(PREFIX + "generation_tokens_total") == n * max_tokens
    assert delta(PREFIX + "tbt_slo_tokens_total", within_slo="true") == n * (max_tokens - 1)
    # Serve's own tags ride along with ours.
    [labels] = {ls for (name, ls) in after if name == PREFIX + "request_success_total"
                and ("finished_reason", "length") in ls}
    keys = dict(labels)
    assert keys["model_name"] == serve_app.args.model and keys["deployment"] == "LLMServer"
    assert "replica" in keys and keys["application"] == "default"
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "token_load"):
        assert any(name == PREFIX + gauge for name, _ in after), gauge
    assert any(name == PREFIX + "iteration_duration_seconds_bucket" for name, _ in after)
