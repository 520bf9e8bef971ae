"""Capacity: the highest request rate a replica sustains within the latency SLO (Sarathi-Serve's definition).

A rate passes when, over a fixed trace replayed at that rate, P99 TBT <= the SLO and the median
scheduling delay (arrival to first scheduled) <= 2 s. Capacity is found by bisection on the
rate: double (or halve) until the first pass/fail pair brackets it, then halve the bracket until
it is narrower than `rel_tol`. Every rate replays the same requests (one unit-rate draw,
rescaled), so the pass/fail line is not blurred by resampling.

A run stops as soon as its failure is certain: more gaps above the SLO than 1% of all gaps the
trace will produce, or more than half of the requests already scheduled (or still waiting)
later than 2 s. Overloaded points then cost seconds, not minutes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import Trace

SCHED_DELAY_LIMIT_S = 2.0


@dataclass(frozen=True)
class Criteria:
    tbt_p99_s: float  # limits, not measurements
    sched_delay_p50_s: float = SCHED_DELAY_LIMIT_S

    def passes(self, s: dict[str, Any]) -> bool:
        # The bucket p99 is at most one 0.1 ms bin above the observed one: passing is conservative.
        return (s["completed"] > 0 and s["tbt_bucket_p99_s"] <= self.tbt_p99_s
                and s["sched_delay_p50_s"] <= self.sched_delay_p50_s)


def certain_failure(crit: Criteria, trace: Trace, spec_rejects: Callable[[int, int], Any]
                    ) -> Callable[[Simulator, float], str | None]:
    """A stop predicate that fires once the run cannot pass any more (gaps count as requests finish)."""
    kept = [o for p, o in zip(trace.prompt_len.tolist(), trace.output_len.tolist()) if not spec_rejects(p, o)]
    total_gaps = sum(max(o - 1, 0) for o in kept)
    allowed_over = total_gaps - math.ceil(0.99 * total_gaps)  # more than this and P99 > SLO
    allowed_late = len(kept) - math.ceil(0.5 * len(kept))  # more than this and the median > limit

    def stop(sim: Simulator, now: float) -> str | None:
        sim.rec.flush()
        if sim.rec.num_over_slo > allowed_over:
            return "tbt_p99_over_slo"
        if sim.rec.num_late_start > allowed_late:
            return "sched_delay_p50_over_limit"
        if sim.rec.num_late_start + sim.unstarted_late(now, crit.sched_delay_p50_s) > allowed_late:
            return "sched_delay_p50_over_limit"
        return None

    return stop


def run_point(cfg: SimConfig, unit_trace: Trace, rate: float, crit: Criteria,
              early_stop: bool = True) -> dict[str, Any]:
    """Simulate `unit_trace` at `rate`; returns the summary with `passed` and `stopped`."""
    trace = unit_trace.at_rate(rate)
    cfg = replace(cfg, tbt_slo_s=crit.tbt_p99_s)
    sim = Simulator(cfg, trace)
    stop = certain_failure(crit, trace, cfg.spec.rejects) if early_stop else None
    res = sim.run(stop=stop, stop_every_s=max(1.0, 20.0 / rate))
    s = dict(res.summary)
    s.update(rate=rate, stopped=res.stopped, wall_s=res.wall_s,
             passed=res.stopped is None and crit.passes(s))
    return s


def find_capacity(cfg: SimConfig, unit_trace: Trace, crit: Criteria, start_rate: float = 1.0,
                  rel_tol: float = 0.03, max_points: int = 24,
                  on_point: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Bisection for the highest passing rate; returns capacity and every point tried."""
    points: list[dict[str, Any]] = []

    def probe(rate: float) -> bool:
        s = run_point(cfg, unit_trace, rate, crit)
        points.append(s)
        if on_point:
            on_point(s)
        return s["passed"]

    lo, hi = 0.0, math.inf
    rate = start_rate
    while hi == math.inf or lo == 0.0:
        if len(points) >= max_points:
            break
        if probe(rate):
            lo = rate
            if hi < math.inf:
                break
            rate *= 2
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2
            if rate < 1e-3:
                break
    while hi < math.inf and lo > 0 and (hi - lo) / hi > rel_tol and len(points) < max_points:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    best = max((p for p in points if p["passed"]), key=lambda p: p["rate"], default=None)
    return {"capacity_rps": lo, "upper_bound_rps": hi if hi < math.inf else None,
            "criteria": {"tbt_p99_s": crit.tbt_p99_s, "sched_delay_p50_s": crit.sched_delay_p50_s},
            "at_capacity": best, "points": points}
