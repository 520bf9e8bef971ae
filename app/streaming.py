"""Turn a replica's stream of `RequestOutput` deltas into OpenAI responses and SSE chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from app.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                         ChatCompletionResponse, ChatDelta, ChatLogprobs, CompletionChoice,
                         CompletionLogprobs, CompletionResponse, DeltaToolCall, ResponseFunction,
                         ResponseToolCall, TokenLogprobContent, TopLogprob, Usage)
from app.tools import ToolCall, ToolCallReader, ToolPlan
from replicas.protocol import RequestOutput, TokenLogprob

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
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


async def collect(outputs: AsyncIterator[RequestOutput]) -> Collected:
    """Join every delta of a stream (the non-streaming answer)."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    last: RequestOutput | None = None
    async for out in outputs:
        parts.append(out.delta_text)
        if out.logprobs is not None:
            logprobs = (logprobs or []) + out.logprobs
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        last = out
    if last is None or not last.finished:
        raise RuntimeError("the replica's stream ended before the request finished")
    return Collected("".join(parts), last.finish_reason, last.stop_reason,
                     usage_of(last), logprobs, prompt_logprobs)


def completion_logprobs(items: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
    """OpenAI's completions shape; `text_offset` counts characters from `offset` (the length of
    the text the previous chunks carried). A token nothing scores (an echoed prompt's first)
    has null token_logprobs and top_logprobs."""
    if items is None:
        return None
    offsets, at = [], offset
    for t in items:
        offsets.append(at)
        at += len(t.token)
    return CompletionLogprobs(tokens=[t.token for t in items], token_logprobs=[t.logprob for t in items],
                              top_logprobs=[None if t.logprob is None else {text: lp for _, text, lp in t.top}
                                            for t in items],
                              text_offset=offsets)


def _echoed(echo: str | None, text: str, out: Collected | RequestOutput) -> tuple[str, list[TokenLogprob] | None]:
    """The text and logprobs of a completion (or of its first chunk) with the prompt in front
    when `echo` (the prompt's text) is given: with logprobs, the prompt's tokens come first."""
    if echo is None:
        return text, out.logprobs
    if out.prompt_logprobs is None:
        return echo + text, out.logprobs
    return echo + text, out.prompt_logprobs + (out.logprobs or [])


def chat_logprobs(items: list[TokenLogprob] | None) -> ChatLogprobs | None:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and top alternatives."""
    if items is None:
        return None

    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    return ChatLogprobs(content=[
        TokenLogprobContent(**entry(t.token, t.logprob),
                            top_logprobs=[TopLogprob(**entry(text, lp)) for _, text, lp in t.top])
        for t in items])


@dataclass(frozen=True)
class StreamMeta:
    """What every chunk of one response repeats."""

    request_id: str
    model: str
    created: int
    include_usage: bool
    continuous_usage: bool = False  # usage on every chunk (stream_options.continuous_usage_stats)

    @property
    def exclude(self) -> set[str] | None:
        # OpenAI sends "usage": null on every chunk only when usage was asked for.
        return None if self.include_usage else {"usage"}


def completion_response(meta: StreamMeta, result: Collected, echo: str | None = None) -> CompletionResponse:
    """The whole completion; `echo`: the prompt's text, put in front (with its logprobs)."""
    text, items = _echoed(echo, result.text, result)
    choice = CompletionChoice(text=text, finish_reason=result.finish_reason,
                              stop_reason=result.stop_reason, logprobs=completion_logprobs(items))
    return CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                              choices=[choice], usage=result.usage)


def chat_response(meta: StreamMeta, result: Collected, plan: ToolPlan | None = None) -> ChatCompletionResponse:
    """The whole chat answer; with tools in play, its calls are read out of the text (`plan`)."""
    text, calls, finish_reason = result.text, [], result.finish_reason
    if plan is not None:
        reader = ToolCallReader(plan)
        head = reader.feed(text)
        rest, calls = reader.finish()
        text = head + rest
    message = AssistantMessage(content=text or (None if calls else ""),
                               tool_calls=[_tool_call(c) for c in calls] or None)
    choice = ChatChoice(message=message, logprobs=chat_logprobs(result.logprobs),
                        finish_reason="tool_calls" if calls else finish_reason,
                        stop_reason=result.stop_reason)
    return ChatCompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                  choices=[choice], usage=result.usage)


async def completion_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput],
                            echo: str | None = None) -> AsyncIterator[str]:
    """SSE chunks of a text completion; empty deltas are skipped unless they finish it. `echo`
    (the prompt's text) goes with the first chunk, with the prompt's logprobs (as vLLM does)."""
    last: RequestOutput | None = None
    offset = 0  # characters of token text sent so far (text_offset of the next token)
    async for out in outputs:
        last = out
        if echo is None and not out.delta_text and not out.finished and not out.logprobs:
            continue
        text, items = _echoed(echo, out.delta_text, out)
        echo = None
        logprobs = completion_logprobs(items, offset)
        if logprobs is not None and logprobs.tokens:
            offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        choice = CompletionChoice(text=text, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason, logprobs=logprobs)
        chunk = CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                   choices=[choice],
                                   usage=_running_usage(meta, out))
        yield sse(chunk, exclude=meta.exclude)
    if meta.include_usage and last is not None:
        final = CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                   choices=[], usage=usage_of(last))
        yield sse(final)


async def chat_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput],
                      plan: ToolPlan | None = None) -> AsyncIterator[str]:
    """SSE chunks of a chat completion: the role first, then content, then finish_reason.

    With tools in play (`plan`), text that is (or may begin) a call is held back; the calls go
    out whole, in one delta just before the finish_reason "tool_calls" chunk.
    """

    def chunk(delta: ChatDelta, usage: Usage | None, finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return sse(ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model,
                                       choices=[choice], usage=usage), exclude=meta.exclude)

    role = ChatDelta(role="assistant", content="")
    reader = ToolCallReader(plan) if plan is not None else None
    last: RequestOutput | None = None
    async for out in outputs:
        if last is None:  # the role chunk first (its usage: the prompt, no completion tokens yet)
            yield chunk(role, _running_usage(meta, out, completion_tokens=0))
        last = out
        usage = _running_usage(meta, out)
        text = reader.feed(out.delta_text) if reader is not None else out.delta_text
        if text or out.logprobs:
            yield chunk(ChatDelta(content=text), usage, logprobs=chat_logprobs(out.logprobs))
        if out.finished:
            finish_reason = out.finish_reason
            if reader is not None:
                rest, calls = reader.finish()
                if rest:
                    yield chunk(ChatDelta(content=rest), usage)
                if calls:
                    yield chunk(ChatDelta(tool_calls=[DeltaToolCall(index=i, **_tool_call(c).model_dump())
                                                      for i, c in enumerate(calls)]), usage)
                    finish_reason = "tool_calls"
            yield chunk(ChatDelta(), usage, finish_reason)
    if last is None:  # no output at all (the caller guarantees one; keep the role chunk regardless)
        yield chunk(role, None)
    if meta.include_usage and last is not None:
        final = ChatCompletionChunk(id=meta.request_id, created=meta.created, model=meta.model,
                                    choices=[], usage=usage_of(last))
        yield sse(final)


def _tool_call(call: ToolCall) -> ResponseToolCall:
    return ResponseToolCall(id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments))


def usage_of(out: RequestOutput) -> Usage:
    """Usage as of this output: prompt (and its cached part) and completion tokens so far."""
    return Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def _running_usage(meta: StreamMeta, out: RequestOutput, completion_tokens: int | None = None) -> Usage | None:
    """Usage so far, on each chunk when continuous usage was asked for (else None: omitted)."""
    if not meta.continuous_usage:
        return None
    done = out.num_output_tokens if completion_tokens is None else completion_tokens
    return Usage.of(out.num_prompt_tokens, done, out.num_cached_tokens)
