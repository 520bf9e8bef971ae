"""Tool calls are read out of a response's text the same way whole or streamed in any split:
a forced call whose JSON is complete is a call, anything else stays content; Hermes blocks are
calls only when every block is a call to a known function; streamed content never shows a
`<tool_call>` tag or part of one."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import jsonschema
import pytest

from app.schemas import ChatCompletionRequest, Usage
from app.streaming import Collected, Gathered, StreamMeta, chat_events, chat_response
from app.tools import NO_PARAMETERS, ToolCallReader, ToolPlan, call_schema
from replicas.protocol import InvalidRequestError, RequestOutput

pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = {"get_weather": WEATHER, "now": None}
NAMED = ToolPlan("named", ("get_weather", "now"), "get_weather")
REQUIRED = ToolPlan("required", ("get_weather", "now"))
HERMES = ToolPlan("hermes", ("get_weather", "now"))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def read(plan: ToolPlan, text: str, pieces: list[int] | None = None) -> tuple[str, list, str]:
    """(content, calls, the content streamed before finish) for `text` fed in `pieces`."""
    reader, streamed, at = ToolCallReader(plan), "", 0
    for n in pieces or [len(text)]:
        streamed += reader.feed(text[at:at + n])
        at += n
    rest, calls = reader.finish()
    return streamed + rest, [(c.name, json.loads(c.arguments)) for c in calls], streamed


def test_call_schemas_accept_calls_and_only_calls() -> None:
    named = call_schema(TOOLS, "get_weather")
    assert named is WEATHER and call_schema(TOOLS, "now") == NO_PARAMETERS
    jsonschema.validate({}, call_schema(TOOLS, "now"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 1}, call_schema(TOOLS, "now"))
    required = call_schema(TOOLS, None)
    jsonschema.validate(json.loads(CALL), required)
    jsonschema.validate({"name": "now", "arguments": {}}, required)
    for bad in ({"name": "nope", "arguments": {}}, {"name": "get_weather", "arguments": {}},
                {"name": "now"}, {"name": "now", "arguments": {}, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)


@pytest.mark.parametrize("plan,text,content,calls", [
    (NAMED, '{"city":"Paris"}', "", [("get_weather", {"city": "Paris"})]),
    (NAMED, '{"city":"Pa', '{"city":"Pa', []),  # cut by max_tokens: not a call
    (REQUIRED, '{"name":"now","arguments":{}}', "", [("now", {})]),
    (REQUIRED, '{"name":"get_weather","arguments":{"ci', '{"name":"get_weather","arguments":{"ci', []),
    (HERMES, "Let me look.\n<tool_call>\n" + CALL + "\n</tool_call>", "Let me look.\n",
     [("get_weather", {"city": "Paris"})]),
    (HERMES, f"<tool_call>{CALL}</tool_call>\n<tool_call>" + '{"name": "now", "arguments": {}}',
     "", [("get_weather", {"city": "Paris"}), ("now", {})]),  # the last block unclosed (at EOS)
    (HERMES, "no calls < here <tool", "no calls < here <tool", []),
    (HERMES, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),  # not in tools
    (HERMES, f"<tool_call>{CALL}</tool_call><tool_call>[1]</tool_call>",
     f"<tool_call>{CALL}</tool_call><tool_call>[1]</tool_call>", []),  # one bad block: no calls
])
def test_whole_and_streamed_in_any_split_read_the_same(plan, text, content, calls) -> None:
    assert read(plan, text)[:2] == (content, calls)
    rng = random.Random(0)
    for split in [[1] * len(text)] + [[rng.randint(1, 6) for _ in text] for _ in range(20)]:
        got, got_calls, streamed = read(plan, text, split)
        assert (got, got_calls) == (content, calls)
        if calls:  # what streamed before the end is content, never a piece of a tag
            assert streamed == content
        assert plan.mode == "hermes" or streamed == ""


def request(tool_choice: object = None, **body: object) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, **({"parameters": p} if p else {})}}
             for n, p in TOOLS.items()]
    data = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **body}
    if tool_choice is not None:
        data["tool_choice"] = tool_choice
    return ChatCompletionRequest.model_validate(data)


def test_tool_choice_picks_the_plan_and_the_grammar() -> None:
    named = request({"type": "function", "function": {"name": "now"}})
    assert named.tool_plan(None) == ToolPlan("named", ("get_weather", "now"), "now")
    assert json.loads(named.guided_decoding().spec) == NO_PARAMETERS
    required = request("required")
    assert required.tool_plan(None) == REQUIRED
    assert json.loads(required.guided_decoding().spec) == call_schema(TOOLS, None)
    assert required.guided_decoding().param == "tools"
    none = request("none", response_format={"type": "json_object"})
    assert none.tool_plan(None) is None and none.guided_decoding().kind == "json_object"
    auto = request()
    assert auto.tool_plan("hermes") == HERMES and auto.guided_decoding() is None
    with pytest.raises(InvalidRequestError) as err:
        auto.tool_plan(None)
    assert err.value.param == "tool_choice"


async def _outputs(text: str, pieces: int, reason: str) -> AsyncIterator[RequestOutput]:
    step = max(1, len(text) // pieces)
    chunks = [text[i:i + step] for i in range(0, len(text), step)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        yield RequestOutput(request_id="r", delta_text=chunk, delta_token_ids=[1], finished=last,
                            finish_reason=reason if last else None, num_prompt_tokens=3, num_output_tokens=i + 1)


async def test_a_streamed_call_is_one_delta_before_finish_reason_tool_calls() -> None:
    meta = StreamMeta("chatcmpl-1", "m", 0, include_usage=False)
    text = "Sure.<tool_call>" + CALL + "</tool_call>"
    events = [json.loads(e[len("data: "):]) async for e in chat_events(meta, _outputs(text, 9, "stop"), HERMES)]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    [call_delta] = [d for d in deltas if "tool_calls" in d]
    [call] = call_delta["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert deltas.index(call_delta) == len(deltas) - 2


def test_a_whole_call_has_null_content_and_finish_reason_tool_calls() -> None:
    meta = StreamMeta("chatcmpl-1", "m", 0, include_usage=False)
    usage = Usage.of(3, 9)
    done = chat_response(meta, Gathered([Collected('{"city":"Oslo"}', "stop", None)], usage), NAMED).model_dump()
    message = done["choices"][0]["message"]
    assert message["content"] is None and done["choices"][0]["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    cut = chat_response(meta, Gathered([Collected('{"city":"Os', "length", None)], usage), NAMED).model_dump()
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": '{"city":"Os'}
    assert cut["choices"][0]["finish_reason"] == "length"
