"""Calibrate the cost model against the real engine, then check the simulator on a held-out run.

    python -m loadtests.sim.calibrate [--model embedded:mid] [--json docs/results/sim_calibration.json]
    python -m loadtests.sim.calibrate --iterations iters.json   # fit timings logged elsewhere (a GPU)

1. Fit run: the real `replicas.Engine` serves a fixed-seed chat trace (Poisson arrivals, one
   torch thread). Every step's IterationStats (prefill, decode, context tokens, sequences) is
   paired with the step's time: the engine's own `duration` covers the forward pass and
   sampling, while every token also waits for the loop's schedule and postprocess, so the
   whole step is what TBT is made of. Time is the stepping thread's CPU time, and the runs are
   served interleaved, one step of each in turn (`enginerun.py`): this machine's 2 cores are
   shared, and neighbours would otherwise slow one run more than another.
2. The cost model's coefficients are fitted by least squares, in the linear (`sum`) and the
   roofline (`max`) form; both fit errors are reported and the better one is kept.
3. Held-out runs (other seeds, a rate between the fit runs' rates; and an offline burst that
   saturates the engine) are served by the engine and simulated with the fitted model (same
   requests, same arrival times, same budgets and KV size); the report compares p50 TBT and
   throughput.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.sim.costmodel import fit, fit_error
from loadtests.sim.enginerun import PLAN, EngineRun, load_runs, save_runs, serve_runs
from loadtests.sim.replica import ReplicaSpec
from loadtests.sim.simulator import SimConfig, Simulator
from replicas.config import EngineConfig

DEFAULT_JSON = Path("docs/results/sim_calibration.json")


# Each compared metric: the engine run's key (exact nearest-rank) and the simulator's (its TBT
# percentiles are 0.1 ms histogram bin edges, at most one bin above the nearest-rank gap).
COMPARED = {"tbt_p50_s": "tbt_bucket_p50_s", "tbt_p99_s": "tbt_bucket_p99_s", "ttft_p50_s": "ttft_p50_s",
            "output_tokens_per_s": "output_tokens_per_s"}


def simulate_run(run: EngineRun, spec: ReplicaSpec) -> dict[str, float]:
    """The simulator's prediction for a run the engine served (same trace, budgets, KV size)."""
    res = Simulator(SimConfig(spec, 1, router="round_robin"), run.trace).run()
    s = res.summary
    return {k: s[k] for k in (*COMPARED.values(), "duration_s", "iterations")}


def compare(real: dict[str, float], sim: dict[str, float]) -> dict[str, float]:
    """Relative error of the simulator per compared metric, keyed by the engine's name."""
    return {k: sim[sk] / real[k] - 1.0 for k, sk in COMPARED.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.iterations:
        return fit_file(args.iterations)
    if args.load_runs:
        runs, info = load_runs(args.load_runs)
    else:
        runs, info = serve_runs(args)
        if args.save_runs:
            save_runs(args.save_runs, runs, info)
    report = build_report(args, runs, info)
    print_report(report)
    write_report(args.json, report, runs)
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:mid")
    ap.add_argument("--policy", default="stall_free")
    ap.add_argument("--mbp", type=int, default=256)
    ap.add_argument("--mbt", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1.0, help="scale every run's request count")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save-runs", type=Path, help="also store the engine runs here (for --load-runs)")
    ap.add_argument("--load-runs", type=Path, help="refit and resimulate stored runs; no engine")
    ap.add_argument("--iterations", type=Path, help="fit IterationStats dicts from this JSON file and exit")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    return ap


def build_report(args: argparse.Namespace, runs: dict[str, EngineRun], info: dict[str, Any]) -> dict[str, Any]:
    """Fit both forms on the fit runs, keep the better, and simulate every run with it."""
    fit_names = [name for name, *_, used in PLAN if used and name in runs]
    x = np.vstack([runs[k].xy()[0] for k in fit_names])
    y = np.concatenate([runs[k].xy()[1] for k in fit_names])
    fits = {form: fit(x, y, form) for form in ("sum", "max")}
    errors = {form: fit_error(m, x, y) for form, m in fits.items()}
    best = min(fits, key=lambda f: errors[f]["rel_err_mean"])
    spec = ReplicaSpec(EngineConfig(**{**info["engine_config"], "enable_prefix_caching": False}), info["num_blocks"], fits[best], info["max_model_len"])
    held = {}
    for name, run in runs.items():
        xh, yh = run.xy()
        real, sim = run.metrics(), simulate_run(run, spec)
        held[name] = {"used_for_fit": name in fit_names, "real": real, "sim": sim, "error": compare(real, sim),
                      "iteration_fit_error": fit_error(fits[best], xh, yh), "engine_iterations": len(yh)}
    all_iters = [d for r in runs.values() for d in r.iterations]
    return {
        "model": args.model, **info, "torch_threads": args.threads,
        "replayed_from": str(args.load_runs) if args.load_runs else None,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "fit_runs": fit_names,
        "fit": {form: {"coefficients": fits[form].to_dict(), "error": errors[form]} for form in fits},
        "chosen_form": best,
        "step_minus_forward_s_mean": float(np.mean([d["step_wall_s"] - d["duration"] for d in all_iters])),
        "wall_over_cpu_step_median": {k: float(np.median([d["step_wall_s"] / max(d["step_s"], 1e-9)
                                                          for d in r.iterations])) for k, r in runs.items()},
        "runs": held, "target": "within 15% on p50 TBT and throughput (held-out runs)",
        "traces": {k: r.trace.summary() for k, r in runs.items()},
    }


def write_report(path: Path, report: dict[str, Any], runs: dict[str, EngineRun]) -> None:
    """The report as JSON, and every engine iteration as CSV next to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=float))
    print(f"wrote {path}")
    csv_path = path.with_name(path.stem + "_iterations.csv")
    with open(csv_path, "w", newline="") as f:
        cols = ["run", "start", "step_s", "step_wall_s", "duration", "num_prefill_tokens", "num_decode_tokens",
                "context_tokens", "num_seqs", "pairs", "padded"]
        w = csv.writer(f)
        w.writerow(cols)
        for name, r in runs.items():
            for d in r.iterations:
                w.writerow([name] + [d[c] for c in cols[1:]])
    print(f"wrote {csv_path}")


def fit_file(path: Path) -> dict[str, Any]:
    """Fit coefficients to IterationStats dicts (`step_s` if present, else `duration`)."""
    rows = json.loads(path.read_text())
    x = np.array([[r["num_prefill_tokens"], r["num_decode_tokens"], r["context_tokens"], r["num_seqs"],
                   r.get("pairs", 0), r.get("padded", 0)] for r in rows], dtype=float)
    y = np.array([r.get("step_s", r["duration"]) for r in rows])
    out = {}
    for form in ("sum", "max"):
        m = fit(x, y, form)
        out[form] = {"coefficients": m.to_dict(), "error": fit_error(m, x, y)}
        print(form, json.dumps(out[form], indent=1))
    return out


def print_report(r: dict[str, Any]) -> None:
    n_fit = sum(r["runs"][k]["engine_iterations"] for k in r["fit_runs"])
    print(f"\nfit on {n_fit} iterations of {r['model']} ({r['engine_config']['policy']}): {', '.join(r['fit_runs'])}")
    for form, f in r["fit"].items():
        e = f["error"]
        print(f"  {form:3s}: per-iteration |err| p50 {e['rel_err_p50']:.1%} p90 {e['rel_err_p90']:.1%}"
              f" mean {e['rel_err_mean']:.1%}  R2 {e['r2']:.3f}")
    print(f"  chosen: {r['chosen_form']}  (step minus forward pass: {r['step_minus_forward_s_mean'] * 1e3:.1f} ms;"
          f" wall/CPU per step: {', '.join(f'{k} {v:.2f}' for k, v in r['wall_over_cpu_step_median'].items())})")
    print(f"\n{'run':22s} {'metric':20s} {'engine':>10s} {'simulator':>10s} {'error':>8s}")
    for name, h in sorted(r["runs"].items(), key=lambda kv: kv[1]["used_for_fit"], reverse=True):
        for k, sk in COMPARED.items():
            print(f"{name:22s} {k:20s} {h['real'][k]:10.4f} {h['sim'][sk]:10.4f} {h['error'][k]:+8.1%}")


if __name__ == "__main__":
    main()
