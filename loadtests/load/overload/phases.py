"""The phases of a run, in order: calibrate, warm-up, rate search, steady state, overload with
recovery probes, soak, bursts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from app.stream_limit import watch_loop
from loadtests.harness.arrivals import poisson_window
from loadtests.load.overload.cpu import Reading, busiest, cpu_times, used_by_role
from loadtests.load.overload.gauges import engine_state
from loadtests.load.overload.records import CATEGORIES, ReqSpec, classify, compact
from loadtests.load.overload.report import STEP_HEADER, format_step, ms
from loadtests.load.overload.rss import GROUPS, Pids, RssSampler, rss_report, rss_slopes
from loadtests.load.overload.search import next_rate, recovery_seconds, step_verdict, sustainable_rate
from loadtests.load.overload.sse_client import HEADERS, STALL_S, door_probe, drain, open_loop, sequential
from loadtests.load.overload.summary import counts, probe_summary, summarize
from loadtests.load.overload.wire import Wire
from loadtests.load.overload.workload import completion_spec, load_specs, random_text, soak_spec, uniform_specs
from loadtests.harness.stats import percentile, spread


@dataclass(frozen=True)
class Ctx:
    """What every phase needs."""

    client: aiohttp.ClientSession  # setup and health: models, calibration, /health
    wire: Wire  # every measured request
    base: str  # the server's URL
    model: str
    args: argparse.Namespace
    words: int  # prompt words for about --prompt-tokens tokens
    tokens_per_word: float
    server_pids: Pids | None = None  # the server's processes now (None: not known)

    def cpu_times(self) -> Reading:
        """CPU used so far by each of the server's processes and this one (`cpu.cpu_times`)."""
        return cpu_times([*(self.server_pids() if self.server_pids else ()), os.getpid()])

    def specs(self, seed: int, n: int) -> list[ReqSpec]:
        """`n` requests of the run's `--workload`, drawn from `seed`."""
        return load_specs(self.args.workload, np.random.default_rng(seed), n, self.model, self.words,
                          self.args.max_tokens, 1.0 / self.tokens_per_word)


async def calibrate(client: aiohttp.ClientSession, wire: Wire, base: str, model: str,
                    args: argparse.Namespace) -> Ctx:
    """Tokens per prompt word of the served model (one non-streaming request's usage)."""
    rng = np.random.default_rng(args.seed + 999)
    spec = completion_spec(model, random_text(rng, 100), 1, stream=False)
    async with client.post(spec.path, data=spec.payload, headers=HEADERS) as resp:
        resp.raise_for_status()
        per_word = (await resp.json())["usage"]["prompt_tokens"] / 100
    return Ctx(client, wire, base, model, args, max(1, round(args.prompt_tokens / per_word)), per_word)


async def warm_up(ctx: Ctx) -> dict[str, Any]:
    """Unloaded latencies: requests one at a time (the first pays first-call costs, dropped)."""
    rng = np.random.default_rng(ctx.args.seed + 998)
    specs = uniform_specs(rng, 4, ctx.model, ctx.words, ctx.args.max_tokens)
    recs = (await sequential(ctx.wire, specs, ctx.args.timeout_s))[1:]
    bad = [classify(r) for r in recs if classify(r) != "ok"]
    if bad:
        raise RuntimeError(f"warm-up requests failed on an idle server: {bad}")
    s = summarize(recs, 0.0)
    e2e = percentile([r.end_s for r in recs if r.end_s is not None], 50) or 0.0
    return {"prompt_words": ctx.words, "tokens_per_word": round(ctx.tokens_per_word, 3),
            "prompt_tokens_est": round(ctx.words * ctx.tokens_per_word),
            "max_tokens": ctx.args.max_tokens, "ttft_p50_s": s["ttft_p50_s"],
            "tbt_p50_s": s["tbt_p50_s"], "tbt_p99_s": s["tbt_p99_s"], "e2e_p50_s": e2e}


async def run_step(ctx: Ctx, rate: float, seed: int, grace_s: float, seconds: float | None = None,
                   desc: str = "search") -> dict[str, Any]:
    """`seconds` (a search step's `--step-s` unless given) of Poisson arrivals at `rate`, then at
    most `grace_s` for them to finish."""
    seconds = ctx.args.step_s if seconds is None else seconds
    offsets = poisson_window(rate, seconds, seed)
    specs = ctx.specs(seed, len(offsets))
    with tqdm(total=len(specs), desc=f"{desc} {rate:g} req/s", unit="req", leave=False) as bar, quiet_gc():
        run = await open_loop(ctx.wire, specs, offsets, ctx.args.timeout_s, bar)
        await drain(run, grace_s)
    return summarize(run.recs, seconds)


async def bursts(ctx: Ctx, count: int, size: int, pause_s: float) -> dict[str, Any]:
    """`count` bursts of `size` streaming requests sent at once to an idle server, each after
    the last has ended and `pause_s` of quiet: what a batch job or a retry storm does. The
    server has the capacity (the burst fits `max_num_seqs` and the queue); it should take them."""
    per_burst: list[dict[str, Any]] = []
    for k in range(count):
        await asyncio.sleep(pause_s)
        specs = ctx.specs(ctx.args.seed + 500 + k, size)
        with tqdm(total=size, desc=f"burst {k + 1}/{count}", unit="req", leave=False) as bar:
            run = await open_loop(ctx.wire, specs, [0.0] * size, ctx.args.timeout_s, bar)
            await drain(run, None)
        s = summarize(run.recs, 0.0)
        per_burst.append({"counts": s["counts"], "ttft_p99_s": s["ttft_p99_s"],
                          "e2e_max_s": max((r.end_s or 0.0) for r in run.recs),
                          "reject_by": {who: g["n"] for who, g in s["reject_by"].items()}})
        tqdm.write(f"burst {k + 1}: {size} at once: " + ", ".join(f"{c} {n}" for c, n in s["counts"].items() if n)
                   + f"; TTFT p99 {ms(s['ttft_p99_s'])}"
                   + "".join(f"; 429 from {who}: {n}" for who, n in per_burst[-1]["reject_by"].items()))
    total = {c: sum(b["counts"][c] for b in per_burst) for c in CATEGORIES}
    return {"count": count, "size": size, "pause_s": pause_s, "bursts": per_burst, "counts": total}


def finish_grace_s(warm: dict[str, Any]) -> float:
    """How long a step's last requests get to finish after its arrivals: 3 unloaded requests' time."""
    return max(2.0, 3.0 * warm["e2e_p50_s"])


async def search(ctx: Ctx, warm: dict[str, Any]) -> dict[str, Any]:
    """The sustainable rate (see the module doc); `--rate` measures that one rate instead."""
    a = ctx.args
    grace = finish_grace_s(warm)
    history: list[tuple[float, bool]] = []
    steps: list[dict[str, Any]] = []
    tqdm.write(f"rate search: {a.step_s:g} s steps, then up to {grace:.1f} s to finish\n{STEP_HEADER}")
    rate: float | None = a.rate or a.start_rate
    while rate is not None:
        s = await run_step(ctx, rate, a.seed + len(steps), grace)
        ok, why = step_verdict(s, a.keep_up, a.ttft_bound_s)
        history.append((rate, ok))
        steps.append({"rate": rate, "pass": ok, "verdict": why, **s})
        tqdm.write(format_step(rate, s, why))
        await asyncio.sleep(1.0 if ok else a.settle_s)  # let a failed step's backlog clear
        rate = None if a.rate else next_rate(history, a.start_rate, a.max_steps, a.max_rate)
    best = a.rate or sustainable_rate(history)
    found = bool(a.rate) or best is not None
    if best is None:  # nothing kept up: use the gentlest rate tried, and say so
        best = min(r for r, _ in history)
    base = next(st for st in steps if st["rate"] == best)
    return {"steps": steps, "sustainable_req_s": best, "found": found, "given": bool(a.rate),
            "baseline_tbt_p99_s": base["tbt_p99_s"], "baseline_ttft_p99_s": base["ttft_p99_s"],
            "baseline_tbt_arrival_p99_s": base["tbt_arrival_p99_s"]}


async def steady(ctx: Ctx, rate: float, warm: dict[str, Any]) -> dict[str, Any]:
    """`--baseline-s` of Poisson arrivals at the sustainable rate: the full-load quality the
    overload's accepted requests are held to, measured as long as the overload runs. A search
    step is too short for it: a 10 s step's 256-token streams run ~15 s, so most of their gaps
    come while its arrivals have already stopped and the load falls."""
    a = ctx.args
    s = await run_step(ctx, rate, a.seed + 100, finish_grace_s(warm), a.baseline_s, "steady")
    ok, why = step_verdict(s, a.keep_up, a.ttft_bound_s)
    return {"rate": rate, "seconds": a.baseline_s, "pass": ok, "verdict": why, **s}


def with_steady_baseline(found: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    """The search's result with its baselines taken from the steady phase `st` (the search
    step's own kept as `search_tbt_p99_s` / `search_ttft_p99_s`)."""
    return {**found, "steady": st, "search_tbt_p99_s": found["baseline_tbt_p99_s"],
            "search_tbt_arrival_p99_s": found.get("baseline_tbt_arrival_p99_s"),
            "search_ttft_p99_s": found["baseline_ttft_p99_s"],
            "baseline_tbt_p99_s": st["tbt_p99_s"], "baseline_ttft_p99_s": st["ttft_p99_s"],
            "baseline_tbt_arrival_p99_s": st["tbt_arrival_p99_s"]}


@contextlib.contextmanager
def quiet_gc(clock=time.perf_counter):
    """A measured phase without the client's own garbage collections: what exists is collected
    and frozen first, and the collector stays off until the block ends. A full collection of
    the client's objects took 0.3 s once a phase was under way, a stall of its event loop that
    every latency measured then carried (a 429 answered in 5 ms read as 0.3-0.8 s). Yields a
    dict filled at the end with the collections that ran anyway (a library's own `gc.collect`)
    and their pauses."""
    started: list[float] = []
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(clock())
        elif started:
            pauses[info["generation"]].append(clock() - started.pop())

    report: dict[str, Any] = {}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    gc.callbacks.append(on_gc)
    try:
        yield report
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        if was_enabled:
            gc.enable()
        every = [p for ps in pauses.values() for p in ps]
        report.update({"collections": {str(g): len(ps) for g, ps in pauses.items()},
                       "max_s": round(max(every, default=0.0), 4), "total_s": round(sum(every), 4)})


MIN_PROBE_INTERVAL_S = 0.5


def probe_interval_s(given: float | None, sustainable_req_s: float) -> float:
    """The recovery probes' spacing: as given, else the sustainable rate's mean interval (at least
    MIN_PROBE_INTERVAL_S). Probes are load too: faster than the sustainable rate they are an
    overload of their own, refused for as long as the server stays full, however well it recovers."""
    return given if given is not None else max(MIN_PROBE_INTERVAL_S, 1.0 / sustainable_req_s)


async def recovery(ctx: Ctx, unloaded_ttft_s: float, interval_s: float) -> dict[str, Any]:
    """Probes every `interval_s` for `--recovery-s`, from right after the overload."""
    a = ctx.args
    n = int(a.recovery_s / interval_s) + 1
    offsets = [i * interval_s for i in range(n)]
    # Short answers: a probe asks whether a new request is served normally again, and probes of
    # --max-tokens each (2 a second of 256-token streams) were on a slow day an overload of their own.
    specs = uniform_specs(np.random.default_rng(a.seed + 3000), n, ctx.model, ctx.words,
                          min(a.max_tokens, a.probe_max_tokens))
    with tqdm(total=n, desc="recovery probes", unit="req", leave=False) as bar:
        run = await open_loop(ctx.wire, specs, offsets, a.timeout_s, bar)
        await drain(run, None)
    bound = a.recovery_ttft_factor * unloaded_ttft_s
    probes = [(r.sched_s, classify(r) == "ok" and r.ttft_s is not None and r.ttft_s <= bound, r.ttft_s)
              for r in run.recs]
    return {"normal_ttft_bound_s": bound, "interval_s": interval_s, "recovery_s": recovery_seconds(probes),
            "probes": [{"sent_s": round(t, 2), "normal": ok, "category": classify(r),
                        "status": r.status, "ttft_s": None if tt is None else round(tt, 4)}
                       for (t, ok, tt), r in zip(probes, run.recs)]}


async def overload(ctx: Ctx, rate: float, warm: dict[str, Any]) -> dict[str, Any]:
    """`--duration-s` at `rate`, then the recovery probes while the overload's requests drain."""
    a = ctx.args
    offsets = poisson_window(rate, a.duration_s, a.seed + 1000)
    specs = ctx.specs(a.seed + 1000, len(offsets))
    loop = asyncio.get_running_loop()
    probe_body = completion_spec(ctx.model, "hello there", 1, stream=False).payload
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        await loop.run_in_executor(pool, door_probe, ctx.base, probe_body, 0.0, -1.0, 1.0, 1.0)  # started
        probe = loop.run_in_executor(pool, door_probe, ctx.base, probe_body, time.time(), a.duration_s,
                                     a.door_probe_interval_s, a.timeout_s)
        lag: list[float] = []  # how late this loop wakes from a 50 ms sleep: every latency includes it
        stalls: list[tuple[float, float]] = []  # (seconds into the phase, lag) of the late wakes

        def woke(late_s: float) -> None:
            lag.append(late_s)
            if late_s > STALL_S:
                stalls.append((round(time.monotonic() - t_start, 2), round(late_s, 3)))

        t_start, started_at, cpu0 = time.monotonic(), time.strftime("%H:%M:%S"), ctx.cpu_times()
        watcher = asyncio.create_task(watch_loop(woke, time.perf_counter, tick_s=0.05))
        with quiet_gc() as client_gc:
            with tqdm(total=len(specs), desc=f"overload {rate:g} req/s", unit="req", leave=False) as bar:
                run = await open_loop(ctx.wire, specs, offsets, a.timeout_s, bar)
            t_end, cpu1 = time.monotonic(), ctx.cpu_times()
            watcher.cancel()
            interval = probe_interval_s(a.probe_interval_s, rate / a.factor)
            rec_task = asyncio.create_task(recovery(ctx, warm["ttft_p50_s"], interval))
            await drain(run, None)  # every request is bounded by --timeout-s
            drained_after_s = time.monotonic() - t_end
            rec = await rec_task
        probes = await probe
    wait = t_end + a.rss_after_s + 1.5 - time.monotonic()
    if wait > 0:
        tqdm.write(f"waiting {wait:.0f} s for the RSS sample {a.rss_after_s:g} s after the overload")
        await asyncio.sleep(wait)
    return {"rate_req_s": rate, "t_start": t_start, "t_end": t_end, "started_at": started_at,
            "summary": summarize(run.recs, a.duration_s), "recovery": rec,
            "client_max_lag_s": round(run.max_lag_s, 3), "client_loop_lag": spread(lag),
            "client_loop_stalls": stalls, "client_gc": client_gc,
            "cpu_core_s": used_by_role(cpu0, cpu1), "cpu_busiest": busiest(cpu0, cpu1),
            "door_probe": probe_summary(probes), "door_probe_samples": probes,
            "drained_after_s": round(drained_after_s, 1),
            "requests": [compact(r) for r in run.recs]}


async def soak(ctx: Ctx, rate: float, sampler: RssSampler) -> dict[str, Any]:
    """`--soak-minutes` of the mixed workload at `rate`; errors, RSS slopes, KV state after."""
    a = ctx.args
    duration = 60.0 * a.soak_minutes
    offsets = poisson_window(rate, duration, a.seed + 2000)
    rng = np.random.default_rng(a.seed + 2000)
    specs = [soak_spec(rng, ctx.model, 1.0 / ctx.tokens_per_word) for _ in offsets]
    t_start = time.monotonic()
    with tqdm(total=len(specs), desc=f"soak {rate:.2f} req/s", unit="req") as bar:
        run = await open_loop(ctx.wire, specs, offsets, a.timeout_s, bar)
    t_end = time.monotonic()
    await drain(run, None)
    tqdm.write(f"soak sent; waiting {a.quiet_s:g} s of quiet before reading the engine's gauges")
    await asyncio.sleep(a.quiet_s)
    kinds = sorted({r.kind for r in run.recs})
    by_kind = {k: counts([r for r in run.recs if r.kind == k]) for k in kinds}
    # A leak grows for the whole soak; warm-up (allocator pools, caches filling to their bounds)
    # grows early and levels off. The target is read on the second half; the whole is reported.
    whole = rss_slopes(sampler.samples, t_start + a.soak_warmup_s, t_end)
    late = rss_slopes(sampler.samples, (t_start + t_end) / 2, t_end)
    rss = {g: rss_report(sampler.samples, g, t_start, t_end, a.quiet_s, a.rss_tolerance) for g in GROUPS}
    return {"rate_req_s": rate, "duration_s": duration, "t_start": t_start, "t_end": t_end,
            "summary": summarize(run.recs, duration), "by_kind": by_kind,
            "client_max_lag_s": round(run.max_lag_s, 3),
            "rss_slope_mb_per_min": whole, "rss_late_slope_mb_per_min": late, "rss": rss,
            "engine": await engine_state(a.metrics_url or f"{ctx.base}/metrics"), "health": await health(ctx.client)}


async def health(client: aiohttp.ClientSession) -> int | None:
    try:
        async with client.get("/health", timeout=aiohttp.ClientTimeout(total=15)) as resp:
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
