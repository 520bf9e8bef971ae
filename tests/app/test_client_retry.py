"""A request the client says is a retry (OpenAI's SDKs send `x-stainless-retry-count`) is known as
one, so the autoscaler's demand counts it once (`autoscale.demand`)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from app.middleware import RETRY_COUNT_HEADER, is_client_retry

pytestmark = pytest.mark.unit


def scope(*headers: tuple[str, str]) -> dict:
    """The ASGI scope of a request with these headers (as Starlette's `Request.scope`)."""
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.encode(), v.encode()) for k, v in headers]}).scope


def test_the_sdks_retry_count_marks_a_retry():
    assert not is_client_retry(scope())
    assert not is_client_retry(scope((RETRY_COUNT_HEADER, "0")))  # the SDK's first try
    assert is_client_retry(scope((RETRY_COUNT_HEADER, "1")))
    assert not is_client_retry(scope((RETRY_COUNT_HEADER, "many")))  # unreadable: a first try


def test_the_openai_sdk_sends_it_on_a_retry():
    """The header the SDK really sends: its retries of a 429 carry a count above 0."""
    import httpx
    import openai

    seen: list[str | None] = []

    def answer(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers.get(RETRY_COUNT_HEADER))
        if len(seen) < 3:
            return httpx.Response(429, headers={"retry-after-ms": "1"}, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                         "choices": [{"index": 0, "text": "x", "finish_reason": "stop",
                                                      "logprobs": None}]})

    client = openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=2,
                           http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    assert client.completions.create(model="m", prompt="hi").choices[0].text == "x"
    assert seen == ["0", "1", "2"]
    assert [is_client_retry(scope((RETRY_COUNT_HEADER, v))) for v in seen] == [False, True, True]
