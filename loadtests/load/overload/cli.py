"""The overload test's command line and its run: the server (one it starts, or `--url`), the
phases in order, the report. See the package's docstring."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import httpx
from tqdm import tqdm

from loadtests.harness import procs
from loadtests.load.overload import __doc__ as PACKAGE_DOC
from loadtests.load.overload.phases import (Ctx, bursts, calibrate, health, overload, search, soak, steady, warm_up,
                                       with_steady_baseline)
from loadtests.load.overload.report import (format_phase, format_runs, format_step, format_targets, ms,
                                       overload_targets, run_row, soak_targets, target)
from loadtests.load.overload.rss import GROUPS, Pids, RssSampler, rss_report
from loadtests.load.overload.sse_client import raise_priority
from loadtests.load.overload.wire import Wire
from loadtests.load.overload.workload import WORKLOAD_DEFAULTS, WORKLOADS
from loadtests.harness.report import bench_parser, write_json
from loadtests.harness.serve_local import merge_args, parse_sets, served
from loadtests.harness.serve_run import START_MODES, config_args

START_CHOICES = tuple(m for m in START_MODES if m != "local")  # as a user starts a server


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, Pids | None, dict[str, Any]]]:
    """(base URL, the server's processes, what the JSON says of it): `--url`, or one started as
    `--start` says."""
    if args.url:
        if args.sets:
            tqdm.write("note: --set is ignored with --url")
        pids = None if args.server_pid is None else (lambda: procs.tree(procs.table(), [args.server_pid]))
        yield args.url.rstrip("/"), pids, {"url": args.url, "start": None, "root_pid": args.server_pid}
        return
    app_args = merge_args(config_args(), parse_sets(args.sets))
    log = args.json.parent / "overload_server.log"
    tqdm.write(f"starting the server ({args.start}; log: {log}) with {app_args}")
    with served(app_args, log, start=args.start) as srv:
        health = {k: srv.health.get(k) for k in HEALTH_KEYS}
        tqdm.write(f"server up on {srv.url}: /health {health}")
        about = {"url": srv.url, "start": args.start, "health": health, "app_args": app_args}
        yield srv.url, srv.pids, about
        # And after the run: the collections it ran (`gc`), HAProxy's weights (`http_path`).
        about["health_after"] = health_now(srv.url)
        tqdm.write("stopping the server")


HEALTH_KEYS = ("proxy_door", "niceness", "http_path", "gc")


def health_now(url: str) -> dict[str, Any]:
    """/health's `HEALTH_KEYS` now (one replica's, where several serve), or the error."""
    try:
        body = httpx.get(f"{url}/health", timeout=10).json()
    except Exception as exc:  # noqa: BLE001 - recorded, never fatal to the run's JSON
        return {"error": repr(exc)}
    return {k: body.get(k) for k in HEALTH_KEYS}


def bounds(args: argparse.Namespace) -> dict[str, float]:
    keys = ("timeout_s", "reject_p99_s", "tbt_factor", "queue_deadline_s", "rss_tolerance",
            "recovery_target_s", "rss_slope_mb_min")
    return {k: getattr(args, k) for k in keys}


async def run_all(args: argparse.Namespace, base: str, sampler: RssSampler, result: dict[str, Any]) -> None:
    """Every phase in order; `result` is filled as they finish (so a crash keeps what ran)."""
    # Measured requests go over the stamped wire (their gaps as read and on arrival); aiohttp
    # sends the few setup requests (models, calibration, health).
    connector = aiohttp.TCPConnector(limit=args.max_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
    result["client_nice"] = raise_priority(args.client_nice) if args.client_nice else None
    async with (aiohttp.ClientSession(base_url=base, connector=connector, timeout=timeout) as client,
                Wire.to(base, args.max_connections) as wire):
        async with client.get("/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        ctx = dataclasses.replace(await calibrate(client, wire, base, model, args), server_pids=sampler.server_pids)
        result["model"] = model
        result["warm_up"] = warm = await warm_up(ctx)
        tqdm.write(f"model {model}: prompts of {ctx.words} words (~{warm['prompt_tokens_est']} tokens), "
                   f"max_tokens {args.max_tokens}, workload {args.workload}; unloaded TTFT {ms(warm['ttft_p50_s'])}, "
                   f"TBT p50 {ms(warm['tbt_p50_s'])}")
        if args.bursts:
            result["bursts"] = b = await bursts(ctx, args.bursts, args.burst_size, args.burst_pause_s)
            result["targets"] = [target(f"0 of {b['count']} x {b['size']} burst requests refused",
                                        f"{b['counts']['429']} x 429, {b['counts']['ok']} ok",
                                        b["counts"]["ok"] == b["count"] * b["size"])]
            result["report"] = format_targets(result["targets"])
            return
        result["search"] = found = await search(ctx, warm)
        rate = found["sustainable_req_s"]
        tqdm.write(f"sustainable: {rate:g} req/s" + ("" if found["found"] else
                   " (NOT found: even the lowest rate tried failed; using it)")
                   + f"; its p99 TBT {ms(found['baseline_tbt_p99_s'])}")
        if args.baseline_s > 0 and not args.soak:
            st = await steady(ctx, rate, warm)
            result["search"] = found = with_steady_baseline(found, st)
            result["runs"].append(run_row("steady", st, found))
            tqdm.write(format_step(rate, st, st["verdict"])
                       + f"\nsteady state: {rate:g} req/s for {args.baseline_s:g} s; its p99 TBT "
                       f"{ms(st['tbt_p99_s'])} (the overload's baseline)")
        else:  # the search step at that rate is the sustainable load's one measurement
            step = next(s for s in found["steps"] if s["rate"] == rate)
            result["runs"].append(run_row("sustainable", step, found))
        if args.soak:
            await run_soak(ctx, args, rate, found, sampler, result)
        else:
            await run_overload(ctx, args, rate, found, sampler, result)


async def run_overload(ctx: Ctx, args: argparse.Namespace, rate: float, found: dict[str, Any],
                       sampler: RssSampler, result: dict[str, Any]) -> None:
    ov = await overload(ctx, args.factor * rate, result["warm_up"])
    t_start, t_end = ov.pop("t_start"), ov.pop("t_end")
    rss = {g: rss_report(sampler.samples, g, t_start, t_end, args.rss_after_s, args.rss_tolerance)
           for g in GROUPS}
    result["overload"] = ov
    result["runs"].append(run_row(f"overload x{args.factor:g}", ov["summary"], found))
    result["rss"] = {"groups": rss, "pids": {g: sorted(p) for g, p in sampler.pids.items()},
                     "series_mb": sampler.series(t_start)}
    result["health_after"] = await health(ctx.client)
    result["targets"] = overload_targets(ov["summary"], found["baseline_tbt_p99_s"],
                                         ov["recovery"]["recovery_s"], rss, bounds(args), ov["door_probe"],
                                         found.get("baseline_tbt_arrival_p99_s"))
    lag, probe = ov["client_loop_lag"], ov["door_probe"]
    notes = (f"  client fell behind its schedule by at most {ov['client_max_lag_s']:.3f} s; its event loop "
             f"woke late by p50 {ms(lag['p50_s'])} p99 {ms(lag['p99_s'])} max {ms(lag['max_s'])} "
             f"(niceness {result.get('client_nice')}; its garbage collector off, "
             f"{sum(ov['client_gc']['collections'].values())} collections ran anyway); the overload's requests all ended "
             f"{ov['drained_after_s']:g} s after the last send; /health after: {result['health_after']}\n"
             f"  door probe (a second client, its own process, one request every "
             f"{args.door_probe_interval_s:g} s): {probe['status_codes']}; 429 latency p50 "
             f"{ms(probe['reject_p50_s'])} p99 {ms(probe['reject_p99_s'])} max {ms(probe['reject_max_s'])}\n"
             f"  CPU over the overload, core seconds of {args.duration_s:g} s: "
             + ", ".join(f"{role} {s:.1f}" for role, s in ov["cpu_core_s"].items()))
    result["report"] = "\n\n".join([format_phase(f"overload x{args.factor:g}", ov["summary"]) + "\n"
                                    + notes, format_runs(result["runs"]), format_targets(result["targets"])])


async def run_soak(ctx: Ctx, args: argparse.Namespace, rate: float, found: dict[str, Any],
                   sampler: RssSampler, result: dict[str, Any]) -> None:
    sk = await soak(ctx, args.soak_fraction * rate, sampler)
    t_start = sk.pop("t_start")
    sk.pop("t_end")
    sk["series_mb"] = sampler.series(t_start, step_s=10.0)
    result["soak"] = sk
    result["runs"].append(run_row(f"soak x{args.soak_fraction:g}", sk["summary"], found))
    result["targets"] = soak_targets(sk, bounds(args))
    lines = [format_phase(f"soak x{args.soak_fraction:g}", sk["summary"])]
    lines += [f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in c.items() if v)
              for kind, c in sk["by_kind"].items()]
    result["report"] = "\n\n".join(["\n".join(lines), format_runs(result["runs"]), format_targets(result["targets"])])


QUICK = {"step_s": 3.0, "max_steps": 2, "duration_s": 10.0, "baseline_s": 5.0, "recovery_s": 5.0,
         "rss_after_s": 5.0, "soak_minutes": 1.0, "settle_s": 2.0, "quiet_s": 5.0, "soak_warmup_s": 5.0}
DEFAULTS = {"step_s": 10.0, "max_steps": 6, "duration_s": 60.0, "baseline_s": 60.0, "recovery_s": 30.0,
            "rss_after_s": 30.0, "soak_minutes": 30.0, "settle_s": 5.0, "quiet_s": 15.0,
            "soak_warmup_s": 60.0}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those name their normal and quick values themselves)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action) or ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    q = QUICK
    p = bench_parser("loadtests.load.overload", PACKAGE_DOC, model=None, json_path="loadtests/out/overload.json",
                     model_help="the model of the server we start (--set model=...; default serve_config.yaml's)",
                     quick=f"smoke run: {q['max_steps']} search steps of {q['step_s']:g} s, {q['duration_s']:g} s "
                     f"overload, {q['recovery_s']:g} s recovery and RSS wait, {q['soak_minutes']:g} min soak "
                     "(explicit options still win)", formatter_class=_Help)
    f, i = float, int
    add = p.add_argument

    def by_mode(flag: str, kind: type, text: str) -> None:
        """An option whose default depends on --quick (DEFAULTS and QUICK say which)."""
        key = flag[2:].replace("-", "_")
        add(flag, type=kind, help=f"{text} (default {DEFAULTS[key]:g}; quick {q[key]:g})")

    add("--start", choices=START_CHOICES, default="make", help="how the server we start is started: "
        "make (serve run, workers at nice 0, its own Ray), serve-run (plain serve run), cluster "
        "(ray start --head, then serve run -a)")
    add("--workload", choices=WORKLOADS, default="uniform", help="the requests of the search, steady "
        "state, overload and bursts (loadtests/load/overload/workload.py)")
    add("--url", help="use this running server instead of starting one")
    add("--server-pid", type=i, help="with --url: RSS only of this process's descendants")
    add("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="an app.args.AppArgs field for the server we start (repeatable)")
    add("--prompt-tokens", type=i, help="prompt length (random words, calibrated; default: the "
        "workload's, 64 uniform, 128 short-output)")
    add("--max-tokens", type=i, help="output tokens (ignore_eos; default: the workload's, 64 uniform, "
        "96 short-output)")
    add("--timeout-s", type=f, default=120.0, help="per-request limit; beyond it: timeout")
    add("--max-connections", type=i, default=2000, help="client connection pool")
    add("--rate", type=f, help="the sustainable rate, req/s: skip the search (one step measures it)")
    add("--start-rate", type=f, default=2.0, help="first search step, req/s")
    add("--max-rate", type=f, default=256.0, help="the search stops above it")
    by_mode("--max-steps", i, "rate-search steps")
    by_mode("--step-s", f, "seconds per search step")
    add("--keep-up", type=f, default=0.95, help="sustainable: completed/offered at least this")
    add("--ttft-bound-s", type=f, default=2.0, help="sustainable: p99 TTFT under this")
    by_mode("--settle-s", f, "pause after a failed step")
    add("--factor", type=f, default=10.0, help="overload = factor x sustainable")
    by_mode("--duration-s", f, "overload seconds")
    by_mode("--baseline-s", f, "seconds at the sustainable rate whose p99s are the overload's "
            "baseline (0: the search step's)")
    by_mode("--recovery-s", f, "seconds of recovery probes")
    add("--probe-interval-s", type=f, default=None,
        help="recovery probe spacing (default: the sustainable rate's mean interval, at least 0.5 s)")
    add("--probe-max-tokens", type=i, default=16, help="recovery probes' output tokens (at most --max-tokens)")
    add("--recovery-ttft-factor", type=f, default=5.0, help="normal: TTFT <= this x unloaded")
    add("--recovery-target-s", type=f, default=5.0, help="target: normal service within this")
    by_mode("--rss-after-s", f, "RSS sample this long after the overload")
    add("--rss-tolerance", type=f, default=0.2, help="target: RSS after <= (1 + this) x start")
    add("--reject-p99-s", type=f, default=0.5, help="target: 429 p99 latency under this")
    add("--door-probe-interval-s", type=f, default=0.25,
        help="overload: the door probe's spacing (a second client in its own process)")
    add("--client-nice", type=i, default=-10, help="the load generator's CPU niceness once the "
        "server is up (negative needs privileges; 0 leaves it)")
    add("--tbt-factor", type=f, default=1.5, help="target: accepted p99 TBT <= this x sustainable's")
    add("--queue-deadline-s", type=f, default=10.0, help="target: accepted p99 TTFT under this")
    add("--bursts", type=i, default=0, help="instead of the rate search and overload: this many "
        "bursts of --burst-size streams at once, each on a quiet server")
    add("--burst-size", type=i, default=128, help="requests per burst")
    add("--burst-pause-s", type=f, default=1.0, help="quiet before each burst")
    add("--soak", action="store_true", help="soak instead of overload")
    by_mode("--soak-minutes", f, "soak length")
    add("--soak-fraction", type=f, default=0.7, help="soak rate = this x sustainable")
    by_mode("--soak-warmup-s", f, "RSS slope ignores the soak's first seconds")
    add("--rss-slope-mb-min", type=f, default=1.0, help="soak target: RSS slope at most this")
    by_mode("--quiet-s", f, "quiet after the soak before the KV gauges")
    add("--metrics-url", help="a Prometheus /metrics with the engine's gauges (default: the server's own)")
    args = p.parse_args(argv)
    for key, value in {**(QUICK if args.quick else DEFAULTS), **WORKLOAD_DEFAULTS[args.workload]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model is not None:
        args.sets.append(f"model={args.model}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (`timeout`, a kill) ends the run as Ctrl-C does: the server it started is stopped
    # and what was measured is written, rather than the process dying with its server orphaned.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"config": vars(args), "start": args.start if not args.url else None,
                              "workload": args.workload, "runs": [],
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": f"{os.cpu_count()} CPUs"}
    try:
        with server(args) as (base, pids, about):
            result["server"] = about
            sampler = RssSampler(pids).start()
            try:
                asyncio.run(run_all(args, base, sampler, result))
            finally:
                sampler.stop()
    finally:
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_json(args.json, result)
    print("\n" + result.get("report", "(no report)"))
    print(f"\nwrote {args.json}")
    return 0
