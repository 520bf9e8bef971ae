"""Engine overhead per iteration outside the forward pass, at N running decodes.

    python -m loadtests.bench.overhead [--decodes 256] [--steps 60] [--stream-interval-ms MS] [--json PATH]

Fills the engine with N requests (short prompts, ignore_eos, long max_tokens), runs until every
one of them is decoding, then times `steps` iterations of what the replica's loop thread does
per pass (`Engine.step()`, metrics observer attached, and the load snapshot the loop publishes).
The model's forward call is timed on its own (attention included: it runs inside the model), so

    overhead = iteration - forward = schedule + metadata + sampling + postprocess + metrics + load

As in a replica, the deltas' text is decoded off the loop, where each stream is read
(`OutputProcessor.deltas_by_caller`, `StreamText`): that work is timed on its own (`caller text`),
not in the overhead; `--text-on-loop` decodes on the loop instead (the offline engine's way).

Three cases: all greedy; half the rows sampling with temperature/top-p/top-k (the per-row cost
of sampling shows there); all greedy with one decode whose context is `--long-prompt` tokens
(the cost of padding every decode to the longest context shows there, in the forward pass).
Medians over the timed steps; noisy machine, read ratios.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from loadtests.harness.report import OMIT, bench_parser, write_json
from replicas import Engine, EngineConfig, SamplingParams
from replicas.config import DEFAULT_STREAM_INTERVAL_MS
from replicas.outputs import StreamText
from replicas.serving.metric_backends import PrometheusBackend
from replicas.serving.metrics import EngineMetrics


class _Timed:
    """Wraps a callable and records the wall time of each call under `name`."""

    def __init__(self, fn: Any, name: str, times: dict[str, list[float]]) -> None:
        self.fn, self.name, self.times = fn, name, times

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times[self.name].append(time.perf_counter() - t)
            self.times[self.name + "_cpu"].append(time.thread_time() - c)

    def __getattr__(self, item: str) -> Any:  # the runner reads e.g. model.config
        return getattr(self.fn, item)


def _publish(engine: Engine) -> None:
    """What the async loop thread adds per pass to publish the load (AsyncEngine._publish)."""
    if hasattr(engine, "last_load"):
        _ = engine.last_load, tuple(engine.recent_tbt)
    else:  # before the one-load-record change the loop built engine.load() twice per pass
        engine.load()
        engine.load()


def measure(model: str, decodes: int, steps: int, sampled: bool, threads: int,
            long_prompt: int = 0, stream_interval_ms: float = 0.0, deltas_by_caller: bool = True) -> dict[str, float]:
    config = EngineConfig(max_num_seqs=decodes, max_batch_prefill_tokens=max(512, decodes * 2),
                          max_batch_total_tokens=decodes * 512, num_threads=threads)
    engine = Engine.from_pretrained(model, config)
    if stream_interval_ms:  # as the replica's async engine sets it (replica.stream_interval_ms)
        engine.stream_interval_s = stream_interval_ms / 1000
    engine.outputs.deltas_by_caller = deltas_by_caller
    engine.observers.append(EngineMetrics(PrometheusBackend(), model, tbt_slo_s=0.1))
    vocab = engine.vocab_size
    reqs = []
    g = torch.Generator().manual_seed(0)
    for i in range(decodes):
        prompt = torch.randint(10, vocab, (long_prompt if i == 0 and long_prompt else 32,), generator=g).tolist()
        if sampled and i % 2:
            params = SamplingParams(max_tokens=400, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        reqs.append(engine.add_request(prompt, params))
    text = StreamText.of(engine.tokenizer, reqs)
    def step_untimed() -> None:  # each stream decodes every delta it gets, its first ones too
        for out in engine.step():
            text.fill(out)

    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        step_untimed()
    for _ in range(5):  # warm-up decodes
        step_untimed()
    times: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    runner.model = _Timed(runner.model, "forward", times)
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        _publish(engine)
        times["iteration"].append(time.perf_counter() - t)
        times["iteration_cpu"].append(time.thread_time() - c)
        t = time.perf_counter()
        for out in outputs:  # what the streams do on their own loop (`AsyncEngine._iterate`)
            text.fill(out)
        times["caller_text"].append(time.perf_counter() - t)
    assert len(engine.scheduler.running) == decodes, "every request must still be decoding"
    runner.model = runner.model.fn
    it, fw = times["iteration"], times["forward"]
    overhead = [a - b for a, b in zip(it, fw)]
    # The same on this thread's CPU clock: time the thread was scheduled out (a busy machine)
    # does not count, so it is steadier than the wall clock (with 1 torch thread the forward runs
    # on this thread too).
    overhead_cpu = [a - b for a, b in zip(times["iteration_cpu"], times["forward_cpu"])]
    return {"iteration_ms": 1e3 * statistics.median(it), "forward_ms": 1e3 * statistics.median(fw),
            "overhead_ms": 1e3 * statistics.median(overhead), "overhead_cpu_ms": 1e3 * statistics.median(overhead_cpu),
            "caller_text_ms": 1e3 * statistics.mean(times["caller_text"])}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("loadtests.bench.overhead", __doc__, model="embedded:tiny", seed=OMIT, threads=2)
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--long-prompt", type=int, default=1536,
                   help="greedy+long: one of the decodes has this long a context")
    p.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="a stream's deltas built at most this often, as a replica's (its default: "
                        f"{DEFAULT_STREAM_INTERVAL_MS:g}); 0: every pass")
    p.add_argument("--text-on-loop", action="store_true",
                   help="decode the deltas' text on the loop (the offline engine), not the caller's side")
    args = p.parse_args(argv)
    rows = {}
    print(f"{args.model}, {args.decodes} running decodes, {args.steps} timed passes, medians")
    print(f"{'case':<12} {'iteration ms':>13} {'forward ms':>11} {'overhead ms':>12} {'overhead cpu ms':>16}"
          f" {'caller text ms':>15}")
    for name, sampled, long_prompt in (("greedy", False, 0), ("mixed", True, 0),
                                       ("greedy+long", False, args.long_prompt)):
        row = measure(args.model, args.decodes, args.steps, sampled, args.threads, long_prompt,
                      args.stream_interval_ms, not args.text_on_loop)
        rows[name] = row
        print(f"{name:<12} {row['iteration_ms']:>13.2f} {row['forward_ms']:>11.2f} {row['overhead_ms']:>12.2f}"
              f" {row['overhead_cpu_ms']:>16.2f} {row['caller_text_ms']:>15.2f}")
    if args.json:
        write_json(args.json, {"model": args.model, "decodes": args.decodes, "steps": args.steps,
                               "threads": args.threads, "stream_interval_ms": args.stream_interval_ms,
                               "deltas_by_caller": not args.text_on_loop,
                               "results": rows})


if __name__ == "__main__":
    main()
