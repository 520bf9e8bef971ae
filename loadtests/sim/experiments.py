"""The simulator's experiments: capacity per policy, routing at scale, autoscaling, and speed.

Each function returns plain data (JSON-ready); `__main__` prints the tables and writes files.
Defaults are the issue's setting: Mistral-7B on an A100-80GB, ShareGPT-like chat.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from autoscale.scaling import ScalingConfig, queued_tokens_threshold
from loadtests.sim.capacity import Criteria, find_capacity
from loadtests.sim.deploy import replica_spec
from loadtests.sim.routers import ROUTERS
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import make_trace, multi_turn_trace
from replicas.config import ReplicaOptions

POLICIES = ("static", "dynamic", "stall_free")
SLOS = {"strict": 0.1, "relaxed": 0.5}
# Sarathi-Serve's token budgets: small chunks for a strict TBT SLO, larger for a relaxed one.
STALL_FREE_BUDGET = {"strict": 512, "relaxed": 2048}


def baseline_mbp(workload: str) -> int:
    """MBP for static/dynamic: the longest prompt, so no request is refused (vLLM's default)."""
    from loadtests.sim.costmodel import load_profiles

    return load_profiles()["workloads"][workload]["max_total"]


def policy_mbp(policy: str, slo_name: str, workload: str) -> int:
    return STALL_FREE_BUDGET[slo_name] if policy == "stall_free" else baseline_mbp(workload)


# ---- capacity ------------------------------------------------------------------------------------


def capacity(gpu: str = "A100-80GB", model: str = "mistral-7b", workload: str = "sharegpt",
             num_requests: int = 1000, seed: int = 0, policies: tuple[str, ...] = POLICIES,
             slos: dict[str, float] | None = None, log: Any = print) -> dict[str, Any]:
    """Capacity (req/s per replica) of each policy under each SLO, by bisection."""
    slos = slos or SLOS
    unit = make_trace(workload, "poisson", n=num_requests, rate=1.0, seed=seed)
    rows = []
    for slo_name, slo in slos.items():
        for policy in policies:
            mbp = policy_mbp(policy, slo_name, workload)
            spec = replica_spec(gpu, model, policy, mbp)
            t0 = time.perf_counter()
            res = find_capacity(SimConfig(spec, 1, router="round_robin", tbt_slo_s=slo), unit, Criteria(slo),
                                start_rate=1.0)
            at = res["at_capacity"] or {}
            rows.append({"workload": workload, "slo": slo_name, "tbt_slo_s": slo, "policy": policy, "mbp": mbp,
                         "capacity_rps": res["capacity_rps"], "upper_bound_rps": res["upper_bound_rps"],
                         "tbt_bucket_p99_s": at.get("tbt_bucket_p99_s"),
                         "sched_delay_p50_s": at.get("sched_delay_p50_s"),
                         "ttft_p99_s": at.get("ttft_p99_s"), "output_tokens_per_s": at.get("output_tokens_per_s"),
                         "points": [{k: p[k] for k in ("rate", "passed", "stopped", "tbt_bucket_p99_s",
                                                       "sched_delay_p50_s")} for p in res["points"]],
                         "search_s": time.perf_counter() - t0})
            log(f"  {workload:8s} {slo_name:7s} {policy:10s} mbp {mbp:5d}: {res['capacity_rps']:.3f} req/s "
                f"({len(res['points'])} points, {time.perf_counter() - t0:.1f}s)")
    ratios = {}
    for slo_name in slos:
        cap = {r["policy"]: r["capacity_rps"] for r in rows if r["slo"] == slo_name}
        if "dynamic" in cap and "stall_free" in cap:
            ratios[slo_name] = cap["stall_free"] / cap["dynamic"] if cap["dynamic"] > 0 else math.inf
    return {"gpu": gpu, "model": model, "workload": workload, "num_requests": num_requests, "seed": seed,
            "trace": unit.summary(), "rows": rows, "stall_free_over_dynamic": ratios,
            "criteria": "P99 TBT <= SLO and median scheduling delay <= 2 s (Sarathi-Serve)"}


# ---- the SLO budget ---------------------------------------------------------------------------------

SLO_BUDGET_CEILING = 2048


def slo_budget_capacity(gpu: str = "A100-80GB", model: str = "mistral-7b", workload: str = "sharegpt",
                        num_requests: int = 1000, seed: int = 0, slos: dict[str, float] | None = None,
                        log: Any = print) -> dict[str, Any]:
    """Capacity under each SLO of stall_free with fixed budgets 512 and 2048, with the SLO
    budget (ceiling 2048, `tbt_slo_ms` = the SLO, nothing else tuned), and of dynamic."""
    slos = slos or SLOS
    unit = make_trace(workload, "poisson", n=num_requests, rate=1.0, seed=seed)
    rows = []
    for slo_name, slo in slos.items():
        systems = [("stall_free", 512, None), ("stall_free", 2048, None),
                   ("stall_free+slo", SLO_BUDGET_CEILING, 1000 * slo),
                   ("dynamic", baseline_mbp(workload), None)]
        for name, mbp, slo_ms in systems:
            spec = replica_spec(gpu, model, name.split("+")[0], mbp)
            if slo_ms is not None:
                spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, tbt_slo_ms=slo_ms))
            t0 = time.perf_counter()
            res = find_capacity(SimConfig(spec, 1, router="round_robin", tbt_slo_s=slo), unit, Criteria(slo),
                                start_rate=1.0)
            at = res["at_capacity"] or {}
            rows.append({"gpu": gpu, "model": model, "slo": slo_name, "tbt_slo_s": slo, "system": name,
                         "mbp": mbp, "capacity_rps": res["capacity_rps"],
                         "tbt_bucket_p99_s": at.get("tbt_bucket_p99_s"), "ttft_p99_s": at.get("ttft_p99_s"),
                         "sched_delay_p50_s": at.get("sched_delay_p50_s"), "search_s": time.perf_counter() - t0})
            log(f"  {model} {gpu} {slo_name:7s} {name:15s} mbp {mbp:5d}: {res['capacity_rps']:.3f} req/s "
                f"({time.perf_counter() - t0:.1f}s)")
    checks = []
    for slo_name in slos:
        cap = {(r["system"], r["mbp"]): r["capacity_rps"] for r in rows if r["slo"] == slo_name}
        fixed = [cap[("stall_free", 512)], cap[("stall_free", 2048)]]
        mine = cap[("stall_free+slo", SLO_BUDGET_CEILING)]
        checks.append({"slo": slo_name, "slo_budget_rps": mine, "best_fixed_rps": max(fixed),
                       "worst_fixed_rps": min(fixed),
                       "vs_best": mine / max(fixed) if max(fixed) else math.inf,
                       "vs_worst": mine / min(fixed) if min(fixed) else math.inf})
    return {"gpu": gpu, "model": model, "workload": workload, "num_requests": num_requests, "seed": seed,
            "rows": rows, "checks": checks,
            "criteria": "P99 TBT <= SLO and median scheduling delay <= 2 s (Sarathi-Serve)",
            "target": "SLO budget >= the best fixed budget, >= 1.2x the worst, at every SLO"}


# ---- goodput at the saturating rate ------------------------------------------------------------

GOODPUT_SYSTEMS = (("stall_free", 128, False), ("stall_free", 512, False), ("stall_free", 2048, False),
                   ("stall_free+slo", SLO_BUDGET_CEILING, True), ("dynamic", None, False))


def slo_goodput(gpu: str = "A100-80GB", model: str = "mistral-7b", workload: str = "sharegpt",
                num_requests: int = 1000, seed: int = 0, slos: dict[str, float] | None = None,
                ttft_slo_s: float = 2.0, rate_factors: tuple[float, ...] = (0.75, 1.0, 1.25, 1.5),
                log: Any = print) -> dict[str, Any]:
    """The sweep's goodput comparison on a GPU: stall_free with fixed budgets (128, the engine's
    CPU default, 512 and 2048), the SLO budget (ceiling 2048, `tbt_slo_ms` = the SLO) and dynamic,
    at multiples of the rate where fixed 128 saturates (its capacity by Sarathi's criteria).

    Goodput counts the requests that finish with TTFT <= `ttft_slo_s` and every gap <= the TBT SLO
    (the sweep's definition), over the window the trace was offered in (n / rate), so every line is
    divided by the same time and refused or unfinished requests count as missed."""
    slos = slos or SLOS
    unit = make_trace(workload, "poisson", n=num_requests, rate=1.0, seed=seed)
    rows, checks = [], []
    spec128 = replica_spec(gpu, model, "stall_free", 128)

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.inf

    for slo_name, slo in slos.items():
        saturating = find_capacity(SimConfig(spec128, 1, router="round_robin", tbt_slo_s=slo), unit,
                                   Criteria(slo), start_rate=1.0)["capacity_rps"]
        log(f"  {model} {gpu} {slo_name}: fixed 128 saturates at {saturating:.3f} req/s")
        for factor in rate_factors:
            rate = factor * saturating
            at_rate = {}
            for name, mbp, slo_budget in GOODPUT_SYSTEMS:
                spec = replica_spec(gpu, model, name.split("+")[0], mbp or baseline_mbp(workload))
                if slo_budget:
                    spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, tbt_slo_ms=1000 * slo))
                cfg = SimConfig(spec, 1, router="round_robin", tbt_slo_s=slo, ttft_slo_s=ttft_slo_s, seed=seed)
                s = Simulator(cfg, unit.at_rate(rate)).run().summary
                row = {"gpu": gpu, "model": model, "slo": slo_name, "tbt_slo_s": slo, "ttft_slo_s": ttft_slo_s,
                       "factor": factor, "rate_rps": rate, "system": name, "mbp": spec.engine.max_batch_prefill_tokens,
                       "goodput_rps": s["max_gap_slo_request_share"] * rate,
                       **{k: s[k] for k in ("max_gap_slo_request_share", "ttft_p50_s", "ttft_p99_s",
                                            "tbt_bucket_p99_s", "throughput_rps", "preemptions")}}
                rows.append(row)
                at_rate[(name, mbp)] = row
                log(f"    x{factor:.2f} {rate:.3f} req/s {name:15s} mbp {row['mbp']:5d}: goodput "
                    f"{row['goodput_rps']:.3f} req/s, TTFT p99 {row['ttft_p99_s']:.2f} s, "
                    f"TBT p99 {row['tbt_bucket_p99_s']:.3f} s")
            mine, fixed128 = at_rate[("stall_free+slo", SLO_BUDGET_CEILING)], at_rate[("stall_free", 128)]
            dyn = at_rate[("dynamic", None)]
            checks.append({"slo": slo_name, "factor": factor, "rate_rps": rate,
                           "goodput_vs_fixed128": ratio(mine["goodput_rps"], fixed128["goodput_rps"]),
                           "goodput_vs_dynamic": ratio(mine["goodput_rps"], dyn["goodput_rps"]),
                           "ttft_p99_vs_dynamic": ratio(mine["ttft_p99_s"], dyn["ttft_p99_s"]),
                           "tbt_p99_s": mine["tbt_bucket_p99_s"], "tbt_within_slo": mine["tbt_bucket_p99_s"] <= slo})
    return {"gpu": gpu, "model": model, "workload": workload, "num_requests": num_requests, "seed": seed,
            "ttft_slo_s": ttft_slo_s, "rows": rows, "checks": checks,
            "target": "at the rate where fixed 128 saturates: goodput >= 1.5x fixed 128 and >= 3x dynamic, "
                      "p99 TTFT <= 1.5x dynamic's, p99 TBT within the SLO (the sweep's targets)"}


# ---- routing -------------------------------------------------------------------------------------


def routing(replica_counts: tuple[int, ...] = (16, 64), per_replica_rps: float = 3.0,
            requests_per_replica: int = 300, arrivals: str = "poisson", gpu: str = "A100-80GB",
            model: str = "mistral-7b", workload: str = "sharegpt", policy: str = "stall_free", mbp: int = 512,
            tbt_slo_s: float = 0.1, seed: int = 0, routers: tuple[str, ...] = ROUTERS,
            report_delays_s: tuple[float, ...] = (0.0,), progress: bool = True, log: Any = print) -> dict[str, Any]:
    """TTFT and TBT of each router at each cluster size, same trace per size, with each delay from
    a report to the router seeing it (`SimConfig.report_delay_s`)."""
    spec = replica_spec(gpu, model, policy, mbp)
    rows = []
    for n in replica_counts:
        trace = make_trace(workload, arrivals, n=n * requests_per_replica, rate=n * per_replica_rps, seed=seed)
        for router in routers:
            for delay in report_delays_s:
                cfg = SimConfig(spec, n, router=router, tbt_slo_s=tbt_slo_s, seed=seed, report_delay_s=delay)
                res = Simulator(cfg, trace).run(progress=progress, desc=f"{router}@{n}")
                s = res.summary
                rows.append({"replicas": n, "router": router, "report_delay_ms": 1e3 * delay,
                             "rate_rps": n * per_replica_rps, "arrivals": arrivals,
                             **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_bucket_p99_s",
                                                  "sched_delay_p50_s", "sched_delay_p99_s", "e2e_p99_s",
                                                  "tpot_slo_request_share", "goodput_rps", "preemptions",
                                                  "completed")},
                             "wall_s": res.wall_s})
                log(f"  {n:3d} replicas {router:13s} report delay {1e3 * delay:3.0f} ms TTFT p50 "
                    f"{s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f}s "
                    f"TBT bucket p99 {s['tbt_bucket_p99_s'] * 1e3:.0f}ms ({res.wall_s:.1f}s)")
    return {"gpu": gpu, "model": model, "workload": workload, "policy": policy, "mbp": mbp,
            "per_replica_rps": per_replica_rps, "arrivals": arrivals, "rows": rows}


def prefix_routing(replica_counts: tuple[int, ...] = (16, 64), per_replica_rps: float = 15.0,
                   conversations_per_replica: int = 100, turns: int = 6, think_s: float = 5.0,
                   gpu: str = "A100-80GB",
                   model: str = "mistral-7b", policy: str = "stall_free", mbp: int = 512,
                   tbt_slo_s: float = 0.1, seed: int = 0,
                   routers: tuple[str, ...] = ("prefix", "token_load", "power_of_two"),
                   progress: bool = True, log: Any = print) -> dict[str, Any]:
    """Multi-turn chat (each turn resends the history) on replicas with the prefix cache on:
    TTFT and the cluster's prefix-cache hit rate per router, the same trace per cluster size.

    `per_replica_rps` sets how fast conversations start (its / turns per replica per second); the
    request rate the replicas see is lower, paced by the think time: each row says it (offered_rps).
    """
    spec = replica_spec(gpu, model, policy, mbp, prefix_caching=True)
    rows = []
    for n in replica_counts:
        trace = multi_turn_trace(n * conversations_per_replica, n * per_replica_rps / turns, turns=turns,
                                 think_s=think_s, seed=seed)
        for router in routers:
            sim = Simulator(SimConfig(spec, n, router=router, tbt_slo_s=tbt_slo_s, seed=seed), trace)
            res = sim.run(progress=progress, desc=f"{router}@{n}")
            s = res.summary
            everyone = sim.retired + sim.replicas
            queried = sum(r.blocks.query_tokens for r in everyone)
            hit_rate = sum(r.blocks.hit_tokens for r in everyone) / queried if queried else 0.0
            rows.append({"replicas": n, "router": router, "offered_rps": len(trace) / trace.duration_s,
                         "hit_rate": hit_rate,
                         **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_bucket_p99_s",
                                              "sched_delay_p99_s", "e2e_p99_s", "goodput_rps", "completed")},
                         "wall_s": res.wall_s})
            log(f"  {n:3d} replicas {router:13s} TTFT p50 {s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f}s "
                f"hit rate {hit_rate:.1%} TBT bucket p99 {s['tbt_bucket_p99_s'] * 1e3:.0f}ms ({res.wall_s:.1f}s)")
    by = {(r["replicas"], r["router"]): r for r in rows}
    ratios = {n: 1 - by[n, "prefix"]["ttft_p99_s"] / by[n, "token_load"]["ttft_p99_s"]
              for n in replica_counts if (n, "prefix") in by and (n, "token_load") in by}
    return {"gpu": gpu, "model": model, "policy": policy, "mbp": mbp, "per_replica_rps": per_replica_rps,
            "trace": trace.summary(), "rows": rows, "prefix_p99_ttft_reduction_vs_token_load": ratios}


# ---- autoscaling ---------------------------------------------------------------------------------


def token_load_at(spec: Any, workload: str, rate: float, seed: int = 0, n: int = 1500) -> float:
    """Median reported token load of one replica serving `rate` req/s (the scaler's capacity model)."""
    trace = make_trace(workload, "poisson", n=n, rate=rate, seed=seed + 7)
    sim = Simulator(SimConfig(spec, 1, router="token_load"), trace)
    seen: list[int] = []
    original = sim.router.reported

    def record(r, load, now):  # noqa: ANN001 - wraps the router hook
        seen.append(load.token_load)
        original(r, load, now)

    sim.router.reported = record
    sim.run()
    return float(np.median(seen[len(seen) // 5:]))  # skip the ramp-up


def autoscale(per_replica_rps: float | None = None, peak_rps: float = 24.0, low_rps: float = 4.0,
              duration_s: float = 1800.0, startup_s: float = 60.0, gpu: str = "A100-80GB",
              model: str = "mistral-7b", workload: str = "sharegpt", policy: str = "stall_free", mbp: int = 512,
              tbt_slo_s: float = 0.1, ttft_slo_s: float = 2.0, seed: int = 0, progress: bool = True,
              log: Any = print) -> dict[str, Any]:
    """Diurnal and step loads: the TBT-SLO autoscaler against a fixed fleet sized for the peak."""
    spec = replica_spec(gpu, model, policy, mbp)
    if per_replica_rps is None:
        unit = make_trace(workload, "poisson", n=1000, rate=1.0, seed=seed)
        per_replica_rps = find_capacity(SimConfig(spec, 1, router="round_robin"), unit,
                                        Criteria(tbt_slo_s))["capacity_rps"]
    peak_fleet = math.ceil(peak_rps / per_replica_rps)
    # The scaler's capacity model: the token load one replica carries at 80% of its capacity.
    load_cap = int(token_load_at(spec, workload, 0.8 * per_replica_rps, seed))
    # The queue rule as the app sets it: half of a replica's default queue cap.
    queued = queued_tokens_threshold(ReplicaOptions().max_queued_tokens)
    scaling = ScalingConfig(window_s=30.0, min_replicas=1, max_replicas=2 * peak_fleet,
                            token_load_per_replica=load_cap, queued_tokens_per_replica=queued,
                            upscale_cooldown_s=startup_s / 2, downscale_cooldown_s=60.0, downscale_stable_s=30.0)
    log(f"  replica capacity {per_replica_rps:.2f} req/s -> peak fleet {peak_fleet}; "
        f"token_load_per_replica {load_cap}")
    scenarios = {
        "diurnal": make_trace(workload, "diurnal", duration_s=duration_s, lo=low_rps, hi=peak_rps,
                              period_s=duration_s, seed=seed),
        "step": make_trace(workload, "step", duration_s=duration_s, lo=low_rps, hi=peak_rps,
                           at_s=duration_s / 3, seed=seed),
    }
    rows, timelines = [], {}
    for name, trace in scenarios.items():
        for fleet in ("autoscaled", "fixed_peak"):
            cfg = SimConfig(spec, 1 if fleet == "autoscaled" else peak_fleet, router="token_load",
                            tbt_slo_s=tbt_slo_s, ttft_slo_s=ttft_slo_s, seed=seed, startup_s=startup_s,
                            scaling=scaling if fleet == "autoscaled" else None, scaling_interval_s=2.0)
            res = Simulator(cfg, trace).run(progress=progress, desc=f"{name}/{fleet}")
            s = res.summary
            row = {"scenario": name, "fleet": fleet, "requests": len(trace),
                   **{k: s[k] for k in ("tpot_slo_request_share", "tbt_slo_token_share", "max_gap_slo_request_share",
                                        "ttft_p50_s", "ttft_p99_s", "tbt_bucket_p99_s", "goodput_rps",
                                        "replica_seconds", "max_replicas", "completed")},
                   "wall_s": res.wall_s}
            rows.append(row)
            if res.scaling:
                timelines[name] = [{"t": t, "ready": ready, "provisioned": prov, "desired": want, "reason": why}
                                   for t, ready, prov, want, why in res.scaling]
            log(f"  {name:8s} {fleet:10s} TPOT SLO request share {s['tpot_slo_request_share']:.3f}"
                f" (token share {s['tbt_slo_token_share']:.3f}) TTFT p99 {s['ttft_p99_s']:.2f}s"
                f" replica-s {s['replica_seconds']:.0f} max replicas {s['max_replicas']} ({res.wall_s:.1f}s)")
    return {"gpu": gpu, "model": model, "workload": workload, "policy": policy, "mbp": mbp,
            "per_replica_capacity_rps": per_replica_rps, "peak_fleet": peak_fleet, "startup_s": startup_s,
            "scaling": scaling.to_dict(), "scenarios": {k: v.summary() for k, v in scenarios.items()},
            "rows": rows, "timelines": timelines}


# ---- speed ---------------------------------------------------------------------------------------


def speed(num_requests: int = 100_000, replicas: int = 64, per_replica_rps: float = 3.0,
          router: str = "token_load", gpu: str = "A100-80GB", model: str = "mistral-7b",
          workload: str = "sharegpt", policy: str = "stall_free", mbp: int = 512, seed: int = 0,
          autoscale: bool = False, decode_runs: bool = True, progress: bool = True) -> dict[str, Any]:
    """Wall and CPU time of one large simulation. `autoscale`: the scaler decides every second
    between 1 and twice the starting fleet; `decode_runs` False: the pass-by-pass reference."""
    import os

    spec = replica_spec(gpu, model, policy, mbp)
    trace = make_trace(workload, "poisson", n=num_requests, rate=replicas * per_replica_rps, seed=seed)
    scaling = ScalingConfig(min_replicas=1, max_replicas=2 * replicas) if autoscale else None
    cfg = SimConfig(spec, replicas, router=router, scaling=scaling, decode_runs=decode_runs)
    res = Simulator(cfg, trace).run(progress=progress, desc="speed")
    s = res.summary
    return {"num_requests": num_requests, "replicas": replicas, "router": router, "policy": policy,
            "workload": workload, "rate_rps": replicas * per_replica_rps, "autoscale": autoscale,
            "decode_runs": decode_runs, "wall_s": res.wall_s, "cpu_s": s["sim_cpu_s"],
            "iterations": s["iterations"], "decode_run_passes": s["decode_run_passes"],
            "max_replicas": s["max_replicas"], "output_tokens": int(trace.output_len.sum()),
            "us_per_output_token": s["sim_cpu_s"] / int(trace.output_len.sum()) * 1e6,
            "prompt_tokens": int(trace.prompt_len.sum()), "simulated_s": s["duration_s"], "loadavg": os.getloadavg(),
            "summary": {k: s[k] for k in ("ttft_p99_s", "tbt_bucket_p99_s", "tpot_slo_request_share",
                                          "throughput_rps")}}

