"""A tensor-parallel pass's cost on this machine: TP=1 against TP=2 (gloo, a worker process),
and the share of rank 0's pass spent in collectives (the pass's message broadcast and the
sharded layers' all-reduces and gathers, timed by wrapping torch.distributed's calls).

    python -m loadtests.bench.tensor_parallel [--model embedded:mid] [--batch 16] [--json F]

On a CPU each rank gets one thread: TP=2 uses two cores where TP=1 uses one. Cost recorded, no
target (issue 50): on a GPU the collectives run over NVLink/PCIe and the picture differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from replicas import Engine, EngineConfig, SamplingParams

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")


class CollectiveClock:
    """Seconds rank 0 spends in each torch.distributed collective while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def __enter__(self) -> CollectiveClock:
        for name, fn in self._saved.items():
            setattr(dist, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _timed(self, name: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return call


def measure(model: str, tp: int, batch: int, steps: int, prompt_len: int) -> dict:
    engine = Engine.from_pretrained(model, EngineConfig(tensor_parallel_size=tp, num_threads=1,
                                                        max_batch_prefill_tokens=batch * prompt_len))
    try:
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(7 * i + j) % 200 + 3 for j in range(prompt_len)], params)
        engine.step()  # the prompts (one pass)
        for _ in range(3):
            engine.step()
        times = []
        with CollectiveClock() as clock:
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
        collective_s = sum(clock.seconds.values())
        return {"tp": tp, "batch": batch, "pass_ms_median": 1e3 * statistics.median(times),
                "collective_ms_per_pass": 1e3 * collective_s / steps,
                "collective_share": collective_s / sum(times),
                "collectives_per_pass": {k: v / steps for k, v in clock.calls.items()},
                "kv_heads_per_rank": engine.runner.k_cache.shape[2]}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:mid")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(args.model, tp, args.batch, args.steps, args.prompt_len)
            for _ in range(args.rounds) for tp in (1, 2)]
    by_tp = {tp: [r for r in rows if r["tp"] == tp] for tp in (1, 2)}
    summary = [{"tp": tp, "pass_ms_median": statistics.median(r["pass_ms_median"] for r in rs),
                "collective_ms_per_pass": statistics.median(r["collective_ms_per_pass"] for r in rs),
                "collective_share": statistics.median(r["collective_share"] for r in rs),
                "collectives_per_pass": rs[-1]["collectives_per_pass"], "kv_heads_per_rank": rs[-1]["kv_heads_per_rank"]}
               for tp, rs in by_tp.items()]
    print(f"{args.model}, {args.batch} running decodes, {args.steps} passes x {args.rounds} rounds, 1 thread per rank")
    print(f"{'tp':>3} {'pass ms':>9} {'collective ms':>14} {'share':>7}  collectives per pass")
    for s in summary:
        calls = ", ".join(f"{k} {v:g}" for k, v in sorted(s["collectives_per_pass"].items()))
        print(f"{s['tp']:>3} {s['pass_ms_median']:>9.2f} {s['collective_ms_per_pass']:>14.2f} "
              f"{s['collective_share']:>7.1%}  {calls or '-'}")
    print(f"TP=2 / TP=1 pass time: {summary[1]['pass_ms_median'] / summary[0]['pass_ms_median']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                       "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
