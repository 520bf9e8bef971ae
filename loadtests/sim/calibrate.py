"""Calibrate the cost model against the real engine, then check the simulator on a held-out run.

    python -m loadtests.sim.calibrate [--model embedded:mid] [--json docs/sim_calibration.json]
    python -m loadtests.sim.calibrate --iterations iters.json   # fit timings logged elsewhere (a GPU)

1. Fit run: the real `replicas.Engine` serves a fixed-seed chat trace (Poisson arrivals, one
   torch thread). Every step's IterationStats (prefill, decode, context tokens, sequences) is
   paired with the step's time: the engine's own `duration` covers the forward pass and
   sampling, while every token also waits for the loop's schedule and postprocess, so the
   whole step is what TBT is made of. Time is the stepping thread's CPU time, and the runs are
   served interleaved, one step of each in turn (see `drive`): this machine's 2 cores are
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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.sim.costmodel import CostModel, batch_features, features, fit, fit_error
from loadtests.sim.replica import ReplicaSpec
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import Trace, length_dist
from loadtests.sim.costmodel import load_profiles
from loadtests.workloads import chat_workload

DEFAULT_JSON = Path("docs/sim_calibration.json")


@dataclass
class EngineRun:
    """What the real engine did with one trace."""

    name: str
    trace: Trace
    iterations: list[dict[str, Any]]  # IterationStats as dicts, plus "step_s"
    token_times: list[list[float]]  # per request, seconds from the run's start
    wall_s: float

    def xy(self) -> tuple[np.ndarray, np.ndarray]:
        class _S:  # IterationStats-like view of a dict
            def __init__(self, d: dict[str, Any]) -> None:
                self.__dict__.update(d)
        return features(_S(d) for d in self.iterations), np.array([d["step_s"] for d in self.iterations])

    def metrics(self) -> dict[str, float]:
        return run_metrics(self.trace.arrival_s.tolist(), self.token_times)


def run_metrics(arrivals: list[float], token_times: list[list[float]]) -> dict[str, float]:
    """p50/p99 pooled TBT, p50 TTFT and throughput, defined as the simulator defines them."""
    gaps = [b - a for tt in token_times for a, b in zip(tt, tt[1:])]
    ttft = [tt[0] - a for a, tt in zip(arrivals, token_times) if tt]
    out_tokens = sum(len(tt) for tt in token_times)
    span = max(tt[-1] for tt in token_times if tt) - min(arrivals)
    return {"tbt_p50_s": float(np.percentile(gaps, 50, method="inverted_cdf")),
            "tbt_p99_s": float(np.percentile(gaps, 99, method="inverted_cdf")),
            "ttft_p50_s": float(np.percentile(ttft, 50, method="inverted_cdf")),
            "output_tokens_per_s": out_tokens / span, "duration_s": span}


def cpu_trace(name: str, n: int, seed: int, rate: float | None, vocab: int, avoid: list[int]):
    """A chat workload (token ids for the engine) and the same requests as a simulator trace."""
    spec = load_profiles()["workloads"]["chat-cpu"]
    wl = chat_workload(n, vocab, seed, prompt=length_dist(spec["prompt"]), output=length_dist(spec["output"]),
                       rate=rate, avoid_ids=avoid)
    trace = Trace(name, np.array([r.arrival_s for r in wl.requests]), np.array(wl.prompt_lens),
                  np.array(wl.output_lens), {"workload": "chat-cpu", "seed": seed, "rate": rate})
    return wl, trace


class BatchShapes:
    """Engine observer: the cost model's features of each pass's batch (IterationStats lacks two)."""

    def __init__(self) -> None:
        self.last: tuple[int, ...] = (0,) * 6

    def on_iteration(self, stats: Any, batch: Any, engine: Any) -> None:
        self.last = batch_features(batch)

    def on_abort(self, request: Any) -> None:
        pass


class _Run:
    """One trace being served by one engine on its own CPU-time clock."""

    def __init__(self, engine: Any, wl: Any, trace: Trace, name: str) -> None:
        self.engine, self.trace, self.name = engine, trace, name
        self.requests = list(wl.requests)
        self.pending = list(wl.requests)
        self.times: dict[str, list[float]] = {r.request_id: [] for r in self.pending}
        self.iters: list[dict[str, Any]] = []
        self.vt = 0.0
        self.wall_s = 0.0
        self.shapes = BatchShapes()
        engine.observers.append(self.shapes)

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    def tick(self) -> None:
        """Admit what has arrived by the run's clock, then run one step (or jump to the next arrival)."""
        from replicas.request import SamplingParams

        engine = self.engine
        while self.pending and self.pending[0].arrival_s <= self.vt:
            r = self.pending.pop(0)
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(r.prompt_token_ids, params, request_id=r.request_id, arrival_time=r.arrival_s)
        if not engine.has_unfinished():
            self.vt = self.pending[0].arrival_s
            return
        before = len(engine.iterations)
        c0, w0 = time.thread_time(), time.perf_counter()
        outs = engine.step()
        step_cpu, step_wall = time.thread_time() - c0, time.perf_counter() - w0
        self.vt += step_cpu
        self.wall_s += step_wall
        for o in outs:
            self.times[o.request_id].extend([self.vt] * len(o.delta_token_ids))
        if len(engine.iterations) > before:
            it = engine.iterations[-1]
            _, _, _, _, pairs, padded = self.shapes.last
            self.iters.append({**asdict(it), "start": self.vt - step_cpu, "step_s": step_cpu,
                               "step_wall_s": step_wall, "pairs": pairs, "padded": padded})

    def result(self) -> EngineRun:
        return EngineRun(self.name, self.trace, self.iters, [self.times[r.request_id] for r in self.requests],
                         self.wall_s)


def drive(runs: list[_Run]) -> dict[str, EngineRun]:
    """Serve several traces at once, one step of each in turn, each on its own CPU-time clock.

    The machine is shared: wall time includes other tenants' work, and even a thread's CPU time
    stretches when neighbours load the caches and memory bus. A run's clock is the CPU time of
    its own steps (torch runs on the stepping thread with one intra-op thread), advanced
    straight to the next arrival when its engine is idle. Interleaving the runs step by step
    spreads whatever the neighbours do evenly over the fit and the held-out runs.
    """
    live = list(runs)
    while live:
        for run in list(live):
            if run.done:
                live.remove(run)
            else:
                run.tick()
    return {r.name: r.result() for r in runs}


def simulate_run(run: EngineRun, spec: ReplicaSpec) -> dict[str, float]:
    """The simulator's prediction for a run the engine served (same trace, budgets, KV size)."""
    res = Simulator(SimConfig(spec, 1, router="round_robin"), run.trace).run()
    s = res.summary
    return {"tbt_p50_s": s["tbt_p50_s"], "tbt_p99_s": s["tbt_p99_s"], "ttft_p50_s": s["ttft_p50_s"],
            "output_tokens_per_s": s["output_tokens_per_s"], "duration_s": s["duration_s"],
            "iterations": s["iterations"]}


def compare(real: dict[str, float], sim: dict[str, float]) -> dict[str, float]:
    return {k: sim[k] / real[k] - 1.0 for k in ("tbt_p50_s", "tbt_p99_s", "ttft_p50_s", "output_tokens_per_s")}


# (name, seed, Poisson rate or None for all at t=0, requests, used for the fit)
# The fit runs span light load, overload and a burst; the held-out runs are other seeds at a
# rate in between, and another burst.
PLAN = [("fit_poisson_1.0", 1, 1.0, 24, True), ("fit_poisson_2.5", 3, 2.5, 24, True),
        ("fit_burst", 5, None, 20, True),
        ("held_out_poisson_1.6", 2, 1.6, 36, False), ("held_out_burst", 4, None, 20, False)]


def serve_runs(args: argparse.Namespace) -> tuple[dict[str, EngineRun], dict[str, Any]]:
    """Run the plan on real engines (one per trace, sharing the model); returns the runs and the
    engine facts the simulator needs."""
    import torch

    from replicas import Engine, EngineConfig
    from replicas.models import load_model

    torch.set_num_threads(args.threads)
    cfg = EngineConfig(policy=args.policy, max_batch_prefill_tokens=args.mbp, max_batch_total_tokens=args.mbt,
                       max_num_seqs=args.max_num_seqs, num_threads=args.threads)
    model, tokenizer = load_model(args.model, dtype=cfg.dtype, device=cfg.device)
    runs = []
    for name, seed, rate, n, _ in PLAN:
        engine = Engine(model, tokenizer, cfg)
        if not runs:
            engine.generate([[5] * 64] * 4, None)  # warm up kernels and the allocator
        wl, trace = cpu_trace(name, max(4, int(n * args.scale)), seed, rate, engine.vocab_size,
                              sorted(engine.eos_token_ids))
        print(f"{name}: {len(wl)} requests, {f'Poisson {rate}/s' if rate else 'all at t=0'}", flush=True)
        runs.append(_Run(engine, wl, trace, name))
    print("serving them interleaved, one step each in turn ...", flush=True)
    out = drive(runs)
    info = {"engine_config": {"policy": args.policy, "max_batch_prefill_tokens": args.mbp,
                              "max_batch_total_tokens": args.mbt, "max_num_seqs": args.max_num_seqs,
                              "block_size": cfg.block_size},
            "num_blocks": engine.blocks.num_blocks, "max_model_len": engine.max_model_len}
    return out, info


def save_runs(path: Path, runs: dict[str, EngineRun], info: dict[str, Any]) -> None:
    data = {"info": info, "runs": {k: {"trace": {"arrival_s": r.trace.arrival_s.tolist(),
                                                  "prompt_len": r.trace.prompt_len.tolist(),
                                                  "output_len": r.trace.output_len.tolist(),
                                                  "settings": r.trace.settings},
                                        "iterations": r.iterations, "token_times": r.token_times,
                                        "wall_s": r.wall_s} for k, r in runs.items()}}
    path.write_text(json.dumps(data))


def load_runs(path: Path) -> tuple[dict[str, EngineRun], dict[str, Any]]:
    data = json.loads(path.read_text())
    runs = {}
    for k, r in data["runs"].items():
        t = r["trace"]
        trace = Trace(k, np.array(t["arrival_s"]), np.array(t["prompt_len"]), np.array(t["output_len"]),
                      t["settings"])
        runs[k] = EngineRun(k, trace, r["iterations"], r["token_times"], r["wall_s"])
    return runs, data["info"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
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
    args = ap.parse_args(argv)

    if args.iterations:
        return fit_file(args.iterations)
    if args.load_runs:
        runs, info = load_runs(args.load_runs)
    else:
        runs, info = serve_runs(args)
        if args.save_runs:
            save_runs(args.save_runs, runs, info)

    fit_names = [name for name, *_, used in PLAN if used and name in runs]
    x = np.vstack([runs[k].xy()[0] for k in fit_names])
    y = np.concatenate([runs[k].xy()[1] for k in fit_names])
    fits = {form: fit(x, y, form) for form in ("sum", "max")}
    errors = {form: fit_error(m, x, y) for form, m in fits.items()}
    best = min(fits, key=lambda f: errors[f]["rel_err_mean"])
    from replicas.config import EngineConfig

    held = {}
    for name, run in runs.items():
        xh, yh = run.xy()
        spec = ReplicaSpec(EngineConfig(**info["engine_config"]), info["num_blocks"], fits[best],
                           info["max_model_len"])
        real, sim = run.metrics(), simulate_run(run, spec)
        held[name] = {"used_for_fit": name in fit_names, "real": real, "sim": sim, "error": compare(real, sim),
                      "iteration_fit_error": fit_error(fits[best], xh, yh), "engine_iterations": len(yh)}
    all_iters = [d for r in runs.values() for d in r.iterations]
    report = {
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
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=float))
    print(f"wrote {args.json}")
    csv_path = args.json.with_name(args.json.stem + "_iterations.csv")
    with open(csv_path, "w", newline="") as f:
        cols = ["run", "start", "step_s", "step_wall_s", "duration", "num_prefill_tokens", "num_decode_tokens",
                "context_tokens", "num_seqs", "pairs", "padded"]
        w = csv.writer(f)
        w.writerow(cols)
        for name, r in runs.items():
            for d in r.iterations:
                w.writerow([name] + [d[c] for c in cols[1:]])
    print(f"wrote {csv_path}")
    return report


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
        for k in ("tbt_p50_s", "tbt_p99_s", "ttft_p50_s", "output_tokens_per_s"):
            print(f"{name:22s} {k:20s} {h['real'][k]:10.4f} {h['sim'][k]:10.4f} {h['error'][k]:+8.1%}")


if __name__ == "__main__":
    main()
