"""`ingress_in_replica: true`: the engine replicas serve the OpenAI API themselves, one Serve
deployment and no ingress: the same answers as the default two-deployment app, refusals in
OpenAI's shape, a client that leaves frees its KV. This app runs its engine loop in a process of
its own too (`replica.engine_process`; test_proxy_door_live.py's in-replica app on a thread):
its metrics reach Ray's export from the replica."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

APP_ARGS = {"model": "embedded:tiny", "engine": {"max_num_seqs": 8, "max_batch_total_tokens": 2048},
            "num_cpus": 1, "ingress_in_replica": True, "replica": {"engine_process": True}}
NAME = "inreplica"


@pytest.fixture(scope="module")
def merged_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app(NAME, APP_ARGS) as url:
        yield url


def test_one_deployment_serves_the_api(merged_url: str) -> None:
    from ray import serve

    deployments = serve.status().applications[NAME].deployments
    assert set(deployments) == {"LLMServer"}
    health = httpx.get(f"{merged_url}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["runner"]["path"]  # the engine's own status, asked in process
    models = httpx.get(f"{merged_url}/v1/models", timeout=60).json()
    assert models["data"][0]["max_model_len"] > 0


def test_the_same_answers_as_through_an_ingress(merged_url: str, client: httpx.Client) -> None:
    body = {"model": "embedded-tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    want = client.post("/v1/completions", json=body).json()
    got = httpx.post(f"{merged_url}/v1/completions", json=body, timeout=120).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
    with httpx.stream("POST", f"{merged_url}/v1/completions", timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want["choices"][0]["text"]
    assert events[-1]["usage"] == want["usage"]
    chat = {"model": "embedded-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 0}
    assert (httpx.post(f"{merged_url}/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]
            == client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"])


def test_bad_requests_get_openai_errors(merged_url: str) -> None:
    r = httpx.post(f"{merged_url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{merged_url}/v1/completions", json={"prompt": "x" * 20000, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_a_client_that_leaves_frees_its_kv(merged_url: str, wait_until) -> None:  # noqa: ANN001
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=NAME)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{merged_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert handle.load.remote().result().num_running == 1
    wait_until(lambda: handle.load.remote().result().num_running == 0, what="the stream's request aborted")
    assert handle.load.remote().result().running_tokens == 0


def test_the_engine_process_serves_and_its_metrics_are_exported(merged_url: str, ray_serve, wait_until) -> None:  # noqa: ANN001
    from loadtests.harness import procs

    engines = [pid for pid, (_, cmd, _, _) in procs.table().items() if "replicas.serving.engine_process" in cmd]
    assert engines, "no engine process runs beside the replica"
    r = httpx.post(f"{merged_url}/v1/completions", timeout=120,
                   json={"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16

    def exported():  # noqa: ANN202 - recorded in the engine's process, replayed in the replica's
        samples = ray_serve.scrape()
        tokens = samples.total("ray_stallfree_generation_tokens_total", application=NAME)
        ttft = samples.total("ray_stallfree_time_to_first_token_seconds_count", application=NAME)
        return (tokens, ttft) if tokens >= 16 and ttft >= 1 else None

    wait_until(exported, interval_s=1.0, what="the engine process's metrics exported")


def test_its_demand_reaches_the_controller_on_its_own(merged_url: str, wait_until) -> None:  # noqa: ANN001
    """Its door reads no fleet view (the replica's own queue decides), so no read carries its
    demand counters: they go to the controller once a second on their own, and the autoscaler
    sees the demand it served."""
    import ray

    from autoscale.controller import get_or_create_controller
    from autoscale.keys import deployment_key_of

    controller = get_or_create_controller()  # the app's (AppArgs' default name)
    prefix = deployment_key_of(NAME, "LLMServer") + "#"

    def served_seen() -> bool:
        # one more request each time: increments over the counters' first (baseline) report
        assert httpx.post(f"{merged_url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2},
                          timeout=120).status_code == 200
        ids = [r for r in ray.get(controller.replica_ids.remote()) if r.startswith(prefix)]
        return bool(ids) and ray.get(controller.snapshot.remote(ids)).served_tps > 0

    wait_until(served_seen, interval_s=0.5, what="the in-replica app's served demand at the controller")
