"""The load-test workload: an endless, fixed-seed Poisson stream of short and long requests.

Built from the generators in `loadtests/harness/workloads.py` (LengthDist, random_prompt) and
`loadtests/harness/arrivals.py` (poisson), so Locust, `make loadtest` and the sweep send the same requests: the same
prompts, the same exact output lengths (sent with `ignore_eos`) and, per rate, the same
arrival schedule. The unit-rate gaps are drawn from the seed alone and divided by the rate,
so a sweep's runs differ only in how fast the same sequence arrives.

With `prompts="real"` each request's prompt is drawn from a `ChatPromptPool` instead (a chat
question for a short request, a passage task for a long one); kinds, output lengths and
arrivals are the very ones the random mix draws.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from loadtests.harness.arrivals import poisson
from loadtests.harness.workloads import (PROMPT_SOURCES, ChatPromptPool, LengthDist, PromptSource,
                                 WorkloadRequest, random_prompt)

BLOCK = 64  # requests drawn per RNG block; block k always uses the seed sequence (seed, stream, k)
EMBEDDED_SPECIAL_IDS = (0, 1, 2)  # pad/bos/eos of the embedded tokenizers: kept out of prompts


@dataclass(frozen=True)
class MixSpec:
    """A request mix and its arrival rate.

    Short requests: lognormal prompt and output lengths around the medians (clipped). A
    `long_share` of requests instead carries a long prompt, uniform in [long_min, long_max]:
    the prompts a prefill-first scheduler stalls every running stream for. With
    `prompts="real"` the prompt lengths are those of the real prompts drawn (the length
    settings then shape only the outputs).
    """

    rps: float = 1.0
    prompt_median: int = 96
    output_median: int = 48
    long_share: float = 0.1
    long_min: int = 1024
    long_max: int = 1536
    vocab_size: int = 2048
    seed: int = 0
    avoid_ids: tuple[int, ...] = field(default=EMBEDDED_SPECIAL_IDS)
    prompts: PromptSource = "random"

    def __post_init__(self) -> None:
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"prompts must be one of {PROMPT_SOURCES}, got {self.prompts!r}")
        if self.rps <= 0:
            raise ValueError(f"rps must be > 0, got {self.rps}")
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        if not 1 <= self.long_min <= self.long_max:
            raise ValueError(f"need 1 <= long_min <= long_max, got {self.long_min}, {self.long_max}")
        if self.prompt_median < 1 or self.output_median < 1:
            raise ValueError("prompt_median and output_median must be >= 1")

    @property
    def short_prompt(self) -> LengthDist:
        return LengthDist("lognormal", self.prompt_median, 8, 4 * self.prompt_median, sigma=0.6)

    @property
    def output(self) -> LengthDist:
        return LengthDist("lognormal", self.output_median, 4, 4 * self.output_median, sigma=0.6)

    @property
    def long_prompt(self) -> LengthDist:
        return LengthDist("uniform", (self.long_min + self.long_max) / 2, self.long_min, self.long_max)

    @property
    def max_total_len(self) -> int:
        """The longest prompt + output this mix can send (must fit the model's context)."""
        return max(self.long_max, self.short_prompt.hi) + self.output.hi

    def to_dict(self) -> dict:
        return asdict(self)


def mixed_requests(spec: MixSpec, stream: int = 0,
                   pool: ChatPromptPool | None = None) -> Iterator[WorkloadRequest]:
    """Requests in arrival order, forever; `stream` separates independent users' sequences.
    Real prompts come from `pool`."""
    real = pool if spec.prompts == "real" else None
    if spec.prompts == "real" and real is None:
        raise ValueError("prompts='real' needs a ChatPromptPool")
    start = 0.0
    for block in itertools.count():
        rng = np.random.default_rng([spec.seed, stream, block])
        is_long = rng.random(BLOCK) < spec.long_share
        short_lens = spec.short_prompt.sample(rng, BLOCK)
        long_lens = spec.long_prompt.sample(rng, BLOCK)
        out_lens = spec.output.sample(rng, BLOCK)
        times = poisson(rng, BLOCK, spec.rps, start).tolist()
        start = times[-1]
        for i in range(BLOCK):
            n = long_lens[i] if is_long[i] else short_lens[i]
            kind = "long" if is_long[i] else "short"
            prompt = (real.draw(rng, bool(is_long[i])) if real else
                      random_prompt(rng, n, spec.vocab_size, spec.avoid_ids))
            yield WorkloadRequest(f"{kind}-{stream}-{block * BLOCK + i}", prompt, out_lens[i],
                                  times[i], kind)

