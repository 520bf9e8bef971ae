"""Turn a replica's stream of `RequestOutput` deltas into OpenAI responses and SSE chunks.

A stream's chunks are built as plain dicts and encoded with orjson: they are made once per event,
where building and validating pydantic models cost more than the JSON itself. Their shapes are
app/schemas.py's models (`CompletionResponse`, `ChatCompletionChunk`); a test holds them equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel

from app.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                         ChatCompletionResponse, ChatDelta, ChatLogprobs, CompletionChoice,
                         CompletionLogprobs, CompletionResponse, DeltaToolCall, ResponseFunction,
                         ResponseToolCall, TokenLogprobContent, TopLogprob, Usage)
from app.tools import ToolCall, ToolCallReader, ToolPlan
from replicas.protocol import RequestOutput, TokenLogprob

DONE = b"data: [DONE]\n\n"
COMPLETION, CHAT = "text_completion", "chat.completion.chunk"  # each chunk's "object"


def sse(payload: BaseModel | dict) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    if isinstance(payload, BaseModel):
        return b"data: " + payload.model_dump_json().encode() + b"\n\n"
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`Usage.of(...)`'s JSON."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Collected:
    """One choice of a whole generation, gathered from its deltas."""

    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0


class UsageTally:
    """Usage over the choices of one response: each prompt's tokens once (its first sample,
    choice `p * n`, carries them) and every choice's completion tokens."""

    def __init__(self, n: int = 1) -> None:
        self.n = n
        self._latest: dict[int, RequestOutput] = {}

    def add(self, out: RequestOutput, completion_tokens: int | None = None) -> None:
        """The latest output of its choice; `completion_tokens` overrides its count."""
        self._latest[out.index] = out if completion_tokens is None else \
            dataclasses.replace(out, num_output_tokens=completion_tokens)

    def counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached prompt) tokens."""
        firsts = [o for i, o in self._latest.items() if i % self.n == 0]
        return (sum(o.num_prompt_tokens for o in firsts), sum(o.num_output_tokens for o in self._latest.values()),
                sum(o.num_cached_tokens for o in firsts))

    def usage(self) -> Usage:
        return Usage.of(*self.counts())

    def usage_json(self) -> dict[str, Any]:
        return _usage(*self.counts())


@dataclass
class Gathered:
    """Every choice of a whole response, by index, and their usage."""

    choices: list[Collected]
    usage: Usage


async def collect(outputs: AsyncIterator[RequestOutput], n: int = 1) -> Gathered:
    """Join every delta of a stream (the non-streaming answer); its choices come by `index`."""
    parts: dict[int, list[str]] = {}
    logprobs: dict[int, list[TokenLogprob] | None] = {}
    prompt_logprobs: dict[int, list[TokenLogprob] | None] = {}
    last: dict[int, RequestOutput] = {}
    tally = UsageTally(n)
    async for out in outputs:
        i = out.index
        parts.setdefault(i, []).append(out.delta_text)
        if out.logprobs is not None:
            logprobs[i] = (logprobs.get(i) or []) + out.logprobs
        prompt_logprobs[i] = prompt_logprobs.get(i) or out.prompt_logprobs
        last[i] = out
        tally.add(out)
    if not last or not all(out.finished for out in last.values()):
        raise RuntimeError("the replica's stream ended before the request finished")
    choices = [Collected("".join(parts[i]), out.finish_reason, out.stop_reason, logprobs.get(i),
                         prompt_logprobs.get(i), i) for i, out in sorted(last.items())]
    return Gathered(choices, tally.usage())


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
    n: int = 1  # samples per prompt: choice p * n + j is sample j of prompt p

    def chunk(self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        """One SSE chunk of this response. OpenAI sends "usage" (null but on the last chunk) on
        every chunk only when usage was asked for."""
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)


def completion_response(meta: StreamMeta, result: Gathered,
                        echoes: Sequence[str | None] | None = None) -> CompletionResponse:
    """The whole completion; `echoes[p]`: prompt p's text, put in front of each of its choices
    (with its logprobs)."""
    choices = []
    for c in result.choices:
        text, items = _echoed(echoes[c.index // meta.n] if echoes else None, c.text, c)
        choices.append(CompletionChoice(index=c.index, text=text, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason, logprobs=completion_logprobs(items)))
    return CompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                              choices=choices, usage=result.usage)


def chat_response(meta: StreamMeta, result: Gathered, plan: ToolPlan | None = None) -> ChatCompletionResponse:
    """The whole chat answer; with tools in play, each choice's calls are read out of its text
    (`plan`)."""
    choices = []
    for c in result.choices:
        text, calls, finish_reason = c.text, [], c.finish_reason
        if plan is not None:
            reader = ToolCallReader(plan)
            head = reader.feed(text)
            rest, calls = reader.finish()
            text = head + rest
        message = AssistantMessage(content=text or (None if calls else ""),
                                   tool_calls=[_tool_call(call) for call in calls] or None)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=chat_logprobs(c.logprobs),
                                  finish_reason="tool_calls" if calls else finish_reason,
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=meta.request_id, created=meta.created, model=meta.model,
                                  choices=choices, usage=result.usage)


async def completion_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput],
                            echoes: Sequence[str | None] | None = None) -> AsyncIterator[bytes]:
    """SSE chunks of a text completion, each carrying one choice (its `index`); empty deltas are
    skipped unless they finish it. `echoes[p]` (prompt p's text) goes with the first chunk of
    each of its choices, with the prompt's logprobs (as vLLM does)."""
    tally = UsageTally(meta.n)
    offsets: dict[int, int] = {}  # characters of token text sent so far, by choice
    started: set[int] = set()
    async for out in outputs:
        i = out.index
        tally.add(out)
        echo = echoes[i // meta.n] if echoes and i not in started else None
        if echo is None and not out.delta_text and not out.finished and not out.logprobs:
            continue
        started.add(i)
        text, items = _echoed(echo, out.delta_text, out)
        logprobs = completion_logprobs(items, offsets.get(i, 0))
        if logprobs is not None and logprobs.tokens:
            offsets[i] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        choice = {"index": i, "text": text, "logprobs": None if logprobs is None else logprobs.model_dump(),
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        yield meta.chunk(COMPLETION, [choice], tally.usage_json() if meta.continuous_usage else None)
    if meta.include_usage and started:
        yield meta.chunk(COMPLETION, [], tally.usage_json())


async def chat_events(meta: StreamMeta, outputs: AsyncIterator[RequestOutput],
                      plan: ToolPlan | None = None) -> AsyncIterator[bytes]:
    """SSE chunks of a chat completion, each carrying one choice: per choice the role first,
    then content, then finish_reason.

    With tools in play (`plan`), text that is (or may begin) a call is held back; the calls go
    out whole, in one delta just before the finish_reason "tool_calls" chunk.
    """

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None, usage: bool = True) -> bytes:
        choice = {"index": index, "delta": delta,
                  "logprobs": None if logprobs is None else logprobs.model_dump(), "finish_reason": finish_reason}
        return meta.chunk(CHAT, [choice], tally.usage_json() if usage and meta.continuous_usage else None)

    role = {"role": "assistant", "content": ""}  # ChatDelta's JSON: its None fields left out
    tally = UsageTally(meta.n)
    readers: dict[int, ToolCallReader | None] = {}
    async for out in outputs:
        i = out.index
        if i not in readers:  # the choice's role chunk first (its usage: no completion tokens yet)
            readers[i] = ToolCallReader(plan) if plan is not None else None
            tally.add(out, completion_tokens=0)
            yield chunk(i, role)
        tally.add(out)
        reader = readers[i]
        text = reader.feed(out.delta_text) if reader is not None else out.delta_text
        if text or out.logprobs:
            yield chunk(i, {"content": text}, logprobs=chat_logprobs(out.logprobs))
        if out.finished:
            finish_reason = out.finish_reason
            if reader is not None:
                rest, calls = reader.finish()
                if rest:
                    yield chunk(i, {"content": rest})
                if calls:
                    delta = ChatDelta(tool_calls=[DeltaToolCall(index=k, **_tool_call(c).model_dump())
                                                  for k, c in enumerate(calls)])
                    yield chunk(i, delta.model_dump())
                    finish_reason = "tool_calls"
            yield chunk(i, {}, finish_reason)
    if not readers:  # no output at all (the caller guarantees one; keep the role chunk regardless)
        yield chunk(0, role, usage=False)
    if meta.include_usage and readers:
        yield meta.chunk(CHAT, [], tally.usage_json())


def _tool_call(call: ToolCall) -> ResponseToolCall:
    return ResponseToolCall(id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments))
