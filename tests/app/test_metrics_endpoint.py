"""Prometheus metrics on Ray's real export port count exactly what the requests did."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

PREFIX = "ray_stallfree_"
APP = "metrics"
# An app of its own: its series start at zero, so the counts need no baseline. (A scrape of the
# shared app could lag the tests before this one by an export period, and miscount.)
METRICS_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-metrics", "engine": {"tbt_slo_ms": 5_000},
                    "num_cpus": 0.5, "ingress_num_cpus": 0.1}


@pytest.fixture(scope="module")
def metrics_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app(APP, METRICS_APP_ARGS) as url:
        yield url


def test_metrics_are_exported_with_names_labels_and_counts(metrics_url, ray_serve, wait_until):
    model = METRICS_APP_ARGS["served_model_name"]
    n, max_tokens = 3, 5
    shared = list(range(300, 332))  # two full KV blocks: the 2nd and 3rd prompts find them cached
    for i in range(n):
        r = httpx.post(f"{metrics_url}/v1/completions", timeout=60, json={
            "model": model, "prompt": shared + [400 + i], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    bad = httpx.post(f"{metrics_url}/v1/completions", timeout=60,
                     json={"model": model, "prompt": "", "max_tokens": 5})
    assert bad.status_code == 400

    def moved():  # noqa: ANN202
        """A scrape once both the replica's and the ingress's metrics have been exported
        (separate processes, each every ~1 s), and the replica's histograms too (counted in the
        replica, exported at most every few seconds), else None."""
        samples = ray_serve.scrape()
        done = samples.total(PREFIX + "request_success_total", application=APP)
        answered = samples.total(PREFIX + "http_responses_total", application=APP)
        gaps = samples.total(PREFIX + "inter_token_latency_seconds_count", application=APP)
        firsts = samples.total(PREFIX + "time_to_first_token_seconds_count", application=APP)
        return samples if done >= n and answered >= n + 1 and gaps >= n * (max_tokens - 1) and firsts >= n else None

    after = wait_until(moved, interval_s=1.0, what="metrics exported")

    def count(name: str, **labels: str) -> float:
        return after.total(name, application=APP, **labels)

    assert count(PREFIX + "request_success_total", finished_reason="length") == n
    assert count(PREFIX + "http_responses_total", status_code="200") == n
    assert count(PREFIX + "http_responses_total", status_code="400") == 1
    routes = {dict(ls)["route"] for (name, ls) in after.samples
              if name == PREFIX + "http_responses_total" and ("application", APP) in ls}
    assert routes == {f"/{APP}/v1/completions"}, routes  # the path as the client sent it
    assert count(PREFIX + "time_to_first_token_seconds_count") == n
    assert count(PREFIX + "e2e_request_latency_seconds_count") == n
    assert count(PREFIX + "request_queue_time_seconds_count") == n
    assert count(PREFIX + "inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert count(PREFIX + "generation_tokens_total") == n * max_tokens
    assert count(PREFIX + "prefix_cache_queries_total") == n * 33
    assert count(PREFIX + "prefix_cache_hits_total") == (n - 1) * 32
    assert count(PREFIX + "prompt_tokens_total") == 33 + (n - 1) * 1  # only the uncached tokens ran
    assert count(PREFIX + "tbt_slo_tokens_total", within_slo="true") == n * (max_tokens - 1)
    # Serve's own tags ride along with ours.
    [labels] = {ls for (name, ls) in after.samples if name == PREFIX + "request_success_total"
                and {("finished_reason", "length"), ("application", APP)} <= ls}
    keys = dict(labels)
    assert keys["model_name"] == METRICS_APP_ARGS["model"] and keys["deployment"] == "LLMServer"
    assert "replica" in keys and keys["application"] == APP
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "token_load",
                  "prefix_cache_blocks"):
        assert any(name == PREFIX + gauge for name, _ in after.samples), gauge
    assert any(name == PREFIX + "iteration_duration_seconds_bucket" for name, _ in after.samples)


def test_the_http_port_serves_this_applications_series(metrics_url, ray_serve, wait_until):
    """GET /metrics on the app's own HTTP port: the same series Ray exports for this application
    (the replica's and the ingress's), no other application's, in Prometheus text."""
    def agree():  # noqa: ANN202 - both views once the export has caught up
        r = httpx.get(f"{metrics_url}/metrics", timeout=60)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        ray_view = ray_serve.scrape()
        ours = type(ray_view).parse(r.text)  # the conftest's parser of Prometheus text
        name = PREFIX + "request_success_total"
        if ours.total(name) and ours.total(name) == ray_view.total(name, application=APP):
            return r.text, ours
        return None

    text, ours = wait_until(agree, interval_s=1.0, what="/metrics agrees with Ray's export")
    assert ours.total(PREFIX + "request_success_total", finished_reason="length") == 3  # the test above
    assert all(("application", APP) in ls for _, ls in ours.samples)
    assert f"# TYPE {PREFIX}time_to_first_token_seconds histogram" in text
    assert any(name == PREFIX + "http_responses_total" for name, _ in ours.samples)
