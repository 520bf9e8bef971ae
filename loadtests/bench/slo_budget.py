"""Fixed prefill budgets against the SLO budget, side by side in one run.

    python -m loadtests.bench.slo_budget [--quick] [--slos 150,400] [--json PATH]

The long_prompt workload of `bench.engine` (short requests decoding while long prompts arrive)
under stall_free with fixed budgets (max_batch_prefill_tokens 128 ... 2048) and with the SLO
budget (`tbt_slo_ms` set, ceiling 2048, no other tuning) at each SLO. For each SLO the target:
the SLO budget's p99 TBT within the SLO, and its long prompts' TTFT within 10% of the best fixed
budget that meets the SLO (the budget an operator would have to find by hand).
Noisy shared machine: ratios within one run; `--repeats` interleaves and takes medians.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
from tqdm import tqdm

from loadtests.bench.engine import _greedy, build_workloads, kv_capacity, run_engine, summarize
from loadtests.harness.report import bench_parser, load_bench_model, report
from replicas import Engine, EngineConfig

FIXED = (128, 256, 512, 1024, 2048)
CEILING = 2048


def long_ttft(traces) -> float:
    """Mean TTFT of the workload's long prompts (what a bigger budget buys)."""
    return statistics.fmean(t.token_times[0] - t.arrival for t in traces if t.kind == "long")


def run(model_tok, workload, mbp: int, slo_ms: float | None, block_size: int, max_num_seqs: int) -> dict:
    config = EngineConfig(policy="stall_free", max_batch_prefill_tokens=mbp,
                          max_batch_total_tokens=kv_capacity(workload, block_size), block_size=block_size,
                          max_num_seqs=max_num_seqs, tbt_slo_ms=slo_ms)
    engine = Engine(*model_tok, config)  # with an SLO this profiles a handful of passes first
    engine.generate([[5, 6, 7, 8] * 4] * 2, _greedy(4))  # warm-up
    engine.iterations.clear()
    label = f"slo {slo_ms:g} ms" if slo_ms else f"fixed {mbp}"
    traces = run_engine(engine, workload, label)
    its = list(engine.iterations)
    budgets = [i.prefill_budget for i in its if i.prefill_budget is not None]
    errors = [abs(i.predicted_s - i.duration) / i.duration for i in its if i.predicted_s is not None]
    row = summarize(traces) | {"long_ttft_s": long_ttft(traces), "mbp": mbp, "tbt_slo_ms": slo_ms,
                               "iterations": len(its)}
    if slo_ms:
        row |= {"budget_p50": statistics.median(budgets) if budgets else None,
                "budget_min": min(budgets, default=None), "budget_max": max(budgets, default=None),
                "fallback_passes": sum(1 for i in its if i.budget_fallback),
                "prediction_error_p50": statistics.median(errors) if errors else None,
                "coefficients": engine.pass_time.coefficients()}
    return row


def check(rows: list[dict], slos: list[float]) -> list[dict]:
    fixed = [r for r in rows if r["tbt_slo_ms"] is None]
    out = []
    for slo in slos:
        mine = next(r for r in rows if r["tbt_slo_ms"] == slo)
        meeting = [r for r in fixed if 1e3 * r["tbt_p99_s"] <= slo]
        best = min(meeting, key=lambda r: r["long_ttft_s"]) if meeting else None
        within = 1e3 * mine["tbt_p99_s"] <= slo
        ttft_ratio = mine["long_ttft_s"] / best["long_ttft_s"] if best else None
        out.append({"slo_ms": slo, "tbt_p99_ms": 1e3 * mine["tbt_p99_s"], "tbt_within_slo": within,
                    "best_fixed_mbp": best["mbp"] if best else None,
                    "long_ttft_vs_best_fixed": ttft_ratio,
                    "met": within and (ttft_ratio is not None and ttft_ratio <= 1.1)})
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'system':<16}{'out tok/s':>10}{'long TTFT s':>12}{'TTFT p99 s':>11}{'TBT p50 ms':>11}"
             f"{'TBT p99 ms':>11}{'TBT max ms':>11}{'budget p50 (min-max)':>22}{'pred err':>9}"]
    for r in rows:
        name = f"slo {r['tbt_slo_ms']:g} ms" if r["tbt_slo_ms"] else f"fixed {r['mbp']}"
        budget = (f"{r['budget_p50']:.0f} ({r['budget_min']}-{r['budget_max']})"
                  if r.get("budget_p50") is not None else "-")
        err = f"{r['prediction_error_p50']:.2f}" if r.get("prediction_error_p50") is not None else "-"
        lines.append(f"{name:<16}{r['output_tok_s']:>10.1f}{r['long_ttft_s']:>12.2f}{r['ttft_p99_s']:>11.2f}"
                     f"{1e3 * r['tbt_p50_s']:>11.1f}{1e3 * r['tbt_p99_s']:>11.1f}{1e3 * r['tbt_max_s']:>11.1f}"
                     f"{budget:>22}{err:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("loadtests.bench.slo_budget", __doc__, quick="the quick long_prompt workload",
                     threads=2, repeats=1)
    p.add_argument("--slos", default="150,400", help="TBT SLOs (ms) of the SLO-budget runs")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--long-shorts", type=int, help="short requests in long_prompt")
    args = p.parse_args(argv)
    slos = [float(s) for s in args.slos.split(",")]
    model_tok = load_bench_model(args)
    vocab = model_tok[0].get_output_embeddings().weight.shape[0]
    workload = next(w for w in build_workloads(vocab, list(model_tok[1].all_special_ids), args.quick,
                                               args.seed, long_shorts=args.long_shorts)
                    if w.name == "long_prompt")
    plan = [(mbp, None) for mbp in FIXED] + [(CEILING, slo) for slo in slos]
    runs: dict[tuple, list[dict]] = {}
    for rep in range(args.repeats):
        order = plan[rep % len(plan):] + plan[:rep % len(plan)]
        for mbp, slo in tqdm(order, desc=f"runs (repeat {rep + 1}/{args.repeats})"):
            runs.setdefault((mbp, slo), []).append(
                run(model_tok, workload, mbp, slo, args.block_size, args.max_num_seqs))
    rows = []
    for key in plan:
        reps = runs[key]
        row = dict(reps[0])
        for k, v in reps[0].items():
            if isinstance(v, float) and all(isinstance(r.get(k), float) for r in reps):
                row[k] = statistics.median(r[k] for r in reps)
        rows.append(row)
    checks = check(rows, slos)
    s = workload.summary()
    text = (f"SLO budget vs fixed budgets: {args.model}, stall_free, {torch.get_num_threads()} torch threads, "
            f"{'quick' if args.quick else 'full'} long_prompt ({s['num_requests']} requests, long prompts "
            f"up to {s['prompt_len_max']} tokens), {args.repeats} repeat(s), medians\n" + format_rows(rows)
            + "\n" + "\n".join(
                f"SLO {c['slo_ms']:g} ms: p99 TBT {c['tbt_p99_ms']:.0f} ms "
                f"({'within' if c['tbt_within_slo'] else 'OVER'}); long-prompt TTFT "
                + (f"{c['long_ttft_vs_best_fixed']:.2f}x the best fixed budget meeting the SLO "
                   f"({c['best_fixed_mbp']})" if c["best_fixed_mbp"] else "(no fixed budget meets the SLO)")
                + f" (target <= 1.10): {'met' if c['met'] else 'MISSED'}" for c in checks))
    result = {"command": " ".join(["python -m loadtests.bench.slo_budget", *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args), "workload": s, "rows": rows, "checks": checks,
              "loadavg_1m": os.getloadavg()[0]}
    return report(text, result, args.json)


if __name__ == "__main__":
    main()
