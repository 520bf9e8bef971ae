"""The sustainable rate's search and the recovery rule, as pure functions of what was measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def step_verdict(s: dict[str, Any], keep_up: float, ttft_bound_s: float) -> tuple[bool, str]:
    """Does one rate-search step count as sustainable? (and why not)."""
    if s["sent"] == 0:
        return False, "no requests"
    if s["counts"]["429"]:
        return False, f"{s['counts']['429']} x 429"
    if s["completed_ratio"] < keep_up:
        return False, f"completed {s['completed_ratio']:.0%} < {keep_up:.0%}"
    if s["ttft_p99_s"] is None or s["ttft_p99_s"] > ttft_bound_s:
        return False, f"p99 TTFT above {ttft_bound_s:g} s"
    return True, "ok"


def next_rate(history: Sequence[tuple[float, bool]], start: float, max_steps: int,
              max_rate: float, min_rate: float = 0.125) -> float | None:
    """The next rate to try: double after a pass, stop at the first failure after a pass; halve
    while nothing passed. None when the search is over."""
    if not history:
        return start
    if len(history) >= max_steps:
        return None
    rate, ok = history[-1]
    if ok:  # up, unless that rate (or one below it) already failed
        up = rate * 2
        failed_below = any(not passed and r <= up for r, passed in history)
        return up if up <= max_rate and not failed_below else None
    if any(passed for _, passed in history):
        return None
    return rate / 2 if rate / 2 >= min_rate else None


def sustainable_rate(history: Sequence[tuple[float, bool]]) -> float | None:
    passed = [rate for rate, ok in history if ok]
    return max(passed) if passed else None


def recovery_seconds(probes: Sequence[tuple[float, bool, float | None]]) -> float | None:
    """Seconds after the overload until normal service: the first probe from which every later
    probe is normal, at the moment it was answered (its send offset + TTFT). `probes` are
    (send offset, normal?, TTFT) in send order; None if the last probe is not normal."""
    first_good: tuple[float, bool, float | None] | None = None
    for probe in probes:
        if not probe[1]:
            first_good = None
        elif first_good is None:
            first_good = probe
    if first_good is None:
        return None
    return first_good[0] + (first_good[2] or 0.0)
