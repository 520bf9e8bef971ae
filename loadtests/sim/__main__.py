"""Cluster simulator CLI: every command prints a table and writes JSON.

    python -m loadtests.sim run --policy stall_free --mbp 512 --rate 3 -n 2000
    python -m loadtests.sim capacity            # docs/results/capacity.png + sim_capacity.json
    python -m loadtests.sim routing             # docs/results/sim_routing.json
    python -m loadtests.sim prefix-routing      # multi-turn chat: docs/results/sim_prefix_routing.json
    python -m loadtests.sim slo-budget          # docs/results/sim_slo_budget.json
    python -m loadtests.sim slo-goodput         # docs/results/sim_slo_goodput.json
    python -m loadtests.sim autoscale           # docs/results/sim_autoscale.json (+ timeline CSV)
    python -m loadtests.sim speed               # 100k requests x 64 replicas: docs/results/sim_speed.json
    python -m loadtests.sim calibrate           # fit against the CPU engine: docs/results/sim_calibration.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from loadtests.sim import experiments as ex
from loadtests.sim.deploy import replica_spec
from loadtests.sim.routers import ROUTERS, WHAT_IF_ROUTERS
from loadtests.sim.simulator import SimConfig, Simulator
from loadtests.sim.traffic import make_trace
from replicas.config import POLICIES

DOCS = Path("docs/results")


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(f"wrote {path}")


def table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> None:
    """Print rows as a fixed-width table; cols are (key, header, format)."""
    cells = [["-" if r.get(k) is None else format(r[k], fmt) for k, _, fmt in cols] for r in rows]
    widths = [max([len(h), 8] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def cmd_run(a: argparse.Namespace) -> None:
    spec = replica_spec(a.gpu, a.model, a.policy, a.mbp, tp=a.tp)
    kw = dict(n=a.num_requests, rate=a.rate, seed=a.seed, cv=a.cv)
    trace = make_trace(a.workload, a.arrivals, **kw)
    res = Simulator(SimConfig(spec, a.replicas, router=a.router, tbt_slo_s=a.tbt_slo_ms / 1000, ttft_slo_s=a.ttft_slo_ms / 1000,
                              seed=a.seed), trace).run(progress=not a.quiet)
    for k, v in res.summary.items():
        print(f"{k:24s} {v:.4f}" if isinstance(v, float) else f"{k:24s} {v}")
    print(f"{'wall_s':24s} {res.wall_s:.2f}")
    write_json(a.json, res.to_dict())


def cmd_capacity(a: argparse.Namespace) -> None:
    from loadtests.sim.plots import capacity_figure

    results = []
    for wl in a.workloads:
        print(f"capacity search: {a.model} on {a.gpu}, {wl}, {a.num_requests} requests per point")
        results.append(ex.capacity(a.gpu, a.model, wl, a.num_requests, a.seed))
    rows = [r for res in results for r in res["rows"]]
    print()
    table(rows, [("workload", "workload", "s"), ("slo", "slo", "s"), ("policy", "policy", "s"),
                 ("mbp", "mbp", "d"), ("capacity_rps", "req/s", ".3f"),
                 ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f"),
                 ("sched_delay_p50_s", "p50 delay s", ".3f"), ("ttft_p99_s", "p99 TTFT s", ".3f")])
    for res in results:
        for slo, ratio in res["stall_free_over_dynamic"].items():
            print(f"{res['workload']:8s} {slo:7s} stall_free / dynamic = {ratio:.2f}x")
    write_json(a.json, {"results": results})
    capacity_figure(results, a.png)
    print(f"wrote {a.png}")


def cmd_routing(a: argparse.Namespace) -> None:
    out = []
    for arrivals in a.arrivals:
        print(f"routing: {arrivals} arrivals, {a.per_replica_rps} req/s per replica")
        out.append(ex.routing(tuple(a.replicas), a.per_replica_rps, a.requests_per_replica, arrivals,
                              seed=a.seed, routers=tuple(a.routers),
                              report_delays_s=tuple(ms / 1e3 for ms in a.report_delay_ms), progress=not a.quiet))
    rows = [r for res in out for r in res["rows"]]
    print()
    table(rows, [("arrivals", "arrivals", "s"), ("replicas", "replicas", "d"), ("router", "router", "s"),
                 ("report_delay_ms", "report delay ms", ".0f"),
                 ("ttft_p50_s", "p50 TTFT s", ".3f"), ("ttft_p99_s", "p99 TTFT s", ".3f"),
                 ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f"), ("sched_delay_p99_s", "p99 delay s", ".3f"),
                 ("tpot_slo_request_share", "TPOT SLO req.", ".3f")])
    write_json(a.json, {"results": out})


def cmd_prefix_routing(a: argparse.Namespace) -> None:
    print(f"prefix routing: multi-turn chat, {a.per_replica_rps} req/s per replica, prefix cache on")
    res = ex.prefix_routing(tuple(a.replicas), a.per_replica_rps, a.conversations_per_replica, seed=a.seed,
                            routers=tuple(a.routers), progress=not a.quiet)
    print()
    table(res["rows"], [("replicas", "replicas", "d"), ("router", "router", "s"), ("offered_rps", "req/s", ".1f"),
                        ("ttft_p50_s", "p50 TTFT s", ".3f"), ("ttft_p99_s", "p99 TTFT s", ".3f"),
                        ("hit_rate", "hit rate", ".3f"), ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f"),
                        ("goodput_rps", "goodput req/s", ".2f")])
    for n, r in res["prefix_p99_ttft_reduction_vs_token_load"].items():
        print(f"{n} replicas: prefix p99 TTFT {r:.0%} lower than token_load (target >= 30% at 16)")
    write_json(a.json, res)


def cmd_slo_budget(a: argparse.Namespace) -> None:
    results = []
    for gpu, model in a.deployments:
        print(f"SLO budget capacity: {model} on {gpu}, {a.workload}, {a.num_requests} requests per point")
        results.append(ex.slo_budget_capacity(gpu, model, a.workload, a.num_requests, a.seed))
    print()
    table([r for res in results for r in res["rows"]],
          [("model", "model", "s"), ("slo", "slo", "s"), ("system", "system", "s"), ("mbp", "mbp", "d"),
           ("capacity_rps", "req/s", ".3f"), ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f"),
           ("ttft_p99_s", "p99 TTFT s", ".3f")])
    for res in results:
        for c in res["checks"]:
            print(f"{res['model']:10s} {c['slo']:7s} SLO budget {c['slo_budget_rps']:.3f} req/s = "
                  f"{c['vs_best']:.2f}x the best fixed budget, {c['vs_worst']:.2f}x the worst "
                  f"(target >= 1.00 and >= 1.20)")
    write_json(a.json, {"results": results})


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio != float("inf") else "any multiple of (0 good)"


def cmd_slo_goodput(a: argparse.Namespace) -> None:
    results = []
    for gpu, model in a.deployments:
        print(f"Goodput around fixed 128's saturating rate: {model} on {gpu}, {a.workload}, "
              f"{a.num_requests} requests per point, TTFT SLO {a.ttft_slo_ms:g} ms")
        results.append(ex.slo_goodput(gpu, model, a.workload, a.num_requests, a.seed, ttft_slo_s=a.ttft_slo_ms / 1000,
                                      rate_factors=tuple(a.factors)))
    print()
    table([r for res in results for r in res["rows"]],
          [("model", "model", "s"), ("slo", "slo", "s"), ("rate_rps", "req/s", ".2f"), ("system", "system", "s"),
           ("mbp", "mbp", "d"), ("goodput_rps", "goodput", ".3f"), ("ttft_p50_s", "p50 TTFT s", ".2f"),
           ("ttft_p99_s", "p99 TTFT s", ".2f"), ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f")])
    for res in results:
        for c in res["checks"]:
            print(f"{res['model']:10s} {c['slo']:7s} x{c['factor']:.2f} ({c['rate_rps']:.2f} req/s): SLO budget "
                  f"goodput {_times(c['goodput_vs_fixed128'])} fixed 128, {_times(c['goodput_vs_dynamic'])} dynamic; "
                  f"p99 TTFT {c['ttft_p99_vs_dynamic']:.2f}x dynamic's; p99 TBT {c['tbt_p99_s']:.3f} s "
                  f"(targets at x1: >= 1.5x, >= 3x, <= 1.5x, within the SLO)")
    write_json(a.json, {"results": results})


def cmd_autoscale(a: argparse.Namespace) -> None:
    res = ex.autoscale(a.per_replica_rps, a.peak, a.low, a.duration_s, a.startup_s, seed=a.seed,
                       progress=not a.quiet)
    print()
    table(res["rows"], [("scenario", "scenario", "s"), ("fleet", "fleet", "s"),
                        ("tpot_slo_request_share", "TPOT SLO req.", ".3f"),
                        ("tbt_slo_token_share", "TBT SLO tok.", ".3f"),
                        ("ttft_p99_s", "p99 TTFT s", ".2f"), ("tbt_bucket_p99_s", "bucket p99 TBT s", ".3f"),
                        ("replica_seconds", "replica-s", ".0f"), ("max_replicas", "max repl.", "d")])
    timelines = res.pop("timelines")
    write_json(a.json, res)
    with open(a.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "t", "ready", "provisioned", "desired", "reason"])
        for name, points in timelines.items():
            for p in points:
                w.writerow([name, f"{p['t']:.1f}", p["ready"], p["provisioned"], p["desired"], p["reason"]])
    print(f"wrote {a.csv}")


def cmd_speed(a: argparse.Namespace) -> None:
    res = ex.speed(a.num_requests, a.replicas, a.per_replica_rps, a.router, autoscale=a.autoscale,
                   decode_runs=not a.pass_by_pass, progress=not a.quiet)
    for k, v in res.items():
        print(f"{k:16s} {v}")
    write_json(a.json, res)


def _gpu_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="A100-80GB")
    p.add_argument("--model", default="mistral-7b")


def _seed_json(p: argparse.ArgumentParser, json_name: str, seed: bool = True) -> None:
    """What experiments share: a seed, and where the JSON goes (under docs/results/)."""
    if seed:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DOCS / json_name)


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="one simulation")
    _gpu_model(p)
    p.add_argument("--tp", type=int)
    p.add_argument("--policy", choices=POLICIES, default="stall_free")
    p.add_argument("--mbp", type=int, default=512)
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson")
    p.add_argument("--cv", type=float, default=3.0, help="gap coefficient of variation (bursty)")
    p.add_argument("--rate", type=float, default=3.0)
    p.add_argument("-n", "--num-requests", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", choices=ROUTERS + WHAT_IF_ROUTERS, default="token_load")
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    _seed_json(p, "sim_run.json")
    p.set_defaults(fn=cmd_run)


def _deployment(text: str) -> tuple[str, str]:
    gpu, _, model = text.partition("/")
    return gpu, model


def _add_slo_budget(sub: Any) -> None:
    p = sub.add_parser("slo-budget", help="capacity of the SLO budget vs fixed budgets and dynamic")
    p.add_argument("--deployments", nargs="+", type=_deployment,
                   default=[("A100-80GB", "mistral-7b"), ("H100-SXM", "llama-70b")], help="GPU/model ...")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("-n", "--num-requests", type=int, default=1000, help="requests per rate tried")
    _seed_json(p, "sim_slo_budget.json")
    p.set_defaults(fn=cmd_slo_budget)


def _add_slo_goodput(sub: Any) -> None:
    p = sub.add_parser("slo-goodput", help="goodput of the SLO budget, fixed budgets and dynamic around "
                                           "fixed 128's saturating rate")
    p.add_argument("--deployments", nargs="+", type=_deployment,
                   default=[("A100-80GB", "mistral-7b"), ("H100-SXM", "llama-70b")], help="GPU/model ...")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("-n", "--num-requests", type=int, default=1000, help="requests per rate tried")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO of goodput")
    p.add_argument("--factors", type=float, nargs="+", default=[0.75, 1.0, 1.25, 1.5],
                   help="rates tried, as multiples of fixed 128's capacity")
    _seed_json(p, "sim_slo_goodput.json")
    p.set_defaults(fn=cmd_slo_goodput)


def _add_capacity(sub: Any) -> None:
    p = sub.add_parser("capacity", help="capacity of each policy under a strict and a relaxed SLO")
    _gpu_model(p)
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "arxiv"])
    p.add_argument("-n", "--num-requests", type=int, default=1000, help="requests per rate tried")
    _seed_json(p, "sim_capacity.json")
    p.add_argument("--png", type=Path, default=DOCS / "capacity.png")
    p.set_defaults(fn=cmd_capacity)


def _add_routing(sub: Any) -> None:
    p = sub.add_parser("routing", help="TTFT of token-load routing vs power-of-two and round robin")
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    p.add_argument("--arrivals", nargs="+", default=["poisson", "bursty"])
    p.add_argument("--per-replica-rps", type=float, default=3.0)
    p.add_argument("--requests-per-replica", type=int, default=250)
    p.add_argument("--routers", nargs="+", choices=ROUTERS + WHAT_IF_ROUTERS, default=list(ROUTERS + WHAT_IF_ROUTERS))
    p.add_argument("--report-delay-ms", type=float, nargs="+", default=[0.0],
                   help="from a replica's report to the router seeing it, each in turn (production: up to ~300)")
    _seed_json(p, "sim_routing.json")
    p.set_defaults(fn=cmd_routing)


def _add_prefix_routing(sub: Any) -> None:
    p = sub.add_parser("prefix-routing", help="multi-turn chat: prefix-aware vs token-load vs power-of-two")
    p.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    p.add_argument("--per-replica-rps", type=float, default=15.0,
                   help="conversation starts x turns per replica per second (think time paces the rest)")
    p.add_argument("--conversations-per-replica", type=int, default=100)
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=["prefix", "token_load", "power_of_two"])
    _seed_json(p, "sim_prefix_routing.json")
    p.set_defaults(fn=cmd_prefix_routing)


def _add_autoscale(sub: Any) -> None:
    p = sub.add_parser("autoscale", help="autoscaler vs a fixed fleet sized for the peak")
    p.add_argument("--per-replica-rps", type=float, help="replica capacity (default: found by bisection)")
    p.add_argument("--peak", type=float, default=24.0)
    p.add_argument("--low", type=float, default=4.0)
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--startup-s", type=float, default=60.0, help="replica start-up delay")
    _seed_json(p, "sim_autoscale.json")
    p.add_argument("--csv", type=Path, default=DOCS / "sim_autoscale_timeline.csv")
    p.set_defaults(fn=cmd_autoscale)


def _add_speed(sub: Any) -> None:
    p = sub.add_parser("speed", help="time one large simulation")
    p.add_argument("-n", "--num-requests", type=int, default=100_000)
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--per-replica-rps", type=float, default=3.0)
    p.add_argument("--router", choices=ROUTERS, default="token_load")
    p.add_argument("--autoscale", action="store_true", help="the autoscaler on (1 to twice --replicas)")
    p.add_argument("--pass-by-pass", action="store_true",
                   help="every pass through schedule() and advance(): the reference the decode set equals")
    _seed_json(p, "sim_speed.json", seed=False)
    p.set_defaults(fn=cmd_speed)


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one sub-command per experiment (`calibrate` has its own parser)."""
    ap = argparse.ArgumentParser(prog="python -m loadtests.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_add_run, _add_capacity, _add_slo_budget, _add_slo_goodput, _add_routing, _add_prefix_routing,
                _add_autoscale, _add_speed):
        add(sub)
    p = sub.add_parser("calibrate", help="fit the cost model to the CPU engine (see: calibrate --help)")
    p.set_defaults(fn=lambda _: main(["calibrate"]))
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "calibrate":
        from loadtests.sim.calibrate import main as calibrate

        calibrate(argv[1:])
        return
    a = build_parser().parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
