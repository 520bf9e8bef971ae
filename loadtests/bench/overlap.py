"""The device's idle time between passes, synchronous loop against overlapped, on a stand-in device.

    python -m loadtests.bench.overlap [--decodes 256] [--device-ms 5] [--steps 40] [--json PATH]

Without a GPU: each pass's device side (the real forward and sampling) runs on a worker thread
that then holds the pass until `--device-ms` after it started, sleeping so the host thread runs
meanwhile (`replicas.execution.device_queue.StandInDevice`), as a GPU would. With N running decodes the
engine steps `--steps` times in each loop, alternately; per pass we print the device's idle time
(from the end of one pass to the start of the next), the pass's device time and the step's wall
time, medians. Synchronously the device idles for the host's whole work per pass (postprocess,
schedule, prepare); overlapped it idles only for what the host's work exceeds the device time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from loadtests.harness.report import OMIT, bench_parser, write_json
from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.device_queue import StandInDevice
from replicas.serving.metric_backends import PrometheusBackend
from replicas.serving.metrics import EngineMetrics


def decoding_engine(model: str, decodes: int, overlap: str, device_s: float, threads: int) -> Engine:
    """An engine with `decodes` greedy requests all decoding, on a stand-in device."""
    config = EngineConfig(max_num_seqs=decodes, max_batch_prefill_tokens=max(512, decodes * 2),
                          max_batch_total_tokens=decodes * 512, num_threads=threads, overlap=overlap)
    engine = Engine.from_pretrained(model, config)
    engine.observers.append(EngineMetrics(PrometheusBackend(), model, tbt_slo_s=0.1))
    g = torch.Generator().manual_seed(0)
    for _ in range(decodes):
        prompt = torch.randint(10, engine.vocab_size, (32,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    engine.runner.device_queue = StandInDevice(device_s)
    for _ in range(3):  # warm-up passes on the stand-in
        engine.step()
    return engine


def measure(engine: Engine, steps: int) -> dict[str, float]:
    device: StandInDevice = engine.runner.device_queue  # type: ignore[assignment]
    idle_from, jobs_from = len(device.idle), len(device.jobs)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    engine.sync()
    idle = device.idle[idle_from + 1:]  # the first: while the other loop ran
    busy = [j.finished - j.started for j in device.jobs[jobs_from + 1:]]
    return {"idle_ms": 1e3 * statistics.median(idle), "device_ms": 1e3 * statistics.median(busy),
            "step_ms": 1e3 * statistics.median(walls),
            "busy_share": sum(busy) / (sum(busy) + sum(idle))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("loadtests.bench.overlap", __doc__, model="embedded:tiny", seed=OMIT, threads=1)
    p.add_argument("--decodes", type=int, default=256)
    p.add_argument("--device-ms", type=float, default=5.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two loops")
    args = p.parse_args(argv)
    engines = {mode: decoding_engine(args.model, args.decodes, mode, args.device_ms / 1000, args.threads)
               for mode in ("off", "on")}
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.rounds):  # alternate, so both loops see the same machine
        for mode, engine in engines.items():
            runs[mode].append(measure(engine, args.steps))
    for engine in engines.values():
        engine.runner.device_queue.close()
    rows = {("synchronous" if mode == "off" else "overlapped"): {
        k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"{args.model}, {args.decodes} running decodes, stand-in device holding each pass "
          f"{args.device_ms:g} ms, {args.rounds} x {args.steps} passes per loop, medians")
    print(f"{'loop':<12} {'device idle ms':>15} {'device ms':>10} {'step ms':>8} {'busy':>6}")
    for name, r in rows.items():
        print(f"{name:<12} {r['idle_ms']:>15.3f} {r['device_ms']:>10.2f} {r['step_ms']:>8.2f} {r['busy_share']:>6.1%}")
    result = {"model": args.model, "decodes": args.decodes, "device_ms": args.device_ms, "steps": args.steps,
              "rounds": args.rounds, "threads": args.threads, "results": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
