"""stream_interval_ms over real HTTP: a stream's tokens arrive merged into a few SSE events, the
same text and usage as token by token."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

APP_ARGS = {"model": "embedded:tiny", "engine": {"max_num_seqs": 8, "max_batch_total_tokens": 2048},
            "num_cpus": 1, "ingress_num_cpus": 0.1, "replica": {"stream_interval_ms": 2000}}


@pytest.fixture(scope="module")
def interval_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app("interval", APP_ARGS) as url:
        yield url


def events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_tokens_arrive_merged_with_the_same_text(interval_url: str, client: httpx.Client) -> None:
    body = {"model": "embedded-tiny", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    whole = client.post("/v1/completions", json={**body, "stream_options": None}).json()  # every pass
    got = events(interval_url, body)
    text_events = [e for e in got if e["choices"]]
    # 40 tokens take well under 2 s here: the first token at once, the rest in a handful of events.
    assert 2 <= len(text_events) <= 10
    assert "".join(e["choices"][0]["text"] for e in text_events) == whole["choices"][0]["text"]
    assert text_events[-1]["choices"][0]["finish_reason"] == "length"
    assert got[-1]["usage"]["completion_tokens"] == 40

