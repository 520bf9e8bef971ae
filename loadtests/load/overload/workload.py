"""The overload test's request bodies: random-word prompts of a calibrated length, the soak's
mix, and the workloads a run can load the server with (`WORKLOADS`):

- `uniform`: every prompt `--prompt-tokens` long, every output `--max-tokens`.
- `short-output`: chat-like short answers (96 tokens) to short prompts (128 tokens), a tenth of
  the prompts 1,024-1,536 tokens long as in the load tests' mix: many requests finish quickly,
  so admission and the door see a high request rate, and the long prompts still cost prefill.
"""

from __future__ import annotations

import json

import numpy as np

from loadtests.load.overload.records import ReqSpec

# Plain words for prompts; the warm-up measures how many tokens a word is for the served model.
WORDS = tuple(
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city name team minute idea kid body back parent face level office door "
    "health person art war history party result change morning reason research girl guy moment "
    "air teacher force education".split())
WORKLOADS = ("uniform", "short-output")
# Each workload's prompt and output tokens where the command line does not say (--prompt-tokens,
# --max-tokens), and the share of long prompts with their length range in tokens.
WORKLOAD_DEFAULTS = {"uniform": {"prompt_tokens": 64, "max_tokens": 64},
                     "short-output": {"prompt_tokens": 128, "max_tokens": 96}}
LONG_SHARE = {"uniform": 0.0, "short-output": 0.1}
LONG_TOKENS = (1024, 1536)


def random_text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), max(1, n_words)))


def completion_spec(model: str, prompt: str, max_tokens: int, stream: bool = True,
                    kind: str = "cmpl") -> ReqSpec:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "temperature": 0}
    return ReqSpec("/v1/completions", json.dumps(body).encode(), stream, kind)


def chat_spec(model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool,
              kind: str = "chat") -> ReqSpec:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "temperature": 0}
    return ReqSpec("/v1/chat/completions", json.dumps(body).encode(), stream, kind)


def uniform_specs(rng: np.random.Generator, n: int, model: str, words: int,
                  max_tokens: int) -> list[ReqSpec]:
    """`n` streaming completions, each its own random prompt of `words` words."""
    return [completion_spec(model, random_text(rng, words), max_tokens) for _ in range(n)]


def load_specs(workload: str, rng: np.random.Generator, n: int, model: str, words: int,
               max_tokens: int, words_per_token: float) -> list[ReqSpec]:
    """`n` streaming completions of `workload` (see the module doc): prompts of `words` words,
    the workload's share of them 1,024-1,536 tokens long instead (kind "cmpl-long")."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if not LONG_SHARE[workload]:
        return uniform_specs(rng, n, model, words, max_tokens)
    specs = []
    for _ in range(n):
        if rng.random() < LONG_SHARE[workload]:
            tokens = int(rng.integers(LONG_TOKENS[0], LONG_TOKENS[1] + 1))
            long_words = max(1, round(tokens * words_per_token))
            specs.append(completion_spec(model, random_text(rng, long_words), max_tokens, kind="cmpl-long"))
        else:
            specs.append(completion_spec(model, random_text(rng, words), max_tokens))
    return specs


def soak_spec(rng: np.random.Generator, model: str, words_per_token: float) -> ReqSpec:
    """One request of the soak mix: 80% short / 20% long prompts, 70% short / 30% long outputs,
    half streaming, half chat (a third of the chats with three turns)."""
    long_prompt = rng.random() < 0.2
    tokens = int(rng.integers(512, 1025) if long_prompt else rng.integers(16, 193))
    words = max(1, round(tokens * words_per_token))
    max_tokens = int(rng.integers(128, 257) if rng.random() < 0.3 else rng.integers(8, 65))
    stream = bool(rng.random() < 0.5)
    label = f"{'long' if long_prompt else 'short'}-{'stream' if stream else 'whole'}"
    if rng.random() < 0.5:
        return completion_spec(model, random_text(rng, words), max_tokens, stream, f"cmpl-{label}")
    if rng.random() < 1 / 3:
        third = max(1, words // 3)
        messages = [{"role": "user", "content": random_text(rng, third)},
                    {"role": "assistant", "content": random_text(rng, third)},
                    {"role": "user", "content": random_text(rng, third)}]
    else:
        messages = [{"role": "user", "content": random_text(rng, words)}]
    return chat_spec(model, messages, max_tokens, stream, f"chat-{label}")
