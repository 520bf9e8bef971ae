"""What logprobs cost: output tok/s with 0%, 50% and 100% of requests asking for logprobs(5).

    python -m loadtests.bench.logprobs [--model embedded:mid] [--repeats 3] [--json PATH]

The quick `chat` workload of `bench.engine` (mixed heavy-tailed lengths, all at t=0) under
stall_free, the same requests in every run; only `SamplingParams.logprobs` differs. Runs are
interleaved over repeats and medians reported (a noisy shared machine: read the ratios).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

from loadtests.bench.engine import build_workloads, kv_capacity, run_engine, summarize
from loadtests.harness.report import OMIT, bench_parser, load_bench_model, report
from loadtests.harness.workloads import Workload
from replicas import Engine, EngineConfig, SamplingParams

SHARES = (0.0, 0.5, 1.0)
T = TypeVar("T")


def run(model_tok, workload, share: float, block_size: int = 16) -> float:
    engine = Engine(*model_tok, EngineConfig(policy="stall_free", max_batch_prefill_tokens=512,
                                             max_batch_total_tokens=kv_capacity(workload, block_size),
                                             block_size=block_size, max_num_seqs=64))
    engine.generate([[5, 6, 7, 8] * 4] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    every = round(1 / share) if share else 0
    asks = {r.request_id for i, r in enumerate(workload.requests) if every and i % every == 0}
    original = engine.add_request

    def add(prompt, params, **kw):  # the same request, logprobs(5) for the chosen share
        if kw.get("request_id") in asks:
            params = dataclasses.replace(params, logprobs=5)
        return original(prompt, params, **kw)

    engine.add_request = add
    return summarize(run_engine(engine, workload, f"logprobs {share:.0%}"))["output_tok_s"]


def run_shares(args: Any, run: Callable[..., T]) -> tuple[Workload, dict[float, list[T]]]:
    """`run(model_tok, workload, share)` for each of SHARES on the quick chat workload of
    `args.model` (`report.bench_parser`'s flags), repeats interleaved (the order rotates each
    repeat); the results by share."""
    model_tok = load_bench_model(args)
    vocab = model_tok[0].get_output_embeddings().weight.shape[0]
    workload = build_workloads(vocab, list(model_tok[1].all_special_ids), True, 0)[0]  # quick chat
    runs: dict[float, list[T]] = {s: [] for s in SHARES}
    for rep in range(args.repeats):
        for share in SHARES[rep % 3:] + SHARES[:rep % 3]:
            runs[share].append(run(model_tok, workload, share))
    return workload, runs


def main(argv: list[str] | None = None) -> dict:
    args = bench_parser("loadtests.bench.logprobs", __doc__, seed=OMIT, threads=2, repeats=3).parse_args(argv)
    workload, runs = run_shares(args, run)
    base = statistics.median(runs[0.0])
    rows = [{"share": s, "output_tok_s": statistics.median(v), "vs_none": statistics.median(v) / base,
             "repeats": v} for s, v in runs.items()]
    text = "\n".join([f"logprobs(5) cost: {args.model}, stall_free, quick chat ({len(workload)} requests), "
                      f"{args.threads} threads, medians of {args.repeats}",
                      f"{'share asking':>13}{'out tok/s':>11}{'vs none':>9}"]
                     + [f"{r['share']:>13.0%}{r['output_tok_s']:>11.1f}{r['vs_none']:>9.3f}" for r in rows]
                     + ["target: >= 0.90 (logprobs cost under 10%)"])
    return report(text, {"config": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
