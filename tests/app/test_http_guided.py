"""Through real HTTP, structured output holds: completions and chat under `response_format`
json_schema (whole and streamed) and vLLM's guided_* fields parse and validate, and a forced
tool call comes back in OpenAI's tool_calls shape, whole and streamed. The schemas bound their
strings and numbers, so the embedded random model completes every one (see
tests/replicas/test_engine_guided.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.serve

C, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200
ORDER = {"type": "object", "additionalProperties": False, "required": ["item", "qty", "express"],
         "properties": {"item": {"enum": ["tea", "coffee", "cocoa"]},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 12},
                        "express": {"type": "boolean"},
                        "note": {"type": "string", "maxLength": 6}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["utc_offset"],
                                       "properties": {"utc_offset": {"type": "integer", "minimum": -12,
                                                                     "maximum": 14}}}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.read()
    lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        return sse_events(resp)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_json_schema_whole_and_streamed(client: httpx.Client, temperature: float) -> None:
    body = {"prompt": "An order:", "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 3,
            "response_format": schema_format(ORDER)}
    [choice] = client.post(C, json=body).json()["choices"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), ORDER)
    chunks = stream(client, C, body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_json_schema_whole_and_streamed(client: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 11,
            "response_format": schema_format(ORDER)}
    data = client.post(CHAT, json=body).json()
    [choice] = data["choices"]
    assert choice["finish_reason"] == "stop" and set(choice["message"]) == {"role", "content"}
    jsonschema.validate(json.loads(choice["message"]["content"]), ORDER)
    assert data["usage"]["completion_tokens"] < MAX_TOKENS
    chunks = stream(client, CHAT, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("field,value,matches", [
    ("guided_json", ORDER, lambda t: jsonschema.validate(json.loads(t), ORDER) is None),
    ("guided_regex", r"[A-Z]{2}-\d{3}", lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t)),
    ("guided_choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue")),
    ("guided_grammar", 'start: "x=" /[0-9]{1,3}/', lambda t: re.fullmatch(r"x=\d{1,3}", t)),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
])
def test_vllm_guided_fields(client: httpx.Client, field: str, value: Any, matches: Any) -> None:
    body = {"prompt": "Answer:", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5, field: value}
    [choice] = client.post(C, json=body).json()["choices"]
    assert choice["finish_reason"] == "stop" and matches(choice["text"]), choice["text"]


def test_json_object_is_accepted_and_starts_an_object(client: httpx.Client) -> None:
    """Any object: the random model rarely ends one (see the engine test), so this checks the
    grammar reaches the replica: the text is an object's beginning, cut by max_tokens."""
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"}}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def check_call(call: dict[str, Any], names: set[str]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in names
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


@pytest.mark.parametrize("tool_choice,names", [
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ("required", {"get_weather", "get_time"}),
])
def test_forced_tool_call_whole_and_streamed(client: httpx.Client, tool_choice: Any, names: set[str]) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER, CLOCK], "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 2}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    check_call(call, names)
    chunks = stream(client, CHAT, body)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any(d.get("content") for d in deltas)
    [with_calls] = [d for d in deltas if "tool_calls" in d]
    [streamed] = with_calls["tool_calls"]
    assert streamed["index"] == 0
    check_call(streamed, names)
    assert streamed["function"] == call["function"]  # same seed, same call
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_answers_in_text_and_tool_turns_render(client: httpx.Client) -> None:
    """tool_choice none: plain text, no tool_calls key. The conversation carries an earlier call
    and its result (the chat template receives both)."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    body = {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "length" and set(choice["message"]) == {"role", "content"}
    assert isinstance(choice["message"]["content"], str)
