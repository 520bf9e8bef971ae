"""Fixed-seed workload generators shared by the engine benchmark, Locust, the sweep and the simulator.

A workload is a list of requests, each with prompt token ids, an exact output length
(`max_tokens`, run with `ignore_eos`) and an arrival offset in seconds from the start of
the run. Everything derives from one seed, so every system in a benchmark sees the same
prompts, the same lengths and the same arrival schedule.

- `chat_workload`: ShareGPT-like heavy-tailed prompt and output lengths (clipped lognormal
  by default), all arriving at t=0 (offline throughput) unless a Poisson rate is given.
- `long_prompt_workload`: short requests all decoding, while a few long prompts arrive at
  intervals: the case where a prefill-first scheduler stalls every running stream.
- `long_context_workload`: a few long-context requests decoding beside many short ones, all at
  t=0: the case where decode attention padded to the longest context costs what it should not.
- `shared_prefix_workload`: one long system prompt in front of every short user turn, all at
  t=0: what a prefix cache computes once.
- `multi_turn_conversations`: conversations whose every turn resends the whole history (system
  prompt, earlier turns and answers) plus a new user message; driven closed-loop.
- `with_poisson_arrivals`: a workload re-timed as open-loop Poisson arrivals (`loadtests.harness.arrivals`).

Prompts are random token ids by default: lengths are exact and nothing is shared, which is all a
random-weight test model (embedded:tiny, embedded:mid) can use. A real model gets real prompts:
`ChatPromptPool` holds chat-templated prompts in the model's own template
(`tests/support/real_text.chat_prompts`: short questions and passage tasks), and
`with_chat_prompts` puts them in place of a workload's random ones, keeping every request's id,
arrival and output length (still exact, run with `ignore_eos`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from loadtests.harness.arrivals import poisson
from tests.support.real_text import LONG_FRACTION, chat_prompts
from loadtests.harness.stats import percentile
from replicas.loading.model_files import EMBEDDED_MODELS, EMBEDDED_PREFIX, load_tokenizer

DistKind = Literal["lognormal", "pareto", "uniform", "fixed"]


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, clipped to [lo, hi].

    lognormal: `median` and `sigma` (of the underlying normal); p99/p50 = exp(2.326 sigma).
    pareto: scale `median / 2**(1/alpha)` so the median is `median`; tail index `alpha`.
    uniform: integers in [lo, hi]. fixed: always `median`.
    """

    kind: DistKind
    median: float
    lo: int
    hi: int
    sigma: float = 1.0
    alpha: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "pareto", "uniform", "fixed"):
            raise ValueError(f"kind must be lognormal|pareto|uniform|fixed, got {self.kind!r}")
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"need 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")
        if self.median <= 0 or self.sigma <= 0 or self.alpha <= 0:
            raise ValueError("median, sigma and alpha must be > 0")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` integer lengths in [lo, hi]."""
        if self.kind == "lognormal":
            x = rng.lognormal(math.log(self.median), self.sigma, n)
        elif self.kind == "pareto":
            scale = self.median / 2 ** (1 / self.alpha)
            x = scale * (1.0 + rng.pareto(self.alpha, n))  # classic Pareto with x_min = scale
        elif self.kind == "uniform":
            x = rng.integers(self.lo, self.hi + 1, n).astype(float)
        else:
            x = np.full(n, float(self.median))
        return [int(v) for v in np.clip(np.rint(x), self.lo, self.hi)]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: what to send, how many tokens to generate, when (seconds from start)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    kind: str = "default"  # a label for per-class metrics ("short", "long", ...)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def total_len(self) -> int:
        """KV tokens this request needs at its end: prompt + output."""
        return self.prompt_len + self.max_tokens


@dataclass(frozen=True)
class Workload:
    """A named list of requests, ordered by arrival, plus the settings that made it."""

    name: str
    requests: list[WorkloadRequest]
    seed: int
    settings: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    @property
    def max_total_len(self) -> int:
        return max(r.total_len for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Arrival offset of the last request."""
        return max((r.arrival_s for r in self.requests), default=0.0)

    def summary(self) -> dict:
        """Sizes as plain numbers, for table headers and JSON."""
        p, o = np.array(self.prompt_lens), np.array(self.output_lens)
        return {
            "name": self.name, "seed": self.seed, "num_requests": len(self),
            "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
            "prompt_len_p50": float(percentile(self.prompt_lens, 50)), "prompt_len_max": int(p.max()),
            "output_len_p50": float(percentile(self.output_lens, 50)), "output_len_max": int(o.max()),
            "max_total_len": self.max_total_len, "last_arrival_s": round(self.duration_s, 3),
            "settings": self.settings,
        }

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "settings": self.settings,
                "requests": [dataclasses.asdict(r) for r in self.requests]}

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        return cls(d["name"], [WorkloadRequest(**r) for r in d["requests"]], d["seed"],
                   d.get("settings", {}))


# ---- building blocks ------------------------------------------------------------------


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int,
                  avoid_ids: Iterable[int] = ()) -> list[int]:
    """`length` uniform random token ids in [0, vocab_size), none of them in `avoid_ids`."""
    avoid = np.array(sorted(set(avoid_ids)), dtype=np.int64)
    allowed = vocab_size - len(avoid)
    if allowed <= 0:
        raise ValueError("avoid_ids leaves no token to draw")
    x = rng.integers(0, allowed, length)
    # Map [0, allowed) onto the ids not avoided: shift each draw past the avoided ids below it.
    for a in avoid:
        x = x + (x >= a)
    return [int(t) for t in x]


def with_poisson_arrivals(workload: Workload, rate: float, seed: int | None = None,
                          name: str | None = None) -> Workload:
    """The same requests re-timed as a Poisson process (the first arrives after one gap),
    named `name` (default: the workload's own name)."""
    rng = np.random.default_rng(workload.seed if seed is None else seed)
    times = poisson(rng, len(workload), rate).tolist()
    reqs = [dataclasses.replace(r, arrival_s=t) for r, t in zip(workload.requests, times)]
    return Workload(name or workload.name, reqs, workload.seed,
                    {**workload.settings, "poisson_rate": rate})


def _requests(rng: np.random.Generator, kind: str, prompt_lens: list[int], output_lens: Sequence[int],
              arrivals: Sequence[float], vocab_size: int, avoid_ids: Sequence[int]) -> list[WorkloadRequest]:
    """Requests `{kind}-0`, `{kind}-1`, ... with random prompts of the given lengths."""
    return [WorkloadRequest(f"{kind}-{i}", random_prompt(rng, p, vocab_size, avoid_ids), o, t, kind)
            for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals))]


# ---- workloads ----------------------------------------------------------------------

# ShareGPT conversations have prompts and answers of a few hundred tokens with long tails;
# scaled down here so a 2-core CPU runs a meaningful batch in seconds.
CHAT_PROMPT = LengthDist("lognormal", median=128, sigma=0.9, lo=8, hi=1024)
CHAT_OUTPUT = LengthDist("lognormal", median=64, sigma=0.9, lo=4, hi=512)


def chat_workload(num_requests: int, vocab_size: int, seed: int = 0, *,
                  prompt: LengthDist = CHAT_PROMPT, output: LengthDist = CHAT_OUTPUT,
                  rate: float | None = None, avoid_ids: Sequence[int] = ()) -> Workload:
    """Mixed heavy-tailed prompt/output lengths; all at t=0, or Poisson at `rate` req/s."""
    rng = np.random.default_rng(seed)
    plens, olens = prompt.sample(rng, num_requests), output.sample(rng, num_requests)
    prompts = [random_prompt(rng, n, vocab_size, avoid_ids) for n in plens]
    times = poisson(rng, num_requests, rate).tolist() if rate else [0.0] * num_requests
    reqs = [WorkloadRequest(f"chat-{i}", p, o, t, "chat")
            for i, (p, o, t) in enumerate(zip(prompts, olens, times))]
    settings = {"prompt": dataclasses.asdict(prompt), "output": dataclasses.asdict(output),
                "rate": rate}
    return Workload("chat", reqs, seed, settings)


def long_prompt_workload(vocab_size: int, seed: int = 0, *, num_short: int = 16,
                         short_prompt: LengthDist = LengthDist("lognormal", 64, 32, 128, sigma=0.25),
                         short_output: LengthDist = LengthDist("lognormal", 128, 96, 192, sigma=0.15),
                         num_long: int = 4,
                         long_prompt: LengthDist = LengthDist("uniform", 1750, 1500, 2000),
                         long_output: int = 16, first_long_s: float = 0.5,
                         long_interval_s: float = 1.0,
                         avoid_ids: Sequence[int] = ()) -> Workload:
    """`num_short` short requests at t=0, then `num_long` long prompts every `long_interval_s`.

    The long prompts arrive while the short ones decode; a scheduler that prefills a whole
    prompt in a pass of its own pauses every short stream for that pass.
    """
    rng = np.random.default_rng(seed)
    s_p, s_o = short_prompt.sample(rng, num_short), short_output.sample(rng, num_short)
    l_p = long_prompt.sample(rng, num_long)
    reqs = _requests(rng, "short", s_p, s_o, [0.0] * num_short, vocab_size, avoid_ids)
    reqs += _requests(rng, "long", l_p, [long_output] * num_long,
                      [first_long_s + i * long_interval_s for i in range(num_long)], vocab_size, avoid_ids)
    settings = {"short_prompt": dataclasses.asdict(short_prompt),
                "short_output": dataclasses.asdict(short_output),
                "long_prompt": dataclasses.asdict(long_prompt), "long_output": long_output,
                "first_long_s": first_long_s, "long_interval_s": long_interval_s}
    return Workload("long_prompt", reqs, seed, settings)


def long_context_workload(vocab_size: int, seed: int = 0, *, num_long: int = 2, num_short: int = 32,
                          long_prompt: LengthDist = LengthDist("uniform", 1700, 1500, 1900),
                          long_output: int = 128,
                          short_prompt: LengthDist = LengthDist("uniform", 96, 64, 128),
                          short_output: LengthDist = LengthDist("uniform", 96, 64, 128),
                          avoid_ids: Sequence[int] = ()) -> Workload:
    """`num_long` long-context requests, then `num_short` short ones, all at t=0.

    After the prefills most passes decode the few long contexts beside many short ones: the KV
    the batch really holds is ~num_long x 1800 + num_short x (at most 256) tokens, while decode
    attention padded to the longest context reads (num_long + num_short) x ~1800. The long prompts stop
    at 1900 so prompt + output fits a 2048-position model (embedded:tiny as well).
    """
    rng = np.random.default_rng(seed)
    l_p = long_prompt.sample(rng, num_long)
    s_p, s_o = short_prompt.sample(rng, num_short), short_output.sample(rng, num_short)
    reqs = _requests(rng, "long", l_p, [long_output] * num_long, [0.0] * num_long, vocab_size, avoid_ids)
    reqs += _requests(rng, "short", s_p, s_o, [0.0] * num_short, vocab_size, avoid_ids)
    settings = {"long_prompt": dataclasses.asdict(long_prompt), "long_output": long_output,
                "short_prompt": dataclasses.asdict(short_prompt),
                "short_output": dataclasses.asdict(short_output)}
    return Workload("long_context", reqs, seed, settings)


def shared_prefix_workload(vocab_size: int, seed: int = 0, *, num_requests: int = 48,
                           system_tokens: int = 1024,
                           user: LengthDist = LengthDist("uniform", 50, 20, 80), output: int = 32,
                           avoid_ids: Sequence[int] = ()) -> Workload:
    """`num_requests` prompts = the same `system_tokens`-token system prompt + a short user turn."""
    rng = np.random.default_rng(seed)
    system = random_prompt(rng, system_tokens, vocab_size, avoid_ids)
    reqs = [WorkloadRequest(f"shared-{i}", system + random_prompt(rng, n, vocab_size, avoid_ids), output, 0.0, "shared")
            for i, n in enumerate(user.sample(rng, num_requests))]
    settings = {"system_tokens": system_tokens, "user": dataclasses.asdict(user), "output": output}
    return Workload("shared_system_prompt", reqs, seed, settings)


@dataclass(frozen=True)
class Conversation:
    """A system prompt and the user messages of each turn, with each answer's length."""

    conversation_id: str
    system: list[int]
    turns: list[tuple[list[int], int]]  # (user message ids, max_tokens of the answer)

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """Turn `turn`'s prompt: the system prompt, every earlier message and answer, its own."""
        ids = list(self.system)
        for (user, _), answer in zip(self.turns[:turn], answers):
            ids += user + list(answer)
        return ids + self.turns[turn][0]


def multi_turn_conversations(vocab_size: int, seed: int = 0, *, num_conversations: int = 8,
                             num_turns: int = 4, system_tokens: int = 256,
                             user: LengthDist = LengthDist("uniform", 60, 40, 80),
                             output: int = 48, avoid_ids: Sequence[int] = ()) -> list[Conversation]:
    """Conversations with their own system prompt (distinct ones: only each conversation's own
    history repeats) and `num_turns` user messages each."""
    rng = np.random.default_rng(seed)
    out = []
    for c in range(num_conversations):
        system = random_prompt(rng, system_tokens, vocab_size, avoid_ids)
        turns = [(random_prompt(rng, n, vocab_size, avoid_ids), output) for n in user.sample(rng, num_turns)]
        out.append(Conversation(f"conv-{c}", system, turns))
    return out


# ---- prompt sources -----------------------------------------------------------------

PromptSource = Literal["random", "real"]
PROMPT_SOURCES: tuple[PromptSource, ...] = ("random", "real")


def default_prompt_source(model: str) -> PromptSource:
    """`random` for the random-weight test models (their text means nothing), `real` otherwise."""
    test_model = model.startswith(EMBEDDED_PREFIX) and model[len(EMBEDDED_PREFIX):] in EMBEDDED_MODELS
    return "random" if test_model else "real"


@dataclass(frozen=True)
class ChatPromptPool:
    """Chat-templated prompts in a model's own template, by kind: short questions and long
    passage tasks (`tests/support/real_text.py`), drawn from with a workload's RNG."""

    short: tuple[tuple[int, ...], ...]
    long: tuple[tuple[int, ...], ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, seed: int = 0, size: int = 64) -> ChatPromptPool:
        """`size` prompts of each kind, the same for a given seed."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("real prompts need a tokenizer with a chat template")
        return cls(*(tuple(tuple(p) for p in chat_prompts(tokenizer, size, seed, long_fraction))
                     for long_fraction in (0.0, 1.0)))

    @classmethod
    def for_model(cls, model: str, seed: int = 0) -> ChatPromptPool:
        """The pool of `model`'s tokenizer (no weights loaded, no torch imported)."""
        return cls.from_tokenizer(load_tokenizer(model), seed)

    def draw(self, rng: np.random.Generator, long: bool) -> list[int]:
        prompts = self.long if long else self.short
        return list(prompts[rng.integers(len(prompts))])

    def summary(self) -> dict:
        """Prompt-length range of each kind, for JSON configs."""
        return {kind: [min(map(len, p)), max(map(len, p))]
                for kind, p in (("short", self.short), ("long", self.long))}

    @property
    def max_prompt_len(self) -> int:
        return max(len(p) for p in self.short + self.long)


def with_chat_prompts(workload: Workload, pool: ChatPromptPool,
                      long_fraction: float = LONG_FRACTION) -> Workload:
    """The same requests (ids, arrivals, output lengths) with chat prompts from `pool` in place
    of their own: a `long_fraction` share are passage tasks (kind "long"), the rest questions
    ("short"); drawn from the workload's seed."""
    rng = np.random.default_rng(workload.seed)
    longs = rng.random(len(workload)) < long_fraction
    reqs = [dataclasses.replace(r, prompt_token_ids=pool.draw(rng, bool(long)),
                                kind="long" if long else "short")
            for r, long in zip(workload.requests, longs)]
    prompt = {"source": "real", "long_fraction": long_fraction, "lengths": pool.summary()}
    return Workload(workload.name, reqs, workload.seed, {**workload.settings, "prompt": prompt})
