"""Token-load routing against Serve's default power-of-two router, same workload, one run.

    python -m loadtests.bench.routing            # 90 s per router (about 6-7 minutes)
    python -m loadtests.bench.routing --quick    # 30 s per router (about 3-4 minutes)
    # serve_config.yaml's path: Ray's HAProxy in front of engine replicas serving HTTP; there
    # token_load is least connections on token-load weights (haproxy_weight_interval_ms, on by
    # default), power_of_two plain least connections
    python -m loadtests.bench.routing --quick --start make

For each router it starts a private Ray + Serve (`serve_local` in a subprocess, with a Ray
metrics export port) with `--replicas` replicas of the embedded model, warms it up, drives it
with the same Locust workload (`loadtests/locustfile.py`: open-loop Poisson at a fixed rate, a
share of long prompts, same seed) and stops it. Requests
per replica come from Ray's Prometheus export: `ray_stallfree_request_success_total` summed
per `replica` label (after minus before the load).

Prints one row per router (p50/p99 TTFT and TBT, throughput, requests per replica) and the
p99 TTFT ratio token_load / power_of_two; writes `--json` (default
`loadtests/out/bench_routing.json`). Locust reports and server logs land in `--runs-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import httpx

from autoscale.serve_options import ROUTERS as SERVE_ROUTERS
from loadtests.harness import metrics_text, serve_local
from loadtests.harness.serve_run import START_MODES
from loadtests.load.loadtest import load_samples, run_locust, summarize
from loadtests.harness.mix import MixSpec
from loadtests.harness.report import bench_parser
from loadtests.load.sweep import warm_up

ROUTERS = ("token_load", "power_of_two")  # the default pair; `--routers` takes any of SERVE_ROUTERS
METRIC = "ray_stallfree_request_success_total"
# Heavy-tailed: mostly short chats, 30% of them long prompts (1k-1.5k tokens) that make
# one replica's queue far longer than its request count says.
BENCH_MIX = MixSpec(prompt_median=96, output_median=48, long_share=0.3, long_min=1024,
                    long_max=1536, vocab_size=2048)
TTFT_SLO_MS = 2000.0
TBT_SLO_MS = 500.0


# ---- metrics ---------------------------------------------------------------------------------


def requests_per_replica(text: str, metric: str = METRIC, deployment: str = "LLMServer") -> dict[str, float]:
    """Sum `metric` per `replica` label in a Prometheus text exposition (all finish reasons)."""
    out: dict[str, float] = {}
    for _, labels, value in metrics_text.samples(text, (metric,)):
        if "replica" in labels and labels.get("deployment", deployment) == deployment:
            out[labels["replica"]] = out.get(labels["replica"], 0.0) + value
    return out


def per_replica_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before per replica (a replica missing before started at 0), sorted by name."""
    return {r: int(round(after[r] - before.get(r, 0.0))) for r in sorted(after)}


def scrape(metrics_port: int) -> dict[str, float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return requests_per_replica(text)


def wait_counts(metrics_port: int, before: dict[str, float], want: int, timeout_s: float = 20.0) -> dict[str, int]:
    """Per-replica finished requests since `before`, once they add up to `want` (or time's up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        delta = per_replica_delta(before, scrape(metrics_port))
        if sum(delta.values()) >= want or time.monotonic() > deadline:
            return delta
        time.sleep(1.0)


# ---- benchmark -------------------------------------------------------------------------------


def app_args(args: argparse.Namespace, router: str) -> dict[str, Any]:
    """The app's settings for one router: the bench's own, then `--set`'s (serve_config.yaml's
    go under both with `--start` other than local)."""
    base = {"model": args.model, "router": router, "num_replicas": args.replicas, "num_cpus": 1,
            "engine": {"num_threads": 1, "max_batch_prefill_tokens": args.chunk,
                       "max_batch_total_tokens": args.kv_tokens, "tbt_slo_ms": args.tbt_slo_ms},
            "replica": {"stream_interval_ms": 0}}
    return serve_local.merge_args(base, serve_local.parse_sets(args.sets))


def run_router(args: argparse.Namespace, router: str, mix: MixSpec) -> dict[str, Any]:
    metrics_port = serve_local.free_port()
    local = args.start == "local"  # Ray's metrics export on a port of ours: requests per replica
    with serve_local.served(app_args(args, router), args.runs_dir / f"server_{router}.log", start=args.start,
                            ray_cpus=args.ray_cpus, metrics_port=metrics_port if local else None) as server:
        base = server.url
        for _ in range(args.replicas):  # the router spreads these; first-call costs stay out
            warm_up(base, mix, args.model)
        time.sleep(2.0)  # let the warm-up's counters reach the export
        before = scrape(metrics_port) if local else {}
        print(f"{router}: {args.rps:g} req/s for {args.duration_s:g} s ...", flush=True)
        samples = run_locust(base, args.runs_dir, duration_s=args.duration_s, drain_s=args.drain_s,
                             mix=mix, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms,
                             model=args.model, prefix=router, quiet=True)
        _, reqs = load_samples(samples)
        row = {"router": router, **summarize(reqs, args.ttft_slo_ms / 1e3, args.tbt_slo_ms / 1e3)}
        row["per_replica"] = wait_counts(metrics_port, before, row["finished"]) if local else None
        if server.health.get("http_path"):  # and after the load: HAProxy's weights pushed meanwhile
            row["http_path"] = server.health["http_path"]
            row["http_path_after"] = httpx.get(f"{base}/health", timeout=10).json().get("http_path")
    return row


def _ms(v: float | None) -> str:
    if v is None:
        return "      -"
    return f"{1e3 * v:7.1f}" if 1e3 * v < 10 else f"{1e3 * v:7.0f}"


HEADER = (f"{'router':<13}{'sent':>5}{'done':>5}{'err':>4}{'TTFT50':>7}{'TTFT99':>7}{'TBT50':>7}"
          f"{'TBT99':>7}{'tok/s':>7}{'req/s':>6}  per replica   (latencies in ms)")


def format_row(r: dict[str, Any]) -> str:
    per = "/".join(str(n) for n in (r.get("per_replica") or {}).values()) or "-"
    return (f"{r['router']:<13}{r['requests']:>5}{r['finished']:>5}{r['errors']:>4}"
            f"{_ms(r['ttft_p50_s'])}{_ms(r['ttft_p99_s'])}{_ms(r['tbt_p50_s'])}{_ms(r['tbt_p99_s'])}"
            f"{r['output_tok_s']:>7.1f}{r['req_s']:>6.2f}  {per}")


def ttft_p99_ratio(rows: list[dict[str, Any]]) -> float | None:
    """token_load p99 TTFT / power_of_two p99 TTFT (below 0.7 meets the 30%-lower target)."""
    by = {r["router"]: r.get("ttft_p99_s") for r in rows}
    tl, p2 = by.get("token_load"), by.get("power_of_two")
    return tl / p2 if tl is not None and p2 else None


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [HEADER] + [format_row(r) for r in rows]
    ratio = ttft_p99_ratio(rows)
    if ratio is not None:
        lines.append(f"p99 TTFT token_load / power_of_two = {ratio:.2f} "
                     f"({100 * (1 - ratio):.0f}% lower; target >= 30%: "
                     f"{'met' if ratio <= 0.7 else 'not met'})")
    return "\n".join(lines)


def result_doc(config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratio = ttft_p99_ratio(rows)
    return {"config": config, "rows": rows, "ttft_p99_ratio": ratio,
            "target_met": None if ratio is None else ratio <= 0.7}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("loadtests.bench.routing", __doc__, model="embedded:tiny", seed=BENCH_MIX.seed,
                     json_path="loadtests/out/bench_routing.json", quick="30 s per router (about 3-4 minutes)")
    p.add_argument("--runs-dir", type=Path, default=Path("loadtests/out/bench_routing"))
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="comma-separated: token_load, ttft, power_of_two")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rps", type=float, default=7.0, help="offered requests/s (Poisson)")
    p.add_argument("--duration-s", type=float, help="arrival window per router (default 90; quick 30)")
    p.add_argument("--drain-s", type=float, help="at most this long for open requests (default 30; quick 20)")
    p.add_argument("--long-share", type=float, default=BENCH_MIX.long_share)
    p.add_argument("--chunk", type=int, default=256, help="max_batch_prefill_tokens")
    p.add_argument("--kv-tokens", type=int, default=16384, help="max_batch_total_tokens per replica")
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the private Ray instance")
    p.add_argument("--start", choices=START_MODES, default="local",
                   help="how the server starts (loadtests.harness.serve_run); local: our launcher, the "
                   "two-deployment app; make / serve-run / cluster: serve_config.yaml's path, Ray's HAProxy "
                   "(no requests per replica there: Ray's metrics port is the instance's own)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="an app setting over the bench's (dotted keys for nested ones); repeatable")
    p.add_argument("--ttft-slo-ms", type=float, default=TTFT_SLO_MS)
    p.add_argument("--tbt-slo-ms", type=float, default=TBT_SLO_MS)
    args = p.parse_args(argv)
    if args.duration_s is None:
        args.duration_s = 30.0 if args.quick else 90.0
    if args.drain_s is None:
        args.drain_s = 20.0 if args.quick else 30.0
    args.routers = args.routers.split(",")
    if unknown := set(args.routers) - set(SERVE_ROUTERS):
        p.error(f"--routers: unknown {sorted(unknown)}; choose from {', '.join(SERVE_ROUTERS)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    mix = dataclasses.replace(BENCH_MIX, rps=args.rps, long_share=args.long_share, seed=args.seed)
    config = {"model": args.model, "replicas": args.replicas, "routers": args.routers,
              "start": args.start, "sets": args.sets,
              "rps": args.rps, "duration_s": args.duration_s, "drain_s": args.drain_s,
              "chunk_mbp": args.chunk, "kv_tokens": args.kv_tokens,
              "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms,
              "mix": {k: v for k, v in mix.to_dict().items() if k != "avoid_ids"},
              "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"bench_routing: {args.replicas} x {args.model}, {args.rps:g} req/s, {args.duration_s:g} s "
          f"per router, long prompts {mix.long_share:.0%}; routers {args.routers}", flush=True)
    rows: list[dict[str, Any]] = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for router in args.routers:
        rows.append(run_router(args, router, mix))
        print(format_row(rows[-1]), flush=True)
        args.json.write_text(json.dumps(result_doc(config, rows), indent=2) + "\n")
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    doc = result_doc(config, rows)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(format_table(rows))
    print(f"wrote {args.json}; Locust reports and server logs in {args.runs_dir}")
    return doc


if __name__ == "__main__":
    main()
