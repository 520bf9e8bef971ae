"""The replica's waiting queue is bounded by tokens: past `max_queued_tokens` a request gets
429 with Retry-After instead of queueing, while an empty queue still takes any valid prompt;
a client that stops sending its body is answered 408."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

CAP = 64  # max_queued_tokens of the app below
QUEUE_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-queue", 
                  "engine": {"max_num_seqs": 1},  # no queue deadline: it waits as long as the test needs
                  "replica": {"max_queued_tokens": CAP}, "num_cpus": 1, "ingress_num_cpus": 0.1,
                  "body_timeout_s": 2.0}


@pytest.fixture(scope="module")
def queue_app_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app("queuecap", QUEUE_APP_ARGS) as url:
        yield url


async def test_queue_cap_answers_429_with_retry_after(queue_app_url: str, await_until) -> None:  # noqa: ANN001
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="queuecap")
    long = {"prompt": [5] * 8, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    waiting = {"prompt": [5] * 40, "max_tokens": 1}
    async with httpx.AsyncClient(base_url=queue_app_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()  # held, not left: leaving it would disconnect
            while not (await anext(lines)).startswith("data: "):
                pass  # wait for its first token: it runs, and holds the only sequence slot
            queued = asyncio.create_task(client.post("/v1/completions", json=waiting))

            async def queued_40() -> bool:
                return (await handle.load.remote()).waiting_tokens == 40

            await await_until(queued_40, interval_s=0.02, what="40 prompt tokens queued")
            refused = await client.post("/v1/completions", json={"prompt": [5] * 40})
        # The long stream was closed: the waiting request runs, and the queue drains.
        assert (await queued).status_code == 200
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert f"bound of {CAP}" in error["message"] and "40" in error["message"]
        ok = await client.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 2})
        assert ok.status_code == 200

        # The autoscaler sees the refused demand: the ingress counted the 429 (40 prompt tokens,
        # no max_tokens) and sends its counters along with its admission fetches.
        from autoscale.controller import get_or_create_controller
        from autoscale.keys import deployment_key_of

        controller = get_or_create_controller()  # the app's (AppArgs' default name)
        prefix = deployment_key_of("queuecap", "LLMServer") + "#"

        async def refusals_seen() -> bool:
            await client.post("/v1/completions", json={"prompt": [5] * 4, "max_tokens": 1})  # a fetch
            ids = [r for r in await controller.replica_ids.remote() if r.startswith(prefix)]
            snap = await controller.snapshot.remote(ids)
            return bool(ids) and snap.refused_tps > 0 and snap.served_tps > 0

        await await_until(refusals_seen, interval_s=0.5, what="the refused demand at the controller")


async def test_empty_queue_admits_a_prompt_longer_than_the_cap(queue_app_url: str) -> None:
    async with httpx.AsyncClient(base_url=queue_app_url, timeout=60) as client:
        resp = await client.post("/v1/completions", json={"prompt": [5] * (CAP * 3), "max_tokens": 2,
                                                          "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert usage["prompt_tokens"] == CAP * 3 and usage["completion_tokens"] == 2
        assert usage["total_tokens"] == CAP * 3 + 2


def test_a_stalled_body_gets_408(queue_app_url: str) -> None:
    """A client that declares a body and stops sending is answered 408, not held open."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(queue_app_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: x\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     '{"prompt": '.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"408", reply
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "body_timeout_s" in error["message"]
