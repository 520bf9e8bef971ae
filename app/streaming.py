"""Turn a replica's stream of `RequestOutput` deltas into OpenAI responses and SSE chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from app.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                         ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionResponse,
                         Usage)
from replicas.protocol import RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict, *, exclude: set[str] | None = None) -> str:
    """One Server-Sent Event carrying a JSON object."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload)
    return f"data: {body}\n\n"


@dataclass
class Collected:
    """A whole generation, gathered from its deltas."""

    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    usage: Usage


async def collect(outputs: AsyncIterator[RequestOutput]) -> Collected:
    """Join every delta of a stream (the non-streaming answer)."""
    parts: list[str] = []
    last: RequestOutput | None = None
    async for out in outputs:
        parts.append(out.delta_text)
        last = out
    if last is None or not last.finished:
        raise RuntimeError("the replica's stream ended before the request finished")
    return Collected("".join(parts), last.finish_reason, last.stop_reason,
                     Usage.of(last.num_prompt_tokens, last.num_output_tokens))


@dataclass(frozen=True)
class StreamMeta:
    """What every chunk of one response repeats."""

    request_id: str
    model: str
    created: int
    include_usage: bool

    @property
    def exclude(self) -> set[str] | None:
        # OpenAI sends "usage": null on every chunk only when usage was asked for.
        return None if self.include_usage else {"usage"}


def completion_response(meta: StreamMeta, result: Collected) -> CompletionResponse:
    choice = CompletionChoice(text=result.text, finish_reason=result.finish_reason,
                              stop_reason=result.stop_reason)
    return CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                              choices=[choice], usage=result.usage)


def chat_response(meta: StreamMeta, result: Collected) -> ChatCompletionResponse:
    choice = ChatChoice(message=AssistantMessage(content=result.text),
                        finish_reason=result.finish_reason, stop_reason=result.stop_reason)
    return ChatCompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                  choices=[choice], usage=result.usage)


async def completion_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """SSE chunks of a text completion; empty deltas are skipped unless they finish it."""
    last: RequestOutput | None = None
    async for out in outputs:
        last = out
        if not out.delta_text and not out.finished:
            continue
        choice = CompletionChoice(text=out.delta_text, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason)
        chunk = CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                   choices=[choice])
        yield sse(chunk, exclude=meta.exclude)
    if meta.include_usage and last is not None:
        final = CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                   choices=[], usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens))
        yield sse(final)


async def chat_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """SSE chunks of a chat completion: the role first, then content, then finish_reason."""

    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse(ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model,
                                       choices=[choice]), exclude=meta.exclude)

    yield chunk(ChatDelta(role="assistant", content=""))
    last: RequestOutput | None = None
    async for out in outputs:
        last = out
        if out.delta_text:
            yield chunk(ChatDelta(content=out.delta_text))
        if out.finished:
            yield chunk(ChatDelta(), out.finish_reason)
    if meta.include_usage and last is not None:
        final = ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model,
                                    choices=[], usage=Usage.of(last.num_prompt_tokens, last.num_output_tokens))
        yield sse(final)
