"""Echo over raw HTTP, in the shapes lm-eval and OpenAI clients send: the prompt comes back in
front of the completion, and with `logprobs` every prompt token carries log_softmax of HF's own
forward over the same sequence (the first one null) with the true top alternatives; max_tokens 0
returns only the scored prompt; a stream carries the prompt in its first chunk."""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

import httpx
import pytest
import torch

from replicas import SamplingParams

pytestmark = pytest.mark.serve

C = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog. A serving system"
TOL = 2e-5  # fp32: the packed, chunked forward against HF's plain one


def hf_log_softmax(reference, ids: list[int]) -> torch.Tensor:  # noqa: ANN001 - tests/app/conftest.py
    with torch.inference_mode():
        return torch.log_softmax(reference.engine.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def token_text(reference, token_id: int) -> str:  # noqa: ANN001
    return reference.engine.tokenizer.decode([token_id], skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)


def lm_eval_parse(choices: list[dict[str, Any]], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads the response."""
    res = []
    for choice, ctxlen in zip(sorted(choices, key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def assert_scored_prompt(reference, ids: list[int], lp: dict[str, list], k: int) -> None:  # noqa: ANN001
    """The first len(ids) entries: each prompt token, its HF logprob (null for the first) and the
    true top-k alternatives by text."""
    ref = hf_log_softmax(reference, ids)
    n = len(ids)
    assert lp["tokens"][:n] == [token_text(reference, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        row = ref[i - 1]
        assert lp["token_logprobs"][i] == pytest.approx(row[ids[i]].item(), abs=TOL)
        values, top_ids = row.topk(k)
        top = lp["top_logprobs"][i]
        assert list(top) == [token_text(reference, t) for t in top_ids.tolist()]
        assert list(top.values()) == pytest.approx(values.tolist(), abs=TOL)


def streamed(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a streamed completion, [DONE] checked and dropped."""
    with client.stream("POST", C, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_offsets(lp: dict[str, list]) -> None:
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert offsets[0] == 0 and len(offsets) == len(tokens)
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens))


@pytest.mark.parametrize("continuation", ["given", "greedy"])
def test_lm_eval_loglikelihood_request(client: httpx.Client, reference, serve_app, continuation) -> None:  # noqa: ANN001
    """lm-eval's request, raw: token ids in a list (its batch), echo, logprobs 1, max_tokens 1,
    temperature 0, seed. Its parser's loglikelihood and is_greedy equal HF's (a continuation the
    model would pick greedily reads as greedy)."""
    tok, engine = reference.engine.tokenizer, reference.engine
    ctx = tok.encode("Question: what jumps over the lazy dog? Answer:", add_special_tokens=False)
    if continuation == "given":
        cont = tok.encode(" the quick brown fox", add_special_tokens=False)
    else:
        cont = engine.generate([ctx], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids
    ids = ctx + cont
    body = {"model": serve_app.args.name, "prompt": [ids], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    data = client.post(C, json=body).json()
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    # Prompt logprobs skip the prefix cache (the prompt's rows must run): nothing is cached.
    assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert_scored_prompt(reference, ids, lp, 1)
    assert_offsets(lp)
    generated = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert choice["text"] == tok.decode(ids, skip_special_tokens=False) + generated.text
    ref = hf_log_softmax(reference, ids + generated.token_ids)
    assert lp["token_logprobs"][-1] == pytest.approx(ref[len(ids) - 1, generated.token_ids[0]].item(), abs=TOL)
    [(loglikelihood, is_greedy)] = lm_eval_parse(data["choices"], [len(ctx)])
    positions = range(len(ctx) - 1, len(ids) - 1)  # the logits before each continuation token
    assert loglikelihood == pytest.approx(sum(ref[p, ids[p + 1]].item() for p in positions), abs=1e-4)
    assert is_greedy == all(int(ref[p].argmax()) == ids[p + 1] for p in positions)
    assert is_greedy == (continuation == "greedy")


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_max_tokens_zero_returns_only_the_scored_prompt(client: httpx.Client, reference, prompt_kind) -> None:  # noqa: ANN001
    tok = reference.engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False)
    prompt = PROMPT if prompt_kind == "text" else ids
    data = client.post(C, json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3}).json()
    [choice] = data["choices"]
    assert choice["text"] == (PROMPT if prompt_kind == "text" else tok.decode(ids, skip_special_tokens=False))
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert_scored_prompt(reference, ids, lp, 3)
    assert_offsets(lp)


def test_echo_without_logprobs_puts_the_prompt_in_front(client: httpx.Client, reference) -> None:  # noqa: ANN001
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True}
    [choice] = client.post(C, json=body).json()["choices"]
    assert choice["text"] == PROMPT + reference.greedy(PROMPT, 6, ignore_eos=True)
    assert choice["logprobs"] is None
    only = client.post(C, json={**body, "max_tokens": 0}).json()
    assert only["choices"][0]["text"] == PROMPT and only["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_carries_the_prompt_in_its_first_chunk(client: httpx.Client, reference, max_tokens) -> None:  # noqa: ANN001
    """The chunks join to the whole answer: text, tokens, logprobs and continuous offsets."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 2}
    whole = client.post(C, json=body).json()["choices"][0]
    events = streamed(client, {**body, "stream_options": {"include_usage": True}})
    chunks, usage = [e["choices"][0] for e in events[:-1]], events[-1]["usage"]
    assert chunks[0]["text"].startswith(PROMPT)
    assert len(chunks[0]["logprobs"]["tokens"]) >= reference.num_tokens(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == "length" and usage["completion_tokens"] == max_tokens
    joined = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in whole["logprobs"]}
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None and joined["top_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert len(joined["tokens"]) == reference.num_tokens(PROMPT) + max_tokens
