"""The real model (SmolLM2-135M-Instruct) served over HTTP answers as the model itself does:
a chat answer is HF's greedy text under the model's own chat template; prompt logprobs (the
request lm-eval sends) equal HF's log_softmax within 1e-4 over real text, chunked or not; a
multiple-choice set scored through the API as lm-eval scores it picks what HF picks; a JSON
schema and a forced tool call come back as valid JSON; a seed reproduces a sample.

The server runs the model in a replica; HF runs it here, in this process, as the reference."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
import torch

from replicas.loading.models import load_model
from tests.support.multiple_choice import MULTIPLE_CHOICE, encode_pairs, mc_accuracy, mc_picks, score_hf, score_http
from tests.support.real_text import PASSAGES

pytestmark = pytest.mark.real_model

MODEL, SERVED = "embedded:smollm2", "embedded-smollm2"
APP_ARGS = {"model": MODEL, "num_cpus": 1, "ingress_num_cpus": 0.1,
            "engine": {"max_batch_prefill_tokens": 256, "max_batch_total_tokens": 4096, "max_num_seqs": 16}}
LOGPROB_TOL = 1e-4
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


@pytest.fixture(scope="module")
def url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app("smol", APP_ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def hf():
    return load_model(MODEL)


def chat(url: str, body: dict) -> dict:
    resp = httpx.post(f"{url}/v1/chat/completions", json={"model": SERVED, **body}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_chat_answer_is_hf_greedy_under_the_models_template(url: str, hf) -> None:
    from openai import OpenAI

    question = "What is the capital of France? Answer in one sentence."
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300)
    answer = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": question}],
                                            max_tokens=40, temperature=0)
    model, tok = hf
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert answer.choices[0].message.content == expected == "The capital of France is Paris."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("text", [PASSAGES[0], "\n\n".join(PASSAGES)], ids=["one-pass", "chunked"])
def test_prompt_logprobs_equal_hf_log_softmax(url: str, hf, text: str) -> None:
    model, tok = hf
    ids = tok.encode(text, add_special_tokens=False)
    resp = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": SERVED, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0})
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    worst = max(abs(a - b) for a, b in zip(got[1:], expected))
    print(f"{len(ids)} prompt tokens: largest |server - HF| logprob difference {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_multiple_choice_through_the_api_picks_what_hf_picks(url: str, hf) -> None:
    model, tok = hf
    pairs = encode_pairs(tok, MULTIPLE_CHOICE)
    served, ref = score_http(url, SERVED, pairs), score_hf(model, pairs)
    assert max(abs(a - b) for a, b in zip(served, ref)) < LOGPROB_TOL * 10  # sums of a few tokens
    http_picks, hf_picks = mc_picks(MULTIPLE_CHOICE, served), mc_picks(MULTIPLE_CHOICE, ref)
    accuracy = mc_accuracy(MULTIPLE_CHOICE, http_picks)
    print(f"multiple choice ({len(MULTIPLE_CHOICE)} items): {accuracy:.0%} through the server, "
          f"{mc_accuracy(MULTIPLE_CHOICE, hf_picks):.0%} with HF")
    assert http_picks == hf_picks
    assert accuracy >= 0.5  # four options: chance is 25%; a model answering at random fails this


def test_a_json_schema_answer_is_valid_json(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Give the capital of France as JSON with keys city and country."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
            "max_tokens": 64, "temperature": 0}
    value = json.loads(chat(url, body)["choices"][0]["message"]["content"])
    jsonschema.validate(value, CITY)
    assert value["city"] == "Paris"


def test_a_forced_tool_call_has_valid_json_arguments(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 64, "temperature": 0}
    choice = chat(url, body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_a_seed_reproduces_a_sample(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 24,
            "temperature": 0.9, "top_p": 0.95}
    texts = [chat(url, {**body, "seed": s})["choices"][0]["message"]["content"] for s in (11, 11, 12)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
