"""Through real HTTP, the served text equals the engine's offline greedy text, streamed or not,
and a client that leaves mid-stream leaves no KV block in use."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from replicas.serving.startup_gc import GEN0_THRESHOLD

pytestmark = pytest.mark.serve

MAX_TOKENS = 12
PROMPT = "The quick brown fox jumps over the lazy dog. A serving system"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello, world! What time is it?"}]


def sse_events(lines: list[str]) -> list[Any]:
    """Parse `data: ...` lines; the `[DONE]` sentinel is kept as the string itself."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def stream_post(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return sse_events(list(resp.iter_lines()))


def test_health_and_models(client: httpx.Client, serve_app) -> None:  # noqa: ANN001
    health = client.get("/health").json()
    # This session's Serve runs no proxy door (the live door test starts one of its own).
    assert health["status"] == "ok" and health["proxy_door"] is None
    assert isinstance(health["niceness"], int)
    # the ingress froze its start-up objects and collects young objects seldom (startup_gc)
    assert health["gc"]["frozen"] > 10_000 and health["gc"]["threshold"][0] == GEN0_THRESHOLD
    # which forward path the replica runs, and nothing compiled (the CPU path compiles nothing)
    assert health["runner"] == {"path": "sdpa", "compiles_since_start": 0, "compiles_after_warmup": 0,
                                "fallback_error": None, "tensor_parallel_size": 1}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == serve_app.args.name and card["object"] == "model"
    assert card["max_model_len"] == 2048


def test_completion_equals_offline_greedy(client: httpx.Client, reference) -> None:  # noqa: ANN001
    body = {"model": "embedded:tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    data = client.post("/v1/completions", json=body).json()
    assert data["object"] == "text_completion"
    [choice] = data["choices"]
    assert choice["text"] == reference.greedy(PROMPT, MAX_TOKENS, ignore_eos=True)
    assert choice["finish_reason"] == "length"
    prompt_tokens = reference.num_tokens(PROMPT)
    usage = data["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # other tests send PROMPT too
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": MAX_TOKENS,
                     "total_tokens": prompt_tokens + MAX_TOKENS}
    assert 0 <= cached < prompt_tokens and cached % 16 == 0


def test_a_resent_prompt_reports_its_cached_tokens(client: httpx.Client) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens: the second time, every full block
    but the one holding the last token comes from the prefix cache."""
    prompt = [(7 * i) % 900 + 50 for i in range(100)]  # 100 ids no other test sends
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    first, second = (client.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}  # 6 blocks of 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_completion_stream_equals_offline_greedy(client: httpx.Client, reference) -> None:  # noqa: ANN001
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = stream_post(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == reference.greedy(PROMPT, MAX_TOKENS, ignore_eos=True)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS


def test_token_id_prompt_and_stop_string(client: httpx.Client, reference) -> None:  # noqa: ANN001
    ids = reference.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    full = reference.greedy(ids, MAX_TOKENS, ignore_eos=True)
    stop = full[4:7]  # a stop string the greedy output is certain to produce
    data = client.post("/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS,
                                                "temperature": 0, "ignore_eos": True,
                                                "stop": stop}).json()
    [choice] = data["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[:full.index(stop)]
    assert data["usage"]["prompt_tokens"] == len(ids)


def test_chat_equals_offline_greedy(client: httpx.Client, reference) -> None:  # noqa: ANN001
    expected = reference.greedy(reference.chat_ids(MESSAGES), MAX_TOKENS, ignore_eos=True)
    body = {"messages": MESSAGES, "max_completion_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    data = client.post("/v1/chat/completions", json=body).json()
    assert data["object"] == "chat.completion"
    [choice] = data["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert choice["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == len(reference.chat_ids(MESSAGES))
    assert data["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_stream_equals_offline_greedy(client: httpx.Client, reference) -> None:  # noqa: ANN001
    expected = reference.greedy(reference.chat_ids(MESSAGES), MAX_TOKENS, ignore_eos=True)
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = stream_post(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(d.get("content", "") for d in deltas) == expected


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": MESSAGES})])
def test_guidellm_streams_get_usage_on_every_chunk(client: httpx.Client, reference, path, body) -> None:  # noqa: ANN001
    """guidellm's request shape, raw: vLLM's continuous_usage_stats puts the usage so far on
    every chunk (prompt tokens throughout, completion tokens counting up), then the final one."""
    prompt_tokens = (reference.num_tokens(PROMPT) if path == "/v1/completions"
                     else len(reference.chat_ids(MESSAGES)))
    body = {**body, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = stream_post(client, path, body)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == MAX_TOKENS
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    if path == "/v1/chat/completions":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert completion[0] == 0
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == MAX_TOKENS


async def test_32_concurrent_streams(aclient: httpx.AsyncClient, reference) -> None:  # noqa: ANN001
    prompts = [f"Request number {i} asks the server for tokens" for i in range(32)]
    max_tokens = 8

    async def one(prompt: str) -> tuple[str, int, str]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with aclient.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = sse_events([line async for line in resp.aiter_lines()])
        assert events[-1] == "[DONE]"
        chunks = events[:-2]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        return text, events[-2]["usage"]["completion_tokens"], chunks[0]["id"]

    results = await asyncio.gather(*(one(p) for p in prompts))
    assert [count for _, count, _ in results] == [max_tokens] * 32
    assert len({rid for _, _, rid in results}) == 32
    # Chunks arrive in order: each stream's joined text is its own greedy continuation.
    expected = [reference.greedy(p, max_tokens, ignore_eos=True) for p in prompts]
    assert [text for text, _, _ in results] == expected


DISCONNECT_APP = "disconnect"
# The disconnect tests count the replica's finished requests, so they get a replica of their own
# (nothing else finishes there; a shared one's counts could lag an earlier test's by an export).
DISCONNECT_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-disconnect",
                       "num_cpus": 0.5, "ingress_num_cpus": 0.1}
FINISHED = "ray_stallfree_request_success_total"  # by finished_reason, from the replica


@dataclass
class Disconnect:
    """The disconnect app: its URL, a handle to its replica, the session's Ray metrics, and how
    many requests the tests sent it (each ends as one finished or aborted request)."""

    url: str
    llm: Any
    ray_serve: Any
    sent: int = 0

    async def running(self) -> int:
        return (await self.llm.load.remote()).num_running

    async def idle(self) -> Any:
        load = await self.llm.load.remote()
        free = load.free_blocks == load.total_blocks
        return load if load.num_running == load.num_waiting == 0 and free else None

    def finished(self) -> tuple[float, float] | None:
        """(aborted, run to length) requests of this app, once the export counts every request
        sent here (each process exports about every second, so a scrape can lag); else None."""
        now = self.ray_serve.scrape()
        if now.total(FINISHED, application=DISCONNECT_APP) != self.sent:
            return None
        return tuple(now.total(FINISHED, application=DISCONNECT_APP, finished_reason=reason)
                     for reason in ("abort", "length"))

    async def counted(self, await_until: Any) -> tuple[float, float]:
        return await await_until(self.finished, interval_s=0.5, what="every request sent counted")


@pytest.fixture(scope="module")
def disconnect(extra_app, ray_serve) -> Iterator[Disconnect]:  # noqa: ANN001 - tests/conftest.py
    from ray import serve

    with extra_app(DISCONNECT_APP, DISCONNECT_APP_ARGS) as url:
        yield Disconnect(url, serve.get_deployment_handle("LLMServer", app_name=DISCONNECT_APP), ray_serve)


async def test_disconnect_mid_stream_frees_kv_blocks(disconnect: Disconnect, await_until) -> None:  # noqa: ANN001
    aborted, finished = await disconnect.counted(await_until)
    body = {"prompt": [7] * 8, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=disconnect.url, timeout=120) as client:
        disconnect.sent += 1
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            received = 0
            async for line in resp.aiter_lines():
                received += line.startswith("data: ")
                if received == 3:  # leaving the loop disconnects mid-stream
                    break
    await await_until(disconnect.idle, what="the stream's KV blocks freed")
    # Aborted, not run to its 1500 tokens: the replica counts one abort and no finish.
    assert await disconnect.counted(await_until) == (aborted + 1, finished)


async def test_disconnect_while_waiting_for_a_whole_completion(disconnect: Disconnect, await_until) -> None:  # noqa: ANN001
    aborted, finished = await disconnect.counted(await_until)
    body = {"prompt": [7] * 8, "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=disconnect.url, timeout=120) as client:
        disconnect.sent += 1
        post = asyncio.create_task(client.post("/v1/completions", json=body))
        await await_until(lambda: disconnect.running(), what="the completion running")
        post.cancel()  # the client gives up and closes the connection
        with pytest.raises(asyncio.CancelledError):
            await post
    await await_until(disconnect.idle, what="the completion's KV blocks freed")
    assert await disconnect.counted(await_until) == (aborted + 1, finished)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_mistake_never_breaks_the_next_request(client: httpx.Client, path: str) -> None:
    bad = client.post(path, json={"prompt": "", "messages": [], "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    good = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post(path, json=good).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_in_openais_shape(client: httpx.Client, reference, stream) -> None:  # noqa: ANN001
    """lm-eval's and the SDK's shape: parallel lists, the greedy token first among its top-3,
    offsets into the generated text; the same numbers streamed or whole."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3,
            "stream": stream}
    if stream:
        chunks = stream_post(client, "/v1/completions", body)[:-1]
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                            "text_offset")}
    else:
        lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 3 and value <= 0 and max(top.values()) == pytest.approx(value)
        assert token in top
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_in_openais_shape(client: httpx.Client, reference, stream) -> None:  # noqa: ANN001
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2, "stream": stream}
    if stream:
        chunks = stream_post(client, "/v1/chat/completions", body)[:-1]
        content = [x for c in chunks if c["choices"][0].get("logprobs") for x in c["choices"][0]["logprobs"]["content"]]
    else:
        content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])


SAMPLING_CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": 1.25, "repetition_penalty": 1.3,
                     "logit_bias": {"60": 4.0, "9": -100}, "min_tokens": 3}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_controls_equal_the_engines_offline(client: httpx.Client, reference, path) -> None:  # noqa: ANN001
    """Penalties, logit_bias (JSON keys are strings) and min_tokens reach the engine as given:
    the greedy text equals the offline engine's with the same parameters, not the plain one."""
    prompt = PROMPT if path == "/v1/completions" else reference.chat_ids(MESSAGES)
    controls = {**SAMPLING_CONTROLS, "logit_bias": {int(k): v for k, v in SAMPLING_CONTROLS["logit_bias"].items()}}
    expected = reference.greedy(prompt, MAX_TOKENS, ignore_eos=True, **controls)
    assert expected != reference.greedy(prompt, MAX_TOKENS, ignore_eos=True)
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **SAMPLING_CONTROLS}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})
    data = client.post(path, json=body).json()
    [choice] = data["choices"]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert text == expected and data["usage"]["completion_tokens"] == MAX_TOKENS
