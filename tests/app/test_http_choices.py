"""`n` samples and batched prompts over real HTTP: one choice per (prompt, sample) with index
p * n + j, each equal to the offline engine's answer for that prompt and seed, usage summed
(each prompt's tokens once), streamed chunks that join to the whole answer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from replicas import SamplingParams

pytestmark = pytest.mark.serve

C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["The quick brown fox", "A serving system on Ray Serve"]


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True,
                                           "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, resp.read()
        data = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def offline(reference, prompt: str | list[int], n: int = 1, **params: Any) -> list[str]:  # noqa: ANN001
    sp = SamplingParams(n=n, ignore_eos=True, **params)
    return [o.text for o in reference.engine.generate([prompt], sp)]


def test_n_greedy_choices_are_the_greedy_answer_and_count_the_prompt_once(client: httpx.Client, reference) -> None:  # noqa: ANN001
    body = {"prompt": PROMPTS[0], "n": 3, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    data = client.post(C, json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == offline(reference, PROMPTS[0], 3, max_tokens=6, temperature=0)
    usage = data["usage"]
    assert usage["prompt_tokens"] == reference.num_tokens(PROMPTS[0]) and usage["completion_tokens"] == 18


def test_batched_prompts_with_seeded_samples(client: httpx.Client, reference) -> None:  # noqa: ANN001
    """lm-eval and the SDK send `prompt` as a list; choice p * n + j is sample j (seed + j) of
    prompt p, the same text the engine gives that prompt alone."""
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    data = client.post(C, json=body).json()
    expected = [t for p in PROMPTS for t in offline(reference, p, 2, max_tokens=8, temperature=1.0, seed=5)]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in data["choices"]] == expected
    assert data["usage"]["prompt_tokens"] == sum(reference.num_tokens(p) for p in PROMPTS)
    assert data["usage"]["completion_tokens"] == 4 * 8
    events = stream(client, C, body)
    texts: dict[int, str] = {}
    for e in events[:-1]:
        [choice] = e["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(4)] == expected
    assert events[-1]["choices"] == [] and events[-1]["usage"] == data["usage"]


def test_lm_eval_batched_token_prompts_with_echo_and_logprobs(client: httpx.Client, reference) -> None:  # noqa: ANN001
    tok = reference.engine.tokenizer
    batch = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    data = client.post(C, json={"prompt": batch, "echo": True, "logprobs": 1, "max_tokens": 0,
                                "temperature": 0}).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for ids, choice in zip(batch, data["choices"]):
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert data["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)
    assert data["usage"]["completion_tokens"] == 0


def test_chat_n_choices_streamed_and_whole(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Hello!"}], "n": 2, "max_tokens": 5,
            "temperature": 1.0, "seed": 11, "ignore_eos": True}
    data = client.post(CHAT, json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["completion_tokens"] == 10
    events = stream(client, CHAT, body)
    content: dict[int, str] = {}
    roles = []
    for e in events[:-1]:
        [choice] = e["choices"]
        if choice["delta"].get("role"):
            roles.append(choice["index"])
        content[choice["index"]] = content.get(choice["index"], "") + choice["delta"].get("content", "")
    assert sorted(roles) == [0, 1]  # each choice opens with its role chunk
    assert [content[i] for i in range(2)] == [c["message"]["content"] for c in data["choices"]]
