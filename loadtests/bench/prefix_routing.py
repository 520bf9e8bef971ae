"""Prefix-aware routing on real replicas: multi-turn chat against `prefix`, `token_load` and
`power_of_two`, the same conversations for each.

    python -m loadtests.bench.prefix_routing [--replicas 2] [--conversations 12] [--turns 4]

For each router it starts a private Ray + Serve (`serve_local`) with `--replicas` replicas,
then drives `--conversations` conversations at once, closed-loop: each turn is a streaming
completion whose prompt is the whole history as text (a system prompt of its own, every earlier
message and the answer the server gave) plus a new message, sent as soon as the previous turn
has answered, as a chat client does. Per router: TTFT p50/p99 over every turn and over the
later turns (those that can hit), and the prefix-cache hit rate the server itself reports
(`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`). Writes `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.harness import serve_local
from loadtests.harness.report import bench_parser, report
from loadtests.harness.stats import percentile

ROUTERS = ("prefix", "token_load", "power_of_two")
WORDS = ("system", "model", "token", "replica", "cache", "stream", "batch", "prompt", "answer",
         "serve", "route", "queue", "block", "budget", "latency", "throughput", "request", "user")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client: httpx.AsyncClient, rng: random.Random, turns: int, max_tokens: int,
                       system_words: int, user_words: int, think_s: float) -> list[dict[str, Any]]:
    """One conversation's turns: TTFT, prompt and cached tokens of each."""
    history = f"System: {words(rng, system_words)}\n"
    out = []
    for turn in range(turns):
        history += f"User: {words(rng, user_words)}\nAssistant:"
        body = {"prompt": history, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, first, text, usage = time.perf_counter(), None, "", None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    if first is None and choice["text"]:
                        first = time.perf_counter()
                    text += choice["text"]
        history += text + "\n"
        out.append({"turn": turn, "ttft_s": (first or time.perf_counter()) - sent,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
        await asyncio.sleep(think_s)
    return out


async def drive(base: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        runs = [conversation(client, random.Random(args.seed * 1000 + c), args.turns, args.max_tokens,
                             args.system_words, args.user_words, args.think_s)
                for c in range(args.conversations)]
        return [t for conv in await asyncio.gather(*runs) for t in conv]


def run_router(args: argparse.Namespace, router: str) -> dict[str, Any]:
    # No queue deadline (the engine's default): the queue bound is max_queued_tokens, not a
    # drain-rate estimate that starts at one chunk, so the burst of first turns queues instead of
    # drawing 429s.
    app = {"model": args.model, "router": router, "num_replicas": args.replicas, "num_cpus": 1,
           "engine": {"num_threads": 1, "max_batch_prefill_tokens": args.chunk,
                      "max_batch_total_tokens": args.kv_tokens},
           "replica": {"stream_interval_ms": 0}}
    with serve_local.served(app, args.runs_dir / f"server_{router}.log", ray_cpus=args.ray_cpus) as server:
        base = server.url
        with httpx.Client(base_url=base, timeout=600) as warm:  # first-call costs stay out
            for i in range(2 * args.replicas):
                warm.post("/v1/completions", json={"prompt": f"warm up {i}", "max_tokens": 4}).raise_for_status()
        print(f"{router}: {args.conversations} conversations x {args.turns} turns ...", flush=True)
        t0 = time.perf_counter()
        turns = asyncio.run(drive(base, args))
        elapsed = time.perf_counter() - t0
    later = [t for t in turns if t["turn"] > 0]
    return {"router": router, "turns": len(turns), "elapsed_s": elapsed,
            "ttft_p50_s": percentile([t["ttft_s"] for t in turns], 50),
            "ttft_p99_s": percentile([t["ttft_s"] for t in turns], 99),
            "later_ttft_p50_s": percentile([t["ttft_s"] for t in later], 50),
            "later_ttft_p99_s": percentile([t["ttft_s"] for t in later], 99),
            "hit_rate": sum(t["cached_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("loadtests.bench.prefix_routing", __doc__)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--think-s", type=float, default=0.2)
    p.add_argument("--chunk", type=int, default=256, help="max_batch_prefill_tokens")
    p.add_argument("--kv-tokens", type=int, default=16384, help="max_batch_total_tokens per replica")
    p.add_argument("--ray-cpus", type=int, default=4)
    p.add_argument("--runs-dir", type=Path, default=Path("loadtests/out/bench_prefix_routing"))
    args = p.parse_args(argv)
    rows = [run_router(args, r) for r in args.routers.split(",")]
    lines = [f"prefix routing on {args.replicas} x {args.model}: {args.conversations} conversations x "
             f"{args.turns} turns, closed loop, prefix cache on",
             f"{'router':<14}{'TTFT p50':>9}{'TTFT p99':>9}{'later p50':>10}{'later p99':>10}{'hit rate':>9}{'wall s':>8}"]
    for r in rows:
        lines.append(f"{r['router']:<14}{r['ttft_p50_s'] * 1e3:>7.0f}ms{r['ttft_p99_s'] * 1e3:>7.0f}ms"
                     f"{r['later_ttft_p50_s'] * 1e3:>8.0f}ms{r['later_ttft_p99_s'] * 1e3:>8.0f}ms"
                     f"{r['hit_rate']:>9.1%}{r['elapsed_s']:>8.1f}")
    return report("\n".join(lines), {"config": vars(args), "rows": rows}, args.json)


if __name__ == "__main__":
    main()
