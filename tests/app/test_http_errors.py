"""A client's mistake is answered with the right 4xx and an OpenAI error body, wherever it is
caught (pydantic, sampling params, the engine's limits on the replica), and the server stays
healthy after every one of them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.serve

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _case(id_: str, path: str, body: Any, status: int, param: str | None = None,
          contains: str = "", method: str = "POST") -> Any:
    return pytest.param(method, path, body, status, param, contains, id=id_)


# (method, path, body or raw bytes, status, error.param, substring of error.message)
BAD_REQUESTS = [
    _case("invalid-json", C, b'{"prompt": "hi",', 400, None, "invalid JSON"),
    _case("body-not-object", C, [1, 2], 400),
    _case("missing-prompt", C, {"max_tokens": 2}, 400, "prompt", "Field required"),
    _case("prompt-wrong-type", C, {"prompt": 12}, 400, "prompt"),
    _case("max-tokens-string", C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    _case("max-tokens-zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    _case("temperature-range", C, {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    _case("top-p-zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    _case("top-k-negative", C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    _case("seed-negative", C, {"prompt": "hi", "seed": -1}, 400, "seed"),
    _case("stop-not-string", C, {"prompt": "hi", "stop": 7}, 400, "stop"),
    _case("empty-prompt", C, {"prompt": ""}, 400, "prompt", "must not be empty"),
    _case("empty-token-prompt", C, {"prompt": []}, 400, "prompt", "must not be empty"),
    _case("token-out-of-vocab", C, {"prompt": [1, 999_999]}, 400, "prompt", "[0, 2048)"),
    _case("beyond-context", C, {"prompt": "hi", "max_tokens": 2048}, 400, "max_tokens",
          "maximum context length is 2048 tokens"),
    _case("beyond-kv-capacity", C, {"prompt": "hi", "max_tokens": 1600}, 400, "max_tokens",
          "max_batch_total_tokens = 1536"),
    _case("priority-range", C, {"prompt": "hi", "priority": 5000}, 400, "priority"),
    _case("n-zero", C, {"prompt": "hi", "n": 0}, 400, "n", "[1, 128]"),
    _case("n-over-limit", CHAT, {"messages": USER, "n": 129}, 400, "n", "[1, 128]"),
    _case("best-of-over-n", C, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "must equal n"),
    _case("batched-prompts-too-many", C, {"prompt": ["a"] * 257}, 400, "prompt", "at most 256"),
    _case("batched-prompt-empty", C, {"prompt": ["a", ""]}, 400, "prompt", "must not be empty"),
    _case("logprobs-range", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    _case("suffix", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix", "not supported"),
    _case("chat-max-tokens-zero", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_tokens",
          "0 only with echo"),
    _case("echo-max-tokens-negative", C, {"prompt": "hi", "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    _case("echo-logprobs-range", C, {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    _case("presence-penalty-range", C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty",
          "[-2, 2]"),
    _case("frequency-penalty-type", C, {"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    _case("chat-frequency-penalty-range", CHAT, {"messages": USER, "frequency_penalty": -3}, 400,
          "frequency_penalty", "[-2, 2]"),
    _case("repetition-penalty-zero", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    _case("logit-bias-key", C, {"prompt": "hi", "logit_bias": {"hello": 1}}, 400, "logit_bias", "token ids"),
    _case("logit-bias-negative-key", C, {"prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    _case("logit-bias-range", C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    _case("logit-bias-beyond-vocab", C, {"prompt": "hi", "logit_bias": {"2048": 1}}, 400, "logit_bias",
          "[0, 2048)"),
    _case("chat-logit-bias-type", CHAT, {"messages": USER, "logit_bias": {"5": "up"}}, 400, "logit_bias.5"),
    _case("min-tokens-over-max-tokens", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    _case("min-tokens-negative", C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    _case("chat-min-tokens-over-room", CHAT, {"messages": USER, "min_tokens": 1600}, 400, "min_tokens",
          "must not exceed max_tokens"),
    _case("chat-top-logprobs-range", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 25}, 400,
          "logprobs", "[0, 20]"),
    _case("stream-options-without-stream", C,
          {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    _case("stream-options-unknown-key", C,
          {"prompt": "hi", "stream": True, "stream_options": {"usage_every": True}}, 400,
          "stream_options.usage_every"),
    # Structured output and tools: what cannot be honoured is refused, naming the field.
    _case("response-format-unknown-type", C, {"prompt": "hi", "response_format": {"type": "structural_tag"}},
          400, "response_format.type"),
    _case("response-format-schema-missing", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
          400, "response_format", "json_schema"),
    _case("response-format-bad-schema", C, {"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, 400,
          "response_format", "strin"),
    _case("response-format-bad-schema-stream", CHAT, {"messages": USER, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
          400, "response_format", "uniqueItems"),
    _case("guided-json-not-json", C, {"prompt": "hi", "guided_json": "{nope"}, 400, "guided_json", "not valid JSON"),
    _case("guided-regex-bad", C, {"prompt": "hi", "guided_regex": "a(b", "stream": True}, 400, "guided_regex",
          "unclosed group"),
    _case("guided-choice-empty", C, {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    _case("guided-grammar-bad", C, {"prompt": "hi", "guided_grammar": "start: undefined_rule"}, 400,
          "guided_grammar", "undefined_rule"),
    _case("two-output-constraints", C, {"prompt": "hi", "response_format": {"type": "json_object"},
                                        "guided_regex": "a+"}, 400, "guided_regex", "one output constraint"),
    _case("guided-whitespace-pattern", C, {"prompt": "hi", "guided_json": {}, "guided_whitespace_pattern": " "},
          400, "guided_whitespace_pattern", "not supported"),
    _case("structured-outputs-unknown-key", C, {"prompt": "hi", "structured_outputs": {"structural_tag": "x"}},
          400, "structured_outputs.structural_tag"),
    _case("tools-auto-without-parser", CHAT, {"messages": USER, "tools": [TOOL]}, 400, "tool_choice",
          "tool-call parser"),
    _case("tool-choice-unknown-function", CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, 400, "tool_choice", "'nope' is not in tools"),
    _case("tool-choice-without-tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400,
          "tool_choice", "needs tools"),
    _case("tool-not-a-function", CHAT, {"messages": USER, "tools": [{"type": "code_interpreter"}],
                                        "tool_choice": "required"}, 400, "tools.0.type"),
    _case("tool-name-pattern", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "two words"}}], "tool_choice": "required"}, 400, "tools.0.function.name"),
    _case("tool-names-repeat", CHAT, {"messages": USER, "tools": [TOOL, TOOL], "tool_choice": "required"}, 400,
          "tools", "distinct"),
    _case("tool-bad-parameters", CHAT, {"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, 400, "tools", "strin"),
    _case("tools-with-response-format", CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": "required",
                                               "response_format": {"type": "json_object"}}, 400,
          "response_format", "cannot be combined with tools"),
    _case("chat-top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 3}, 400,
          "top_logprobs", "requires logprobs"),
    _case("unknown-model", C, {"model": "gpt-9", "prompt": "hi"}, 404, "model", "gpt-9"),
    _case("chat-empty-messages", CHAT, {"messages": []}, 400, "messages"),
    _case("chat-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
          "messages.0.role"),
    _case("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
          "messages.0.content"),
    _case("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
    _case("chat-beyond-context", CHAT, {"messages": USER, "max_completion_tokens": 5000}, 400,
          "max_tokens", "maximum context length is 2048 tokens"),
    _case("chat-unknown-model", CHAT, {"model": "nope", "messages": USER}, 404, "model"),
    _case("chat-temperature-type", CHAT, {"messages": USER, "temperature": "hot"}, 400,
          "temperature"),
    # Text that is not valid Unicode (lone surrogates, invalid UTF-8) is the client's mistake.
    _case("surrogate-prompt", C, {"prompt": "a\ud800b"}, 400, "prompt", "invalid Unicode"),
    _case("surrogate-prompt-stream", C, {"prompt": "\ud800", "stream": True}, 400, "prompt"),
    _case("low-surrogate-prompt-list", C, {"prompt": ["\udfff"]}, 400, "prompt.0"),
    _case("surrogate-stop", C, {"prompt": "hi", "stop": ["ok", "\udc00"]}, 400, "stop.1"),
    _case("surrogate-model", C, {"model": "\udbff", "prompt": "hi"}, 400, "model"),
    _case("surrogate-user", C, {"prompt": "hi", "user": "\ud800"}, 400, "user"),
    _case("surrogate-key", C, {"prompt": "hi", "\ud800": 1}, 400, "\\ud800"),
    _case("chat-surrogate-content", CHAT, {"messages": [{"role": "user", "content": "\ud83d"}]},
          400, "messages.0.content", "invalid Unicode"),
    _case("chat-surrogate-stream", CHAT, {"messages": [{"role": "user", "content": "\ud83d"}],
                                          "stream": True}, 400, "messages.0.content"),
    _case("chat-surrogate-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, 400, "messages.0.content.0.text"),
    _case("chat-surrogate-role", CHAT, {"messages": [{"role": "\ud800", "content": "x"}]}, 400,
          "messages.0.role"),
    _case("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    _case("invalid-utf8-chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, None),
    _case("body-too-large", C, {"prompt": "x" * 100_000}, 413, None, "max_body_bytes"),
    _case("unknown-route", "/v1/nope", {}, 404),
    _case("wrong-method", C, None, 405, method="GET"),
]


@pytest.mark.parametrize("method,path,body,status,param,contains", BAD_REQUESTS)
def test_bad_request_gets_openai_error(client: httpx.Client, method: str, path: str, body: Any,
                                       status: int, param: str | None, contains: str) -> None:
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()  # ASCII escapes: lone surrogates survive as "\ud800"
    if isinstance(body, bytes):
        resp = client.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        resp = client.request(method, path)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["param"] == param
    assert contains in error["message"]


def test_error_messages_do_not_echo_long_input(client: httpx.Client) -> None:
    from app.errors import MAX_MESSAGE_CHARS

    resp = client.post(C, json={"prompt": "hi", "stop": "y" * 40_000, "top_p": 0,
                                "model": "m" * 20_000})
    assert resp.status_code in (400, 404)
    message = resp.json()["error"]["message"]
    assert len(message) < MAX_MESSAGE_CHARS + 100 and "more characters" in message
    assert len(resp.content) < 2 * MAX_MESSAGE_CHARS


def test_streaming_request_errors_before_the_stream_starts(client: httpx.Client) -> None:
    """A refused streaming request is a plain 4xx JSON answer, not a 200 event stream."""
    resp = client.post(C, json={"prompt": "hi", "max_tokens": 5000, "stream": True})
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/json")
    assert "5000" in resp.json()["error"]["message"]


def test_server_healthy_after_bad_requests(client: httpx.Client, serve_app) -> None:  # noqa: ANN001
    for _, path, body, *_ in (p.values for p in BAD_REQUESTS[:12]):
        client.post(path, json=body) if not isinstance(body, bytes) else client.post(path, content=body)
    assert client.get("/health").status_code == 200
    ok = client.post(C, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert serve_app.load().num_running == 0
