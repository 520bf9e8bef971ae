"""Under a burst many times its capacity the server sheds load cleanly: every answer is a 200
whose stream completes, or a 429 in OpenAI's shape with Retry-After; no 5xx, no stream cut
without an error event; and it answers normally right after."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.serve

OVERLOAD_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-overload", 
                     "engine": {"max_num_seqs": 4, "max_batch_total_tokens": 1024, "queue_timeout_s": 3.0},
                     "replica": {"max_queued_tokens": 128},
                     "max_ongoing_requests": 16, "max_queued_requests": 8, "num_cpus": 1,
                     "ingress_num_cpus": 0.1}
BURST = 120


@pytest.fixture(scope="module")
def overload_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app("overload", OVERLOAD_APP_ARGS) as url:
        yield url


async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict[str, Any]]:
    """Send one streaming request; classify how it ended."""
    body = {"prompt": [5 + i % 50] * 24, "max_tokens": 24, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            return f"http_{resp.status_code}", {"headers": dict(resp.headers), "body": raw}
        events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "cut", {"events": events}
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    if errors:
        return "error_event", {"error": errors[0]}
    text = [json.loads(e) for e in events[:-1]]
    finished = [c for c in text if c["choices"] and c["choices"][0]["finish_reason"]]
    return ("ok" if finished and finished[-1]["choices"][0]["finish_reason"] == "length" else "cut"), {}


async def test_a_burst_gets_200s_and_429s_only(overload_url: str) -> None:
    limits = httpx.Limits(max_connections=BURST + 10, max_keepalive_connections=BURST + 10)
    async with httpx.AsyncClient(base_url=overload_url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(BURST)))
        kinds = Counter(kind for kind, _ in results)
        assert set(kinds) <= {"ok", "http_429"}, (kinds, [d for k, d in results if k not in ("ok", "http_429")][:2])
        assert kinds["ok"] >= 4 and kinds["http_429"] >= 1, kinds  # it served some, shed the rest
        for kind, detail in results:
            if kind == "http_429":
                assert int(detail["headers"]["retry-after"]) >= 1
                error = json.loads(detail["body"])["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "rate_limit_error"
                assert error["code"] in ("rate_limit_exceeded", "queue_timeout")
        # Right after, it answers normally.
        ok = await client.post("/v1/completions", json={"prompt": [5] * 8, "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4

