"""The door (`app.proxy_door`, installed through RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH) runs
wherever Serve serves HTTP: over its in-flight limit it answers 429 in OpenAI's shape with
Retry-After, and serves again once the request in flight ends; and nothing users rely on is lost
on the way (streams with usage, /metrics on the same port, a client leaving frees its KV).

The server runs in a subprocess as a user starts it: `serve run` on serve_config.yaml, whose
controller_options set the callback (tests/support/server.py), on a Ray instance of its own, with
the door's limit pinned to one generation request. Twice: as serve_config.yaml ships (Ray's
HAProxy in front, the door in the engine replica's own HTTP server), and with its HAProxy switch
taken out (the door in Serve's Python proxy).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from loadtests.harness import metrics_text
from tests.support.server import serve_run

pytestmark = pytest.mark.process

FINISHED = "ray_stallfree_request_success_total"  # by finished_reason, from the replica
LEFT_MID_STREAM: list[object] = []  # the streams this module's clients closed early (on the server at hand)
SERVER_ARGS = {"model": "embedded:tiny", "engine": {"max_num_seqs": 8, "max_batch_total_tokens": 4096},
               "num_cpus": 1, "ingress_num_cpus": 0.1, "replica": {"stream_interval_ms": 0},
               "proxy_door": {"max_requests": 1, "min_requests": 1},
               "ingress_in_replica": True}  # as serve_config.yaml ships: the engine replica serves HTTP
# /health's http_path on each path, once it is the one serving (in HAProxy mode Ray's fallback
# Python proxy serves until HAProxy has seen the replica's own server healthy twice, 5 s apart).
PATHS = {"haproxy": {"proxy": "haproxy", "door": "ingress"}, "serve": {"proxy": "serve", "door": "proxy"}}


def path_of(health: dict) -> dict:
    """/health's proxy and door (its `http_path` says more: HAProxy's weights, none with one replica)."""
    assert health["http_path"].get("weights") is None  # one replica: nothing for HAProxy to weigh
    return {k: health["http_path"][k] for k in ("proxy", "door")}


@pytest.fixture(scope="module", params=list(PATHS))
def door_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                wait_until) -> Iterator[str]:  # noqa: ANN001
    log = tmp_path_factory.mktemp("server") / "server.log"
    LEFT_MID_STREAM.clear()
    with serve_run(SERVER_ARGS, log, ha_proxy=request.param == "haproxy") as url:
        # The app publishes its door settings; the door reads them within REFRESH_S, and
        # /health shows the settings in force and the path that serves.
        def ready() -> bool:
            health = httpx.get(f"{url}/health", timeout=30).json()
            return (health["proxy_door"] or {}).get("max_requests") == 1 and path_of(health) == PATHS[request.param]
        wait_until(ready, timeout_s=90, what=f"the door on the app's settings, on {request.param}'s path")
        yield url


def test_the_proxy_refuses_over_its_limit_and_serves_after(door_server: str, wait_until) -> None:  # noqa: ANN001
    small = {"prompt": [5, 6, 7, 8], "max_tokens": 2}
    with httpx.Client(base_url=door_server, timeout=60) as client:
        # Seconds of tokens: in flight at the proxy while the next request comes.
        long_stream = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=long_stream) as held:
            assert held.status_code == 200
            LEFT_MID_STREAM.append(held)  # closed below, long before its last token: an abort
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            refused = client.post("/v1/completions", json=small)
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "rate_limit_exceeded"
            assert "its limit is 1" in error["message"]
            assert client.get("/health").status_code == 200  # only generation routes are limited
        # The held stream is gone (closed by us): the proxy admits again, a request at a time (the
        # last one counts until the proxy has finished with it, a moment after its client has it).
        wait_until(lambda: client.post("/v1/completions", json=small).status_code == 200,
                   timeout_s=60, what="a request admitted once the held stream ended")
        chat = wait_until(lambda: (r := client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).status_code == 200 and r,
            timeout_s=60, what="a chat request admitted")
        assert json.loads(chat.text)["choices"]


def test_serve_config_yaml_serves_with_its_door(door_server: str, wait_until) -> None:  # noqa: ANN001
    """serve_config.yaml's HTTP path (HAProxy, or Serve's proxy), the door where it runs; a stream
    with usage and /metrics on the same port."""
    with httpx.Client(base_url=door_server, timeout=60) as client:
        assert path_of(client.get("/health").json()) in PATHS.values()
        assert client.get("/metrics").status_code == 200  # the same port
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = wait_until(lambda: _events(client, body), timeout_s=60, what="a stream admitted")
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 5


def test_a_client_leaving_mid_stream_aborts_its_request(door_server: str, wait_until) -> None:  # noqa: ANN001
    """A disconnect reaches the engine: the replica counts the request
    aborted (its KV blocks freed with it), not run to its 1500 tokens, and the door's slot frees."""
    long_stream = {"prompt": [5, 6, 7, 8], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=door_server, timeout=60) as client:
        # The previous test's last request may hold the door's one slot a moment longer (the
        # proxy counts it until it has finished with it): open the stream once the door admits.
        def admitted() -> httpx.Response | None:
            response = client.send(client.build_request("POST", "/v1/completions", json=long_stream), stream=True)
            if response.status_code == 200:
                return response
            response.close()
            return None

        held = wait_until(admitted, timeout_s=60, what="the long stream admitted")
        try:
            LEFT_MID_STREAM.append(held)
            first = next(line for line in held.iter_lines() if line)
        finally:
            held.close()
        assert first.startswith("data: ")  # it streamed before the client left
        # Every stream this module's clients left is counted aborted, once exported.
        aborted = wait_until(lambda: (n := _finished(client, "abort")) >= len(LEFT_MID_STREAM) and n,
                             timeout_s=120, what="the replica's aborts exported")
        assert aborted == len(LEFT_MID_STREAM)
        small = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True}  # random weights may sample EOS
        done = wait_until(lambda: (r := client.post("/v1/completions", json=small)).status_code == 200 and r,
                          timeout_s=60, what="the slot free once the client left")
        assert done.json()["usage"]["completion_tokens"] == 2


def _finished(client: httpx.Client, reason: str) -> float:
    """Requests the replicas finished for `reason`, from /metrics."""
    text = client.get("/metrics").text
    return sum(value for name, labels, value in metrics_text.samples(text, (FINISHED,))
               if labels.get("finished_reason") == reason)


def _events(client: httpx.Client, body: dict) -> list[str] | None:
    with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return None
        return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
