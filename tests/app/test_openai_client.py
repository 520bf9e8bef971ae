"""The real `openai` package talks to the server: completions, chat, streaming, models, errors."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

pytestmark = pytest.mark.serve

MAX_TOKENS = 6


@pytest.fixture
def oai(serve_app) -> Iterator[openai.OpenAI]:  # noqa: ANN001
    with openai.OpenAI(base_url=f"{serve_app.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_list(oai: openai.OpenAI, serve_app) -> None:  # noqa: ANN001
    assert [m.id for m in oai.models.list()] == [serve_app.args.name]


def test_completion(oai: openai.OpenAI, reference) -> None:  # noqa: ANN001
    out = oai.completions.create(model="embedded:tiny", prompt="Once upon a time",
                                 max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference.greedy("Once upon a time", MAX_TOKENS, ignore_eos=True)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == MAX_TOKENS


def test_completion_stream(oai: openai.OpenAI, reference) -> None:  # noqa: ANN001
    stream = oai.completions.create(model="embedded:tiny", prompt="Once upon a time",
                                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                    stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference.greedy("Once upon a time", MAX_TOKENS, ignore_eos=True)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat(oai: openai.OpenAI, reference) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Good software is measured"}]
    out = oai.chat.completions.create(model="embedded:tiny", messages=messages,  # type: ignore[arg-type]
                                      max_completion_tokens=MAX_TOKENS, temperature=0, seed=1,
                                      extra_body={"ignore_eos": True, "priority": -5})
    expected = reference.greedy(reference.chat_ids(messages), MAX_TOKENS, ignore_eos=True)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.usage is not None and out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_chat_stream(oai: openai.OpenAI, reference) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    stream = oai.chat.completions.create(model="embedded:tiny", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == reference.greedy(reference.chat_ids(messages), MAX_TOKENS, ignore_eos=True)


def test_errors_raise_typed_exceptions(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="embedded:tiny", prompt="hi", max_tokens=4096)
    assert "maximum context length is 2048" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_completion_with_echo_penalties_and_logit_bias(oai: openai.OpenAI, reference) -> None:  # noqa: ANN001
    """The SDK's own fields (echo, logprobs, presence/frequency penalties, logit_bias) and the
    vLLM extensions through extra_body reach the engine; the echoed prompt's first token has no
    logprob."""
    prompt = "Once upon a time"
    out = oai.completions.create(model="embedded:tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                 echo=True, logprobs=2, presence_penalty=0.5, frequency_penalty=1.0,
                                 logit_bias={"60": 3.0}, extra_body={"ignore_eos": True, "min_tokens": 2,
                                                                     "repetition_penalty": 1.2})
    choice = out.choices[0]
    expected = reference.greedy(prompt, MAX_TOKENS, ignore_eos=True, presence_penalty=0.5, frequency_penalty=1.0,
                                logit_bias={60: 3.0}, min_tokens=2, repetition_penalty=1.2)
    assert choice.text == prompt + expected
    n = reference.num_tokens(prompt)
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == n + MAX_TOKENS
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    assert out.usage is not None and out.usage.prompt_tokens == n and out.usage.completion_tokens == MAX_TOKENS
