"""A load step that one replica sheds: the autoscaler with and without the refused-demand signal.

    python -m loadtests.sim.shedding [--quick] [--out docs/results/sim_shedding.json]

Replicas shed as the real ones do (`SimConfig.shed`: a prompt the chosen replica's queue bound
cannot take is refused at arrival), so the signals admission protects (TBT p99, queued tokens)
stay low while demand goes unserved. The same step in load runs twice through the autoscaled
fleet: with `max_refused_share` (the demand signal, the default) and with it off (`None`, the
autoscaler before issue 43). Printed: refusals and replicas per time bin, and the refused share
once the fleet has had time to grow (from the step + start-up delay + one cool-down on).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from autoscale.scaling import ScalingConfig, queued_tokens_threshold
from loadtests.sim.capacity import Criteria, find_capacity
from loadtests.sim.deploy import replica_spec
from loadtests.sim.simulator import SimConfig, SimResult, Simulator
from loadtests.sim.traffic import make_trace
from replicas.config import ReplicaOptions

ARMS = {"demand signal": 0.01, "without (before)": None}


def run(per_replica_rps: float | None = None, step_x: float = 4.0, duration_s: float = 1200.0,
        startup_s: float = 60.0, queue_timeout_s: float = 10.0, bin_s: float = 60.0,
        tbt_slo_ms: float = 100.0, seed: int = 0, gpu: str = "A100-80GB", model: str = "mistral-7b",
        workload: str = "sharegpt") -> dict[str, Any]:
    spec = replica_spec(gpu, model, "stall_free", 512)
    tbt_slo_s = tbt_slo_ms / 1000
    if per_replica_rps is None:
        unit = make_trace(workload, "poisson", n=1000, rate=1.0, seed=seed)
        per_replica_rps = find_capacity(SimConfig(spec, 1, router="round_robin", tbt_slo_s=tbt_slo_s), unit,
                                        Criteria(tbt_slo_s))["capacity_rps"]
    lo, hi, at_s = 0.5 * per_replica_rps, step_x * per_replica_rps, duration_s / 4
    trace = make_trace(workload, "step", duration_s=duration_s, lo=lo, hi=hi, at_s=at_s, seed=seed)
    grown_s = at_s + startup_s + startup_s / 2  # a start-up delay and one up cool-down after the step
    arms = {}
    for name, share in ARMS.items():
        scaling = ScalingConfig(min_replicas=1, max_replicas=2 * math.ceil(step_x), window_s=30.0,
                                upscale_cooldown_s=startup_s / 2, downscale_cooldown_s=60.0,
                                downscale_stable_s=30.0,
                                queued_tokens_per_replica=queued_tokens_threshold(ReplicaOptions().max_queued_tokens),
                                max_refused_share=share)
        cfg = SimConfig(spec, 1, router="token_load", tbt_slo_s=tbt_slo_s, scaling=scaling, scaling_interval_s=1.0,
                        startup_s=startup_s, seed=seed, shed=True, queue_timeout_s=queue_timeout_s)
        sim = Simulator(cfg, trace)
        res = sim.run()
        arms[name] = _timeline(res, sim, trace.arrival_s, bin_s, grown_s)
    return {"per_replica_rps": per_replica_rps, "step": [lo, hi, at_s], "grown_s": grown_s,
            "duration_s": duration_s, "startup_s": startup_s, "queue_timeout_s": queue_timeout_s,
            "tbt_slo_ms": tbt_slo_ms, "bin_s": bin_s, "arms": arms}


def _timeline(res: SimResult, sim: Simulator, arrivals: np.ndarray, bin_s: float, grown_s: float) -> dict[str, Any]:
    refused = np.array(sim.rec.rejected, dtype=bool)
    bins = (arrivals // bin_s).astype(int)
    nbins = int(bins.max()) + 1
    sent = np.bincount(bins, minlength=nbins)
    shed = np.bincount(bins, weights=refused, minlength=nbins).astype(int)
    ready = [0] * nbins  # ready replicas at each bin's end, from the scaler's decisions
    for t, n_ready, *_ in res.scaling:
        b = min(int(t // bin_s), nbins - 1)
        ready[b] = n_ready
    for b in range(1, nbins):
        ready[b] = ready[b] or ready[b - 1]
    late = arrivals >= grown_s
    s = res.summary
    return {"sent": sent.tolist(), "refused": shed.tolist(), "ready_replicas": ready,
            "refused_share_all": float(refused.mean()),
            "refused_share_after_growth": float(refused[late].mean()) if late.any() else 0.0,
            "max_replicas": s["max_replicas"], "ttft_p99_s": s["ttft_p99_s"],
            "tbt_p99_s": s["tbt_bucket_p99_s"], "replica_seconds": s.get("replica_seconds"),
            "reasons": sorted({why for *_, why in res.scaling if not why.startswith(("hold", "settling"))})}


def render(out: dict[str, Any]) -> str:
    lines = [f"step {out['step'][0]:.2f} -> {out['step'][1]:.2f} req/s at {out['step'][2]:.0f} s "
             f"(one replica: {out['per_replica_rps']:.2f} req/s); start-up {out['startup_s']:.0f} s; "
             f"queue deadline {out['queue_timeout_s']:.0f} s; TBT SLO {out['tbt_slo_ms']:.0f} ms", ""]
    names = list(out["arms"])
    head = f"{'t (s)':>7} {'sent':>6} " + " ".join(f"{n + ' refused/ready':>32}" for n in names)
    lines.append(head)
    first = out["arms"][names[0]]
    for b, sent in enumerate(first["sent"]):
        cells = " ".join(f"{a['refused'][b]:>24}/{a['ready_replicas'][b]:<7}" for a in out["arms"].values())
        lines.append(f"{b * out['bin_s']:>7.0f} {sent:>6} {cells}")
    lines.append("")
    for n, a in out["arms"].items():
        lines.append(f"{n:>18}: refused {a['refused_share_all']:.1%} of all, "
                     f"{a['refused_share_after_growth']:.2%} after {out['grown_s']:.0f} s; "
                     f"max replicas {a['max_replicas']}; TTFT p99 {a['ttft_p99_s']:.2f} s; "
                     f"scaled for {', '.join(a['reasons']) or 'nothing'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 600 s trace")
    p.add_argument("--per-replica-rps", type=float, help="default: measured (bisection, strict SLO)")
    p.add_argument("--step-x", type=float, default=4.0, help="the step's load in replicas' capacity")
    p.add_argument("--duration-s", type=float, default=1200.0)
    p.add_argument("--startup-s", type=float, default=60.0, help="replica start-up delay")
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("loadtests/out/sim_shedding.json"))
    args = p.parse_args(argv)
    out = run(args.per_replica_rps, args.step_x, 600.0 if args.quick else args.duration_s, args.startup_s,
              tbt_slo_ms=args.tbt_slo_ms, seed=args.seed)
    print(render(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
