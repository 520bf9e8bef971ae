"""Routing quality at fleet scale: the production router ranking a sample of candidates (the rule
Serve runs, `RouterTuning.sample_size`) against ranking every replica, in the simulator.

    python -m loadtests.sim.routing_scale                       # 64 and 1,000 replicas
    python -m loadtests.sim.routing_scale --replicas 64 --per-replica-rps 3.5 --rankings token_load ttft
    python -m loadtests.sim.routing_scale --rankings prefix --json docs/results/sim_routing_scale_prefix.json

Same trace per fleet size for both rules: Mistral-7B on an A100-80GB, stall_free (MBP 512),
ShareGPT-like Poisson arrivals at `--per-replica-rps` (3.0: about 80% of a replica's
strict-SLO capacity, see docs/results/simulator.md). `prefix` runs the prefix-routing
experiment's multi-turn chat instead (prefix cache on, conversations starting at 15 / 6 per
replica per second, 6 turns 5 s apart, `--conversations-per-replica`) and adds the hit rate. The runs at 1,000 replicas are short
(`--requests-per-replica`), so besides the whole trace's figures each row gives the arrivals
after `--warm-s` (the fleet filled): their TTFT p99 and goodput (requests meeting the TTFT and
TPOT SLOs per second of that window). Prints a table with sampled / full ratios (the target:
within 5%, i.e. TTFT p99 ratio <= 1.05 and goodput ratio >= 0.95) and writes `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.router_tuning import RouterTuning
from loadtests.harness.stats import percentile
from loadtests.sim.__main__ import table, write_json
from loadtests.sim.deploy import replica_spec
from loadtests.sim.routers import make_router
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import Trace, make_trace, multi_turn_trace

TOLERANCE = 0.05
RULES = {"full": None, "sampled": RouterTuning.sample_size}  # sample_size per rule
LARGE_FLEET = 1000  # from here the default trace is short (the simulator's cost grows with the fleet)
CHAT_RPS, CHAT_TURNS, CHAT_THINK_S = 15.0, 6, 5.0  # the prefix-routing experiment's chat (experiments.py)


def trace_for(ranking: str, n: int, per: int, conversations: int, per_replica_rps: float, seed: int) -> Trace:
    if ranking == "prefix":
        return multi_turn_trace(n * conversations, n * CHAT_RPS / CHAT_TURNS, turns=CHAT_TURNS,
                                think_s=CHAT_THINK_S, seed=seed)
    return make_trace("sharegpt", "poisson", n=n * per, rate=n * per_replica_rps, seed=seed)


def hit_rate(sim: Simulator) -> float:
    everyone = sim.retired + sim.replicas
    queried = sum(r.blocks.query_tokens for r in everyone)
    return sum(r.blocks.hit_tokens for r in everyone) / queried if queried else 0.0


def window(sim: Simulator, warm_s: float) -> dict[str, float]:
    """TTFT p99 and goodput of the requests arriving after `warm_s` (until the last arrival)."""
    rec = sim.rec
    arrival = np.array(rec.arrival)
    ttft, tpot = np.array(rec.ttft), np.array(rec.mean_gap)
    late = arrival >= warm_s
    span = max(float(arrival.max()) - warm_s, 1e-9)
    ok = late & (ttft <= rec.ttft_slo_s) & (np.isnan(tpot) | (tpot <= rec.tbt_slo_s))
    p99 = percentile([t for t in ttft[late].tolist() if not math.isnan(t)], 99)
    return {"window_requests": int(late.sum()), "window_ttft_p99_s": math.nan if p99 is None else p99,
            "window_goodput_rps": float(ok.sum()) / span}


def per_size(counts: list[int] | None, replica_counts: list[int], flag: str, small: int, large: int) -> list[int]:
    """One count per fleet size: the flag's (one for all, or one each), else `small` below
    LARGE_FLEET replicas and `large` from there (a run of a few minutes)."""
    if counts is None:
        return [small if n < LARGE_FLEET else large for n in replica_counts]
    out = counts * len(replica_counts) if len(counts) == 1 else counts
    if len(out) != len(replica_counts):
        raise ValueError(f"{flag} takes one count or one per --replicas")
    return out


def run(replica_counts: list[int], rankings: list[str], per_replica_rps: float,
        requests_per_replica: list[int] | None, conversations_per_replica: list[int] | None, warm_s: float,
        seed: int, progress: bool) -> dict[str, Any]:
    """Both rules at each fleet size (the counts: see `per_size`)."""
    requests = per_size(requests_per_replica, replica_counts, "--requests-per-replica", 250, 60)
    conversations = per_size(conversations_per_replica, replica_counts, "--conversations-per-replica", 100, 10)
    rows = []
    for n, per, convs in zip(replica_counts, requests, conversations):
        for ranking in rankings:
            trace = trace_for(ranking, n, per, convs, per_replica_rps, seed)
            spec = replica_spec("A100-80GB", "mistral-7b", "stall_free", 512, prefix_caching=ranking == "prefix")
            for rule, size in RULES.items():
                tuning = dataclasses.replace(RouterTuning(), ranking=ranking, sample_size=size)
                cfg = SimConfig(spec, n, router=ranking, tbt_slo_s=0.1, seed=seed)
                sim = Simulator(cfg, trace, router=make_router(ranking, seed, tuning))
                res = sim.run(progress=progress, desc=f"{ranking}/{rule}@{n}")
                s = res.summary
                rows.append({"replicas": n, "ranking": ranking, "rule": rule, "sample_size": size,
                             "requests": len(trace), "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                             "goodput_rps": s["goodput_rps"], "tbt_bucket_p99_s": s["tbt_bucket_p99_s"],
                             "tpot_slo_request_share": s["tpot_slo_request_share"], **window(sim, warm_s),
                             "hit_rate": hit_rate(sim), "wall_s": res.wall_s})
                print(f"  {n:5d} replicas {ranking:10s} {rule:8s} TTFT p99 {s['ttft_p99_s']:.3f} s "
                      f"goodput {s['goodput_rps']:.1f} req/s ({res.wall_s:.0f} s)", flush=True)
    return {"rows": rows, "checks": checks(rows), "per_replica_rps": per_replica_rps,
            "requests_per_replica": requests, "conversations_per_replica": conversations, "warm_s": warm_s, "seed": seed,
            "sample_size": RouterTuning.sample_size, "tolerance": TOLERANCE,
            "setting": "mistral-7b / A100-80GB, stall_free MBP 512, sharegpt, poisson",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sampled over full, per fleet size and ranking, for each quality figure."""
    by = {(r["replicas"], r["ranking"], r["rule"]): r for r in rows}
    out = []
    for (n, ranking, rule), sampled in by.items():
        full = by.get((n, ranking, "full"))
        if rule != "sampled" or full is None:
            continue
        ratio = {k: sampled[k] / full[k] for k in ("ttft_p99_s", "goodput_rps", "window_ttft_p99_s",
                                                     "window_goodput_rps")}
        met = (ratio["ttft_p99_s"] <= 1 + TOLERANCE and ratio["goodput_rps"] >= 1 - TOLERANCE
               and ratio["window_ttft_p99_s"] <= 1 + TOLERANCE and ratio["window_goodput_rps"] >= 1 - TOLERANCE)
        out.append({"replicas": n, "ranking": ranking, **{f"{k}_ratio": v for k, v in ratio.items()}, "met": met})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m loadtests.sim.routing_scale", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 1000])
    p.add_argument("--rankings", nargs="+", default=["token_load"], choices=["token_load", "ttft", "prefix"])
    p.add_argument("--per-replica-rps", type=float, default=3.0)
    p.add_argument("--requests-per-replica", type=int, nargs="+",
                   help="one count, or one per --replicas (default 250, and 60 from 1,000 replicas up)")
    p.add_argument("--conversations-per-replica", type=int, nargs="+",
                   help="prefix: one count, or one per --replicas (default 100, and 10 from 1,000 replicas up)")
    p.add_argument("--warm-s", type=float, default=10.0, help="the window starts at this arrival time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("docs/results/sim_routing_scale.json"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    res = run(a.replicas, a.rankings, a.per_replica_rps, a.requests_per_replica, a.conversations_per_replica,
              a.warm_s, a.seed, not a.quiet)
    print()
    table(res["rows"], [("replicas", "replicas", "d"), ("ranking", "ranking", "s"), ("rule", "rule", "s"),
                        ("ttft_p50_s", "p50 TTFT s", ".3f"), ("ttft_p99_s", "p99 TTFT s", ".3f"),
                        ("goodput_rps", "goodput", ".1f"), ("window_ttft_p99_s", "p99 TTFT s (warm)", ".3f"),
                        ("window_goodput_rps", "goodput (warm)", ".1f"), ("tbt_bucket_p99_s", "p99 TBT s", ".3f"),
                        ("hit_rate", "hit rate", ".3f"),
                        ("wall_s", "wall s", ".0f")])
    for c in res["checks"]:
        print(f"{c['replicas']:5d} replicas {c['ranking']:10s} sampled / full: TTFT p99 {c['ttft_p99_s_ratio']:.3f} "
              f"(warm {c['window_ttft_p99_s_ratio']:.3f}), goodput {c['goodput_rps_ratio']:.3f} "
              f"(warm {c['window_goodput_rps_ratio']:.3f}): {'met' if c['met'] else 'NOT met'} (within 5%)")
    write_json(a.json, res)
    return res


if __name__ == "__main__":
    main()
