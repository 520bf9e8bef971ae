"""Serving fixed-seed traces on the real engine, for calibration: CPU-time clocks, interleaved runs.

The machine is shared: wall time includes other tenants' work, and even a thread's CPU time
stretches when neighbours load the caches and memory bus. So each run's clock is the CPU time
of its own `Engine.step()` calls (torch runs on the stepping thread with one intra-op thread),
advanced straight to the next arrival when its engine is idle, and the runs are served
interleaved, one step of each in turn, sharing one model, so that whatever the neighbours do
lands on every run alike.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.sim.costmodel import batch_features, features, load_profiles
from loadtests.sim.traffic import Trace, length_dist
from loadtests.harness.stats import percentile
from loadtests.harness.workloads import chat_workload

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
    from replicas.loading.models import load_model

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
                              "block_size": engine.block_size},
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
    return {"tbt_p50_s": percentile(gaps, 50), "tbt_p99_s": percentile(gaps, 99),
            "ttft_p50_s": percentile(ttft, 50),
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
    """Serve several traces at once, one step of each in turn, each on its own CPU-time clock."""
    live = list(runs)
    while live:
        for run in list(live):
            if run.done:
                live.remove(run)
            else:
                run.tick()
    return {r.name: r.result() for r in runs}


