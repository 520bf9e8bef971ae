"""A stream's chunks, built as plain dicts and encoded with orjson, are exactly what the OpenAI
schemas (app/schemas.py's pydantic models) would have written: every field, every null."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from app.schemas import ChatCompletionChunk, CompletionResponse
from app.streaming import DONE, StreamMeta, chat_events, completion_events
from replicas.protocol import RequestOutput, TokenLogprob

pytestmark = pytest.mark.unit


def _outputs(n: int = 1, logprobs: bool = False, cached: int = 0) -> AsyncIterator[RequestOutput]:
    """Three deltas per choice (one empty), choices interleaved, the last finishing each."""

    async def gen() -> AsyncIterator[RequestOutput]:
        for step, text in enumerate(("Hel", "", "lo!")):
            for index in range(n):
                last = step == 2
                items = [TokenLogprob(7, text, -0.5, ((7, text, -0.5), (8, "x", -1.5)))] if logprobs else None
                yield RequestOutput(request_id="r", delta_text=text, delta_token_ids=[7], finished=last,
                                    finish_reason="length" if last else None, num_prompt_tokens=5,
                                    num_output_tokens=step + 1, logprobs=items, num_cached_tokens=cached,
                                    index=index)

    return gen()


def _parsed(events: list[bytes]) -> list[dict[str, Any]]:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    return [orjson.loads(e[len(b"data: "):]) for e in events]


def _as_model(model: type, event: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    """What the pydantic model writes for the same chunk (the old path)."""
    return orjson.loads(model.model_validate(event).model_dump_json(exclude=None if include_usage else {"usage"}))


CASES = [dict(include_usage=False), dict(include_usage=True), dict(include_usage=True, continuous_usage=True)]


@pytest.mark.parametrize("flags", CASES)
@pytest.mark.parametrize("logprobs", [False, True])
async def test_completion_chunks_match_the_schema(flags: dict[str, bool], logprobs: bool) -> None:
    meta = StreamMeta("cmpl-1", "m", 1, n=2, **flags)
    events = _parsed([e async for e in completion_events(meta, _outputs(2, logprobs, cached=2))])
    assert [_as_model(CompletionResponse, e, meta.include_usage) for e in events] == events
    texts = [c["text"] for e in events for c in e["choices"]]
    # the empty, unfinished delta is skipped, unless it carries logprobs
    assert texts == ["Hel", "Hel"] + ["", ""] * logprobs + ["lo!", "lo!"]
    assert ("usage" in events[0]) is meta.include_usage
    if meta.include_usage:  # the last chunk: usage alone, the prompt counted once per prompt
        assert events[-1]["choices"] == [] and events[-1]["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 2}}


@pytest.mark.parametrize("flags", CASES)
@pytest.mark.parametrize("logprobs", [False, True])
async def test_chat_chunks_match_the_schema(flags: dict[str, bool], logprobs: bool) -> None:
    meta = StreamMeta("chatcmpl-1", "m", 1, **flags)
    events = _parsed([e async for e in chat_events(meta, _outputs(1, logprobs))])
    assert [_as_model(ChatCompletionChunk, e, meta.include_usage) for e in events] == events
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[-1] == {} and events[-1 - meta.include_usage]["choices"][0]["finish_reason"] == "length"
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"


def test_done_is_the_last_event_openai_sends() -> None:
    assert DONE == b"data: [DONE]\n\n"
