"""Simulated traffic: token lengths from a named workload and an arrival process, as numpy arrays.

Lengths are lognormal (`loadtests.workloads.LengthDist`, fitted to a published median and P90,
see profiles.json) with prompt + output capped at the workload's `max_total`. The simulator only
needs lengths, so no token ids are drawn, except for `multi_turn_trace`, whose prompts repeat
each conversation's history (the prefix cache and prefix-aware routing need the ids). Arrival
processes: `loadtests.arrivals` (poisson, bursty, diurnal, step).

Capacity search rescales one draw of unit-rate gaps (`Trace.at_rate`), so every rate of a
bisection sees the same requests in the same order, only faster or slower.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtests.harness.arrivals import bursty, diurnal, poisson, step
from loadtests.sim.costmodel import load_profiles
from loadtests.harness.stats import percentile
from loadtests.harness.workloads import LengthDist, multi_turn_conversations

Z90 = 1.2815515655446004  # standard normal quantile at 0.9


@dataclass(frozen=True)
class Trace:
    """Requests ordered by arrival: arrival time (s), prompt tokens, output tokens."""

    name: str
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)
    token_ids: list[list[int]] | None = None  # each request's prompt ids, when they matter

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def at_rate(self, rate: float) -> Trace:
        """The same requests with arrival times scaled to `rate` (for traces drawn at rate 1)."""
        base = self.settings.get("rate", 1.0)
        return dataclasses.replace(self, arrival_s=self.arrival_s * (base / rate),
                                   settings={**self.settings, "rate": rate})

    def summary(self) -> dict[str, Any]:
        p, o = self.prompt_len, self.output_len
        return {"name": self.name, "num_requests": len(self), "duration_s": round(self.duration_s, 3),
                "prompt_p50": float(percentile(p.tolist(), 50)), "prompt_mean": float(p.mean()),
                "prompt_max": int(p.max()), "output_p50": float(percentile(o.tolist(), 50)),
                "output_mean": float(o.mean()), "output_max": int(o.max()),
                **{k: v for k, v in self.settings.items() if not isinstance(v, dict)}}


def length_dist(spec: dict[str, Any]) -> LengthDist:
    """A lognormal `LengthDist` from a {median, p90, lo, hi} spec."""
    sigma = math.log(spec["p90"] / spec["median"]) / Z90
    return LengthDist(spec.get("kind", "lognormal"), spec["median"], spec["lo"], spec["hi"], sigma=sigma)


def lengths(workload: str, n: int, rng: np.random.Generator,
            profiles: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths of `n` requests of a named workload (profiles.json)."""
    spec = (profiles or load_profiles())["workloads"][workload]
    prompt = np.array(length_dist(spec["prompt"]).sample(rng, n), dtype=np.int64)
    output = np.array(length_dist(spec["output"]).sample(rng, n), dtype=np.int64)
    # Cap prompt + output at max_total, shortening the prompt first (its tail is the long one).
    prompt = np.minimum(prompt, spec["max_total"] - output)
    return prompt, output


def make_trace(workload: str, arrivals: str = "poisson", *, n: int | None = None, rate: float = 1.0,
               seed: int = 0, cv: float = 3.0, duration_s: float | None = None, lo: float | None = None,
               hi: float | None = None, period_s: float | None = None, at_s: float | None = None) -> Trace:
    """A trace of a named workload under an arrival process (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if arrivals == "poisson":
        t = poisson(rng, _need(n, "n"), rate)
    elif arrivals == "bursty":
        t = bursty(rng, _need(n, "n"), rate, cv)
    elif arrivals == "diurnal":
        t = diurnal(rng, _need(duration_s, "duration_s"), _need(lo, "lo"), _need(hi, "hi"),
                    period_s or _need(duration_s, "duration_s"))
    elif arrivals == "step":
        t = step(rng, _need(duration_s, "duration_s"), _need(lo, "lo"), _need(hi, "hi"),
                 at_s if at_s is not None else _need(duration_s, "duration_s") / 3)
    else:
        raise ValueError(f"arrivals must be poisson|bursty|diurnal|step, got {arrivals!r}")
    prompt, output = lengths(workload, len(t), rng)
    settings = {"workload": workload, "arrivals": arrivals, "seed": seed}
    settings.update({k: v for k, v in dict(rate=rate if arrivals in ("poisson", "bursty") else None,
                                           cv=cv if arrivals == "bursty" else None, lo=lo, hi=hi,
                                           period_s=period_s, at_s=at_s, duration_s=duration_s).items()
                     if v is not None})
    return Trace(workload, t, prompt, output, settings)


def _need(value: Any, name: str) -> Any:
    if value is None:
        raise ValueError(f"{name} is required for this arrival process")
    return value


SIM_TOKEN = 0  # every token a simulated replica "generates" (Scheduler.advance gets zeros)


def multi_turn_trace(num_conversations: int, rate: float, *, turns: int = 6, think_s: float = 20.0,
                     system_tokens: int = 512, user: LengthDist = LengthDist("uniform", 100, 50, 150),
                     output: int = 200, vocab_size: int = 32_000, seed: int = 0) -> Trace:
    """Conversations starting as a Poisson process at `rate` per second, each sending `turns`
    turns; turn k+1 comes `think_s` plus an exponential (mean think_s / 2) after turn k, its
    prompt the whole history: system prompt, earlier messages and the answers (the simulator's
    tokens, `SIM_TOKEN`), and a new message. The request rate is about `rate * turns`."""
    rng = np.random.default_rng(seed)
    convs = multi_turn_conversations(vocab_size, seed, num_conversations=num_conversations, num_turns=turns,
                                     system_tokens=system_tokens, user=user, output=output)
    items: list[tuple[float, list[int], int]] = []
    for conv, start in zip(convs, poisson(rng, num_conversations, rate)):
        answers: list[list[int]] = []
        t = float(start)
        for k, (_, max_tokens) in enumerate(conv.turns):
            items.append((t, conv.prompt(k, answers), max_tokens))
            answers.append([SIM_TOKEN] * max_tokens)
            t += think_s + rng.exponential(think_s / 2)
    items.sort(key=lambda item: item[0])
    settings = {"rate": rate, "conversations": num_conversations, "turns": turns, "think_s": think_s,
                "system_tokens": system_tokens, "user": dataclasses.asdict(user), "output": output}
    return Trace("multi_turn", np.array([t for t, _, _ in items]), np.array([len(p) for _, p, _ in items]),
                 np.array([o for _, _, o in items]), settings, [p for _, p, _ in items])
