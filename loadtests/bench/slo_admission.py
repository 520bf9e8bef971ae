"""SLO admission on and off, side by side in one run: what it buys when decodes fill the SLO.

    python -m loadtests.bench.slo_admission [--quick] [--slo-ms 80] [--repeats 3] [--json PATH]

bench.engine's chat workload (heavy-tailed prompts and outputs, every request at t=0, so the
running set would grow to max_num_seqs at once) on stall_free: with a fixed budget and no SLO,
with the SLO budget alone (`slo_admission` off), and with the SLO budget and SLO admission. The
SLO is set where all the requests decoding together overrun it. What to read: the share of
token gaps within the SLO and p99 TBT (what admission protects) against output tok/s and TTFT
(what holding requests back costs). Noisy shared machine: ratios within one run; `--repeats`
interleaves the systems and takes medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from tqdm import tqdm

from loadtests.bench.engine import _greedy, build_workloads, kv_capacity, median_row, run_engine, summarize
from loadtests.harness.report import bench_parser, load_bench_model, report
from replicas import Engine, EngineConfig

SYSTEMS = (("fixed 512", None, False), ("slo budget", "slo", False), ("slo budget + admission", "slo", True))


def run(model_tok, workload, slo_ms: float | None, admission: bool, args: argparse.Namespace) -> dict:
    config = EngineConfig(policy="stall_free", max_batch_prefill_tokens=512,
                          max_batch_total_tokens=kv_capacity(workload, args.block_size),
                          block_size=args.block_size, max_num_seqs=args.max_num_seqs, tbt_slo_ms=slo_ms,
                          slo_admission=admission)
    engine = Engine(*model_tok, config)  # with an SLO this profiles a handful of passes first
    engine.generate([[5, 6, 7, 8] * 4] * 2, _greedy(4))  # warm-up
    engine.iterations.clear()
    traces = run_engine(engine, workload, f"slo {slo_ms} admission {admission}")
    decodes = [it.num_decode_tokens for it in engine.iterations]  # requests each pass decoded
    gaps = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])]
    slo_s = args.slo_ms / 1000
    row = summarize(traces) | {
        "gaps_within_slo": sum(1 for g in gaps if g <= slo_s) / len(gaps),
        "decodes_per_pass_max": float(max(decodes)), "decodes_per_pass_p50": float(statistics.median(decodes)),
        "admission_held": float(engine.slo_admission.held if engine.slo_admission is not None else 0)}
    return row


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("loadtests.bench.slo_admission", __doc__, quick="the quick chat workload",
                     threads=2, repeats=1)
    p.add_argument("--slo-ms", type=float, default=80.0, help="TBT SLO of the SLO runs (ms)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chat-requests", type=int, help="requests in the chat workload")
    args = p.parse_args(argv)
    model_tok = load_bench_model(args)
    vocab = model_tok[0].get_output_embeddings().weight.shape[0]
    workload = next(w for w in build_workloads(vocab, list(model_tok[1].all_special_ids), args.quick,
                                               args.seed, chat_requests=args.chat_requests)
                    if w.name == "chat")
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]
        for name, slo, admission in tqdm(order, desc=f"runs (repeat {rep + 1}/{args.repeats})"):
            runs.setdefault(name, []).append(
                run(model_tok, workload, args.slo_ms if slo else None, admission, args))
    rows = [{"system": name, **median_row(runs[name])} for name, _, _ in SYSTEMS]
    s = workload.summary()
    lines = [f"SLO admission: {args.model}, stall_free, {torch.get_num_threads()} torch threads, "
             f"{'quick' if args.quick else 'full'} chat ({s['num_requests']} requests at t=0), TBT SLO "
             f"{args.slo_ms:g} ms, {args.repeats} repeat(s), medians",
             f"{'system':<24}{'out tok/s':>10}{'TTFT p50 s':>11}{'TTFT p99 s':>11}{'TBT p50 ms':>11}"
             f"{'TBT p99 ms':>11}{'gaps <= SLO':>12}{'decodes/pass max':>17}"]
    for r in rows:
        lines.append(f"{r['system']:<24}{r['output_tok_s']:>10.1f}{r['ttft_p50_s']:>11.2f}{r['ttft_p99_s']:>11.2f}"
                     f"{1e3 * r['tbt_p50_s']:>11.1f}{1e3 * r['tbt_p99_s']:>11.1f}{100 * r['gaps_within_slo']:>11.1f}%"
                     f"{r['decodes_per_pass_max']:>17.0f}")
    result = {"command": " ".join(["python -m loadtests.bench.slo_admission",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args), "workload": s, "rows": rows, "loadavg_1m": os.getloadavg()[0]}
    report("\n".join(lines), result, args.json)
    return result


if __name__ == "__main__":
    main()
