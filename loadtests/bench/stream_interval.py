"""Streaming every pass's token against a stream interval, through the whole HTTP path.

    python -m loadtests.bench.stream_interval [--intervals 0,50] [--rates 4,8] [--json PATH]

For each `stream_interval_ms` it starts its own server (`loadtests/harness/serve_local.py`, the app's
defaults plus that interval), then for each rate sends streaming `/v1/completions` (open loop,
evenly spaced, `--max-tokens` tokens each, ignore_eos) for `--duration-s`, beside a trickle of
tiny invalid requests (a 400 from the ingress: how long the front door takes to answer while the
streams are relayed). Client-side figures: chunks received (network reads), TTFT and the gap
between chunks (a chunk carrying many tokens is one gap), and the probes' latency. On a 2-core
machine the server, Ray and this client share the CPUs: compare intervals within one run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import httpx

from loadtests.harness.report import OMIT, bench_parser, report
from loadtests.harness.serve_local import served
from loadtests.harness.stats import percentile


async def _mix(url: str, rate: float, duration_s: float, max_tokens: int, probe_rate: float) -> dict:
    ttft: list[float] = []
    gaps: list[float] = []
    probes: list[float] = []
    codes: dict[int, int] = {}
    chunks = 0
    body = {"prompt": "hello there " * 20, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    bad = {"prompt": "x", "max_tokens": 1, "temperature": -1}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=4000)) as client:
        start = time.perf_counter()

        async def at(t: float) -> None:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))

        async def stream(t: float) -> None:
            nonlocal chunks
            await at(t)
            sent, last = time.perf_counter(), None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                async for _ in r.aiter_raw():
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        gaps.append(now - last)
                    last, chunks = now, chunks + 1

        async def probe(t: float) -> None:
            await at(t)
            sent = time.perf_counter()
            await client.post(f"{url}/v1/completions", json=bad)
            probes.append(time.perf_counter() - sent)

        await asyncio.gather(*(stream(i / rate) for i in range(int(rate * duration_s))),
                             *(probe(i / probe_rate) for i in range(int(probe_rate * duration_s))))
    return {"rate": rate, "status": codes, "chunks": chunks, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "gap_p50_s": percentile(gaps, 50),
            "gap_p99_s": percentile(gaps, 99), "probe_p50_s": percentile(probes, 50),
            "probe_p99_s": percentile(probes, 99)}


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("loadtests.bench.stream_interval", __doc__, model="embedded:tiny", seed=OMIT)
    p.add_argument("--intervals", default="0,50", help="stream_interval_ms values, one server each")
    p.add_argument("--rates", default="4,8", help="streaming requests per second")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--probe-rate", type=float, default=1.0, help="invalid requests per second beside")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="pause after each server stops (Ray's shutdown keeps the CPUs busy a while)")
    args = p.parse_args(argv)
    rows = []
    for interval in (float(x) for x in args.intervals.split(",")):
        with served({"model": args.model, "replica": {"stream_interval_ms": interval}}, os.devnull) as server:
            for rate in (float(x) for x in args.rates.split(",")):
                rows.append({"stream_interval_ms": interval, **asyncio.run(
                    _mix(server.url, rate, args.duration_s, args.max_tokens, args.probe_rate))})
        time.sleep(args.settle_s)
    lines = [f"stream interval: {args.model}, {args.max_tokens}-token streams for {args.duration_s:g} s each, "
             f"{args.probe_rate:g} invalid request/s beside; client-side, ms",
             f"{'interval':>9}{'req/s':>7}{'200/429':>9}{'chunks':>8}{'TTFT p50':>9}{'TTFT p99':>9}"
             f"{'gap p50':>8}{'gap p99':>8}{'400 p50':>8}{'400 p99':>8}"]
    for r in rows:
        codes = f"{r['status'].get(200, 0)}/{r['status'].get(429, 0)}"
        lines.append(f"{r['stream_interval_ms']:>9g}{r['rate']:>7g}{codes:>9}{r['chunks']:>8}"
                     + "".join(f"{1e3 * r[k]:>{w}.0f}" for k, w in (("ttft_p50_s", 9), ("ttft_p99_s", 9),
                                                                     ("gap_p50_s", 8), ("gap_p99_s", 8),
                                                                     ("probe_p50_s", 8), ("probe_p99_s", 8))))
    result = {"command": " ".join(["python -m loadtests.bench.stream_interval",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args), "rows": rows, "machine": f"{os.cpu_count()} CPUs"}
    report("\n".join(lines), result, args.json)
    return result


if __name__ == "__main__":
    main()
