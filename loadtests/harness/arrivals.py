"""Arrival processes: when each request of a load test or a simulated trace arrives.

Every process draws from the `np.random.Generator` it is given, so a seed fixes the schedule.
- `poisson`: exponential gaps at `rate` req/s (open-loop load, the benchmarks' default).
- `poisson_window`: the Poisson arrivals of one seed that fall inside a window of `duration_s`.
- `bursty`: gamma gaps with the same mean and a coefficient of variation `cv`.
- `diurnal`: a rate swinging between `lo` and `hi` over `period_s` (thinned Poisson).
- `step`: `lo` req/s until `at_s`, then `hi`.
"""

from __future__ import annotations

import math

import numpy as np


def poisson(rng: np.random.Generator, n: int, rate: float, start_s: float = 0.0) -> np.ndarray:
    """`n` arrival times of a Poisson process at `rate` req/s from `start_s` (the first after one gap)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return start_s + np.cumsum(rng.exponential(1.0 / rate, n))


def poisson_window(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets in [0, duration_s) of a Poisson process at `rate` req/s, seeded."""
    rng = np.random.default_rng(seed)
    # Enough draws that running out before the window ends is a six-sigma event.
    n = int(rate * duration_s + 6 * math.sqrt(rate * duration_s) + 10)
    return [t for t in poisson(rng, n, rate).tolist() if t < duration_s]


def bursty(rng: np.random.Generator, n: int, rate: float, cv: float = 3.0) -> np.ndarray:
    shape = 1.0 / (cv * cv)  # gamma gaps: mean 1/rate, CV = 1/sqrt(shape)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))


def diurnal(rng: np.random.Generator, duration_s: float, lo: float, hi: float, period_s: float,
            phase_s: float = 0.0) -> np.ndarray:
    """Non-homogeneous Poisson arrivals by thinning a rate-`hi` process."""
    t = np.cumsum(rng.exponential(1.0 / hi, int(hi * duration_s * 1.2) + 100))
    t = t[t < duration_s]
    rate = lo + (hi - lo) * (1.0 - np.cos(2 * math.pi * (t + phase_s) / period_s)) / 2.0
    return t[rng.random(len(t)) < rate / hi]


def step(rng: np.random.Generator, duration_s: float, lo: float, hi: float, at_s: float) -> np.ndarray:
    first = np.cumsum(rng.exponential(1.0 / lo, int(lo * at_s * 1.5) + 100))
    first = first[first < at_s]
    second = at_s + np.cumsum(rng.exponential(1.0 / hi, int(hi * (duration_s - at_s) * 1.5) + 100))
    return np.concatenate([first, second[second < duration_s]])
