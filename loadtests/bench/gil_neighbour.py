"""Engine passes beside a busy neighbour: a thread of the same process against another process.

    python -m loadtests.bench.gil_neighbour [--decodes 128] [--steps 120] [--busy 0.36] [--rounds 3] [--seed 0] [--json PATH]

Why `replica.engine_process` exists. A replica's event loop (HTTP, SSE writes, admission,
detokenizing) runs in bursts of pure Python. Here a neighbour does the same kind of work
(`json.dumps` of a chunk-sized dict) for 1 ms at a time, busy `--busy` of the wall time, while the
engine runs `--steps` decode passes of `--decodes` requests on one torch thread, each case from
the same fresh batch (contexts 38 to 38 + steps tokens):

- alone: no neighbour;
- thread: the neighbour on a thread of the engine's process (the engine loop on a thread of the
  replica, the default): every torch call releases the GIL and waits to get it back;
- thread, 0.5 ms switch interval: the same with `sys.setswitchinterval(0.0005)` (default 5 ms);
- process: the neighbour in another process (the engine loop in a process of its own), the
  GIL not shared; it still shares the machine's cores.

Pass wall time p50 / p90 / p99 (ms), each case `--rounds` times, interleaved; noisy machine:
compare within one run.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from loadtests.harness.report import bench_parser, report
from replicas import Engine, EngineConfig, SamplingParams

BURST_S = 0.001
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
         "choices": [{"index": i, "delta": {"content": "hello there"}, "finish_reason": None} for i in range(8)]}
CASES = ("alone", "thread", "thread, 0.5 ms switch interval", "process")


def busy_loop(stop: Any, busy: float) -> None:
    """Pure-Python bursts of BURST_S, `busy` of the wall time, until `stop` is set."""
    idle = BURST_S * (1 - busy) / busy
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < BURST_S:
            json.dumps(CHUNK)
        time.sleep(idle)


class Bench:
    def __init__(self, model: str, decodes: int, steps: int, seed: int = 0) -> None:
        self.engine = Engine.from_pretrained(model, EngineConfig(
            max_num_seqs=decodes, max_batch_prefill_tokens=max(512, decodes * 2),
            max_batch_total_tokens=decodes * 1024, num_threads=1))
        self.decodes, self.steps, self._n = decodes, steps, 0
        self._gen = torch.Generator().manual_seed(seed)

    def _fill(self) -> None:
        """A fresh batch, every request decoding (prefill passes run here, untimed)."""
        eng = self.engine
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        for _ in range(self.decodes):
            self._n += 1
            prompt = torch.randint(10, eng.vocab_size, (32,), generator=self._gen).tolist()
            eng.add_request(prompt, SamplingParams(max_tokens=self.steps + 50, ignore_eos=True), f"r{self._n}")
        for _ in range(6):
            eng.step()

    def passes(self) -> list[float]:
        self._fill()
        times = []
        for _ in range(self.steps):
            t = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t)
        return times


def with_neighbour(case: str, busy: float, fn: Callable[[], list[float]]) -> list[float]:
    if case == "alone":
        return fn()
    if case == "process":
        ctx = multiprocessing.get_context("spawn")
        stop: Any = ctx.Event()
        worker: Any = ctx.Process(target=busy_loop, args=(stop, busy), daemon=True)
        worker.start()
        time.sleep(1.0)  # its interpreter started
    else:
        stop = threading.Event()
        worker = threading.Thread(target=busy_loop, args=(stop, busy), daemon=True)
        worker.start()
    before = sys.getswitchinterval()
    if "switch" in case:
        sys.setswitchinterval(0.0005)
    try:
        return fn()
    finally:
        sys.setswitchinterval(before)
        stop.set()
        worker.join()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def run(model: str, decodes: int, steps: int, busy: float, rounds: int, seed: int = 0) -> dict[str, Any]:
    bench = Bench(model, decodes, steps, seed)
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
    for _ in range(rounds):
        for case in CASES:
            t = with_neighbour(case, busy, bench.passes)
            rows[case].append({"p50_ms": pct(t, 0.5), "p90_ms": pct(t, 0.9), "p99_ms": pct(t, 0.99)})
    return {case: {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"rounds": runs}
            for case, runs in rows.items()}


def table(results: dict[str, Any]) -> str:
    alone = results["alone"]["p50_ms"]
    lines = [f"{'neighbour':34} {'p50':>7} {'p90':>7} {'p99':>7} {'p50 x alone':>12}"]
    for case in CASES:
        r = results[case]
        lines.append(f"{case:34} {r['p50_ms']:7.2f} {r['p90_ms']:7.2f} {r['p99_ms']:7.2f} {r['p50_ms'] / alone:12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("loadtests.bench.gil_neighbour", __doc__, model="embedded:tiny")
    p.add_argument("--decodes", type=int, default=128)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--busy", type=float, default=0.36, help="the neighbour's busy share of wall time "
                   "(0.36: the replica's event loop under overload, py-spy)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    results = run(args.model, args.decodes, args.steps, args.busy, args.rounds, args.seed)
    return report(f"pass wall time, ms (medians of {args.rounds} rounds; {args.decodes} decodes, "
                  f"neighbour busy {args.busy:.0%})\n" + table(results),
                  {"model": args.model, "decodes": args.decodes, "steps": args.steps, "busy": args.busy,
                   "results": results}, args.json)


if __name__ == "__main__":
    main()
