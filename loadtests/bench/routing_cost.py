"""What one routing decision costs at N replicas: each routing function ranking every
candidate (the old rule) against ranking a random sample of `RouterTuning.sample_size` (the
rule Serve runs now), in one process, without Ray.

    flock /tmp/bench.lock .venv/bin/python -m loadtests.bench.routing_cost            # N = 64 and 1,000
    flock /tmp/bench.lock .venv/bin/python -m loadtests.bench.routing_cost --quick    # fewer repeats

The view is the router's: a load report per replica (token loads and KV free vary; every
replica has KV room), the keys Serve names replicas by, tokens routed to a few replicas not yet
reported, and for `choose_by_prefix` a prefix sketch per replica (one, lightly loaded, holds the
prompt's 64 blocks and the router's `PrefixHints` name it, so the decision takes the hit path). The request is 300 prompt tokens needing 600 of KV.
Each cost is the median over repeats of a batch's mean. A last row per size times the router's
ledger of requests in flight (`--in-flight` per replica): before, a decision swept it
(`InFlightBook.unreflected`); now the router reads the book's live `view` and a decision
changes it once (a tentative entry; timed with its completion, one request's two changes).

Prints one table and writes `--json` (default loadtests/out/bench_routing_cost.json).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from autoscale.inflight import InFlightBook
from autoscale.router_tuning import RouterTuning
from autoscale.routing import RequestCost, choose_by_prefix, choose_by_ttft, choose_replica
from loadtests.harness.report import bench_parser, report
from replicas.scheduling.prefix_hash import PrefixSketch, block_hashes
from replicas.protocol import ReplicaLoad

KEY = "SERVE_REPLICA::llm#LLMServer#{:05d}"  # Serve's replica key shape
REQUEST = RequestCost(300, 600)
PROMPT_BLOCKS = 64
BLOCK = 16
FUNCTIONS = ("choose_replica", "choose_by_ttft", "choose_by_prefix")


def fleet(n: int, seed: int) -> dict[str, Any]:
    """The router's view of `n` replicas: loads, candidate keys, in-flight tokens, a prompt."""
    rng = random.Random(seed)
    keys = [KEY.format(i) for i in range(n)]
    prompt = [rng.randrange(32_000) for _ in range(PROMPT_BLOCKS * BLOCK)]
    hashes = block_hashes(prompt, BLOCK)
    holder = keys[n // 2]
    loads = {}
    for k in keys:
        cached = hashes if k == holder else [rng.getrandbits(63) for _ in range(256)]
        running = rng.randrange(2_000) if k == holder else rng.randrange(20_000)  # the holder wins
        loads[k] = ReplicaLoad(replica_id=k, running_tokens=running, waiting_tokens=rng.randrange(4_000),
                               free_blocks=2_000 + rng.randrange(2_000), total_blocks=6_000, block_size=BLOCK,
                               queue_bound_tokens=8_192, prefill_tps=8_000.0 + rng.randrange(4_000),
                               prefix_sketch=PrefixSketch.of(cached, 6_000))
    in_flight = {k: 300 * rng.randrange(1, 4) for k in rng.sample(keys, min(n, 8))}
    return {"keys": keys, "loads": loads, "in_flight": in_flight, "hashes": hashes, "holder": holder}


def decision(name: str, view: dict[str, Any], sample_size: int | None, rng: random.Random) -> Callable[[], list[str]]:
    """One routing decision of `name` over `view`, as the router makes it."""
    args = (REQUEST.tokens, REQUEST.kv_tokens, view["loads"], view["in_flight"])
    kw = {"candidates": view["keys"], "rng": rng, "sample_size": sample_size}
    if name == "choose_replica":
        return lambda: choose_replica(*args, **kw)
    if name == "choose_by_ttft":
        return lambda: choose_by_ttft(*args, **kw)
    return lambda: choose_by_prefix(*args, prompt_hashes=view["hashes"], affinity=[view["holder"]], **kw)


def per_call_s(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median over `repeats` batches of the mean seconds per call."""
    fn()  # warm
    batches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t0) / calls)
    return statistics.median(batches)


def ledger(n: int, per_replica: int, seed: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """With `per_replica` requests in flight on each of `n` replicas: the sweep a decision made
    before, and the changes it makes to the live view now."""
    rng = random.Random(seed)
    book = InFlightBook()
    keys = [KEY.format(i) for i in range(n)]
    for i in range(n * per_replica):
        book.routed(str(i), keys[i % n], now=rng.random(), cost=REQUEST)
    loads = {k: ReplicaLoad(replica_id=k, timestamp=1.0 + rng.random()) for k in keys}  # some reflected
    book.view(loads)

    def one_request() -> None:
        book.tentative("new", keys[0], REQUEST, now=3.0)
        book.completed("new")

    return (lambda: book.unreflected(loads)), one_request


def run(sizes: list[int], calls: int, repeats: int, in_flight_per_replica: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    sample = RouterTuning.sample_size
    for n in sizes:
        view = fleet(n, seed)
        for name in FUNCTIONS:
            full = per_call_s(decision(name, view, None, random.Random(seed)), max(1, calls // 10), repeats)
            sampled = per_call_s(decision(name, view, sample, random.Random(seed)), calls, repeats)
            rows.append({"function": name, "replicas": n, "full_us": full * 1e6, "sampled_us": sampled * 1e6,
                         "speedup": full / sampled})
        sweep, change = ledger(n, in_flight_per_replica, seed)
        before = per_call_s(sweep, max(1, calls // 100), repeats)
        after = per_call_s(change, calls, repeats)
        rows.append({"function": f"ledger ({in_flight_per_replica}/replica)", "replicas": n,
                     "full_us": before * 1e6, "sampled_us": after * 1e6, "speedup": before / after})
    return rows


def format_table(rows: list[dict[str, Any]], sample_size: int | None, target_us: float) -> str:
    lines = [f"{'function':24s} {'N':>6s} {'full ranking us':>16s} {f'sample of {sample_size} us':>16s} "
             f"{'speedup':>8s}  target <= {target_us:.0f} us at 1,000 (ledger: sweep vs live view)"]
    for r in rows:
        mark = ""
        if r["replicas"] >= 1000 and r["function"] in FUNCTIONS:
            mark = "met" if r["sampled_us"] <= target_us else "NOT met"
        lines.append(f"{r['function']:24s} {r['replicas']:6d} {r['full_us']:16.1f} {r['sampled_us']:16.1f} "
                     f"{r['speedup']:7.1f}x  {mark}")
    return "\n".join(lines)


TARGET_US = 50.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("loadtests.bench.routing_cost", __doc__, model=False,
                     json_path="loadtests/out/bench_routing_cost.json", quick="5 repeats instead of 15")
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 1000])
    p.add_argument("--calls", type=int, default=2000, help="decisions per batch (the full ranking: a tenth)")
    p.add_argument("--in-flight", type=int, default=32, help="requests in flight per replica, for the ledger row")
    a = p.parse_args(argv)
    repeats = 5 if a.quick else 15
    rows = run(a.replicas, a.calls, repeats, a.in_flight, a.seed)
    result = {"sample_size": RouterTuning.sample_size, "target_us": TARGET_US, "repeats": repeats,
              "calls": a.calls, "rows": rows, "machine": platform.platform(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "loadavg": os.getloadavg(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return report(format_table(rows, RouterTuning.sample_size, TARGET_US), result, a.json)


if __name__ == "__main__":
    main()
