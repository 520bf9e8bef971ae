"""Latency against load, one line per scheduling policy: `docs/results/latency_vs_load.png`.

    python -m loadtests.load.sweep            # the full sweep (about 16 minutes on 2 CPU cores)
    python -m loadtests.load.sweep --quick    # a short run: two rates, short windows
    python -m loadtests.load.sweep --model embedded:smollm2 --out docs/results/sweep_smollm2   # real model and prompts

For each policy (static, dynamic, stall_free) it starts the server on a private Ray instance
(`loadtests/harness/serve_local.py`) with the same model and KV capacity, warms it up, then drives it
with the same Locust workload (`loadtests/load/locustfile.py`, open-loop Poisson, a share of long
prompts) at each rate of a rising series, and stops it. Budgets: `stall_free` gets the chunk
budget `--chunk`; `dynamic` and `static` prefill whole prompts, so their MBP is the longest
prompt of the workload (rounded up to 256) -- with a smaller one they could never admit it.

On a real model (any but the random-weight embedded:tiny/mid) the prompts are real chat prompts
(`--prompts real`; `--prompts random` for random ids): a short request gets one of the
questions of `tests/support/real_text.py`, a long one (`--long-share`) a passage and a task about
it, in the model's own chat template (~40 and ~300 tokens on SmolLM2), sent as token ids by the
Locust process, which loads the model's tokenizer (no weights). Kinds, output lengths and
arrivals are the very ones the random mix draws; the prompt-length flags then do nothing.
The replicas' prefix cache is off unless `--prefix-caching`: real prompts repeat a system
prompt and a few passages, and a cache would hide the prefills the policies differ on.

Writes `docs/results/sweep.json` (config + one row per policy and rate), `docs/results/sweep.csv`
and the figure: p99 TBT and p99 TTFT against the offered rate with the SLOs as horizontal lines, and
output throughput. Locust's own reports of every point land in `--runs-dir`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from loadtests.harness import serve_local
from loadtests.load.loadtest import (add_mix_arguments, add_slo_arguments, load_samples, mix_from_args,
                                run_locust, summarize)
from loadtests.harness.mix import MixSpec, mixed_requests
from loadtests.load.plot_sweep import plot
from loadtests.harness.report import OMIT, bench_parser
from loadtests.harness.workloads import ChatPromptPool, default_prompt_source
from replicas.config import EngineConfig

POLICIES = ("static", "dynamic", "stall_free")
# stall_free with its prefill budget chosen per pass from the TBT SLO (ceiling: the whole-prompt MBP).
SLO_POLICY = "stall_free+slo"
# The sweep's workload: short prompts, a fifth of them long (what makes `dynamic` stall: one
# whole 1.5k-2k-token prefill takes over a second on this CPU even when nothing else runs).
SWEEP_MIX = MixSpec(prompt_median=96, output_median=48, long_share=0.2, long_min=1536,
                    long_max=2048, vocab_size=2048)
CSV_COLUMNS = ("policy", "rps", "requests", "finished", "errors", "unfinished", "ttft_p50_s",
               "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "tbt_max_s", "e2e_p50_s", "e2e_p99_s",
               "output_tok_s", "req_s", "goodput_req_s", "max_gap_slo_request_share", "mbp")


def whole_prompt_mbp(mix: MixSpec, pool: ChatPromptPool | None = None, multiple: int = 256) -> int:
    """The smallest MBP (rounded up) that lets a whole-prompt policy prefill the longest prompt
    (of `pool` when the mix sends real prompts)."""
    longest = pool.max_prompt_len if pool else max(mix.long_max, mix.short_prompt.hi)
    return -(-longest // multiple) * multiple


def app_args(args: argparse.Namespace, policy: str, mix: MixSpec,
             pool: ChatPromptPool | None = None) -> dict[str, Any]:
    """Every line gets the SLO (metrics); only `stall_free+slo` lets it choose the budget."""
    mbp = args.chunk if policy == "stall_free" else whole_prompt_mbp(mix, pool)
    engine = {"policy": "stall_free" if policy == SLO_POLICY else policy,
              "max_batch_prefill_tokens": mbp, "slo_budget": policy == SLO_POLICY,
              "enable_prefix_caching": args.prefix_caching,
              "max_batch_total_tokens": args.kv_tokens, "max_num_seqs": args.max_num_seqs,
              "num_threads": args.threads, "tbt_slo_ms": args.tbt_slo_ms, "budget_margin": args.budget_margin}
    # Every pass's tokens go out as they come: the client measures the engine's own gaps.
    replica = {"pass_trace_dir": str((args.runs_dir / f"passes_{policy}").resolve()), "stream_interval_ms": 0}
    return {"model": args.model, "num_cpus": 1, "engine": engine, "replica": replica}


def warm_up(base_url: str, mix: MixSpec, model: str, pool: ChatPromptPool | None = None) -> None:
    """One long and two short requests, one after another: first-call costs stay out of the
    first point."""
    reqs = mixed_requests(mix, stream=99, pool=pool)
    picked = [next(r for r in reqs if r.kind == "long")] + [next(r for r in reqs if r.kind == "short")
                                                           for _ in range(2)]
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for r in picked:
            client.post("/v1/completions", json={"model": model, "prompt": r.prompt_token_ids,
                                                 "max_tokens": 8, "ignore_eos": True}).raise_for_status()


def run_policy(args: argparse.Namespace, policy: str, mix: MixSpec, pool: ChatPromptPool | None,
               bar: tqdm) -> list[dict[str, Any]]:
    """Start the server for `policy`, run every rate against it, stop it."""
    server_args = app_args(args, policy, mix, pool)
    bar.set_postfix_str(f"{policy}: starting server")
    rows = []
    with serve_local.served(server_args, args.runs_dir / f"server_{policy}.log") as server:
        base = server.url
        bar.set_postfix_str(f"{policy}: warm-up")
        warm_up(base, mix, args.model, pool)
        for rps in args.rates:
            point_mix = dataclasses.replace(mix, rps=rps)
            label = f"{policy} @ {rps:g} req/s"

            def tick(elapsed: float, label: str = label) -> None:
                bar.set_postfix_str(f"{label}: {elapsed:.0f}/{args.duration_s + args.drain_s:.0f} s")

            samples = run_locust(base, args.runs_dir, duration_s=args.duration_s, drain_s=args.drain_s,
                                 mix=point_mix, ttft_slo_ms=args.ttft_slo_ms,
                                 tbt_slo_ms=args.tbt_slo_ms, model=args.model,
                                 prefix=f"{policy}_{rps:g}", quiet=True, tick=tick)
            _, reqs = load_samples(samples)
            row = {"policy": policy, "rps": rps, "mbp": server_args["engine"]["max_batch_prefill_tokens"],
                   **summarize(reqs, args.ttft_slo_ms / 1e3, args.tbt_slo_ms / 1e3)}
            rows.append(row)
            bar.update(1)
            tqdm.write(format_row(row))
    return rows


def format_row(r: dict[str, Any]) -> str:
    ms = lambda v: "      -" if v is None else f"{1e3 * v:7.0f}"  # noqa: E731
    return (f"{r['policy']:<11}{r['rps']:>6.2f}{r['requests']:>6}{r['errors']:>5}{r['unfinished']:>5}"
            f"{ms(r['ttft_p50_s'])}{ms(r['ttft_p99_s'])}{ms(r['tbt_p50_s'])}{ms(r['tbt_p99_s'])}"
            f"{r['output_tok_s']:>8.1f}{r['goodput_req_s']:>8.2f}")


HEADER = (f"{'policy':<11}{'req/s':>6}{'sent':>6}{'err':>5}{'open':>5}{'TTFT50':>7}{'TTFT99':>7}"
          f"{'TBT50':>7}{'TBT99':>7}{'tok/s':>8}{'good/s':>8}   (latencies in ms)")


def write_outputs(out_dir: Path, config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # --seed comes with the workload flags; the results go to --out (JSON, CSV and the plot).
    p = bench_parser("loadtests.load.sweep", __doc__, seed=OMIT, json_path=OMIT,
                     quick="two rates, 25 s windows (about 8 minutes)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated; also {SLO_POLICY} (stall_free, budget from the TBT SLO)")
    p.add_argument("--rates", help="comma-separated offered req/s (default: 0.2,0.4,0.6,0.8; quick: 0.3,0.8)")
    p.add_argument("--duration-s", type=float, help="arrival window per point (default 60; quick 25)")
    p.add_argument("--drain-s", type=float, default=30.0, help="at most this long for open requests")
    p.add_argument("--chunk", type=int, default=128, help="stall_free token budget per pass (MBP)")
    p.add_argument("--kv-tokens", type=int, default=16384, help="KV capacity (MBT), every policy")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the replica")
    p.add_argument("--budget-margin", type=float, default=EngineConfig.budget_margin,
                   help=f"{SLO_POLICY}: each pass aimed at the TBT SLO x this")
    p.add_argument("--out", type=Path, default=Path("docs/results"), help="sweep.json/.csv and the PNG go here")
    p.add_argument("--runs-dir", type=Path, default=Path("loadtests/out/sweep"),
                   help="Locust reports and server logs of every point")
    # SLOs for a 56M model on a shared 2-core CPU: a decode step takes 60-200 ms there, a
    # 128-token hybrid pass 120-450 ms, a whole 1.5k-2k-token prefill 1.2-5 s.
    add_slo_arguments(p, ttft_ms=5000.0, tbt_ms=1000.0)
    add_mix_arguments(p, SWEEP_MIX)
    p.set_defaults(prompts=None)  # chosen by the model below
    p.add_argument("--prefix-caching", action="store_true",
                   help="let the replicas share cached prompt prefixes (off: every prompt token is "
                        "computed; real prompts repeat a system prompt and a few passages)")
    args = p.parse_args(argv)
    args.prompts = args.prompts or default_prompt_source(args.model)
    if args.rates is None:
        args.rates = "0.3,0.8" if args.quick else "0.2,0.4,0.6,0.8"
    args.rates = [float(x) for x in args.rates.split(",")]
    if args.duration_s is None:
        args.duration_s = 25.0 if args.quick else 60.0
    args.policies = args.policies.split(",")
    if unknown := set(args.policies) - {*POLICIES, SLO_POLICY}:
        p.error(f"--policies: unknown {sorted(unknown)}; choose from {', '.join((*POLICIES, SLO_POLICY))}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    mix = mix_from_args(args, args.rates[0])
    pool = ChatPromptPool.for_model(args.model, mix.seed) if mix.prompts == "real" else None
    config = {"model": args.model, "prompts": mix.prompts,
              "real_prompt_lens": pool.summary() if pool else None,
              "prefix_caching": args.prefix_caching, "policies": args.policies, "rates": args.rates,
              "duration_s": args.duration_s, "drain_s": args.drain_s, "chunk_mbp": args.chunk,
              "whole_prompt_mbp": whole_prompt_mbp(mix, pool), "kv_tokens": args.kv_tokens,
              "max_num_seqs": args.max_num_seqs, "torch_threads": args.threads,
              "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms,
              "budget_margin": args.budget_margin, "mix": {k: v for k, v in mix.to_dict().items() if k != "rps"},
              "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows: list[dict[str, Any]] = []
    print(f"sweep: {args.model}, {mix.prompts} prompts, policies {args.policies}, rates {args.rates} "
          f"req/s, {args.duration_s:g} s per point; long prompts {mix.long_share:.0%} of requests")
    print(HEADER)
    with tqdm(total=len(args.policies) * len(args.rates), desc="sweep", unit="point") as bar:
        for policy in args.policies:
            rows += run_policy(args, policy, mix, pool, bar)
            write_outputs(args.out, config, rows)  # partial results survive an interrupted run
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_outputs(args.out, config, rows)
    png = plot(rows, config, args.out / "latency_vs_load.png")
    print(f"wrote {args.out}/sweep.json, {args.out}/sweep.csv, {png}")
    return {"config": config, "rows": rows}


if __name__ == "__main__":
    main()
