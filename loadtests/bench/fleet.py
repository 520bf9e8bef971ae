"""The control plane at fleet size: what the controller, its snapshots and a routing decision cost
at N replicas, each reporting at 10 Hz with ~100 TBT gaps a report.

    flock /tmp/bench.lock .venv/bin/python -m loadtests.bench.fleet            # N = 100 and 1,000
    flock /tmp/bench.lock .venv/bin/python -m loadtests.bench.fleet --quick    # no Ray actor part

In one process, without Ray (the actor's own work; a fake clock steps 0.1 s a round):
`LoadBook.report()` per report, a node relay's batch of 8 as the controller takes it (unpickled
and recorded), the router's snapshot (`with_tbt=False`), the autoscaler's
(a 10 s TBT window and an SLO share over the deployment's replicas), `routing.choose_replica` per
request over the router's view, and the reporter's binning of one report's gaps. The book is
first filled with 10 s of reports, so the window is full when the snapshots are timed.

Then the real `LoadController` actor in a local Ray, fed by sender actors with the same synthetic
reports: reports absorbed per second when flooded (one report a call, as a reporter sends without
a relay; a node's 8 or 50 replicas a `report_many` call, as a `NodeRelay` forwards them) and the
actor's CPU time per report. Then 1,000 replicas report at 10 Hz, the senders playing the node
relays of 8 (1,250 flushes a second), first straight to the controller, then through the real hub
relays (`NodeRelay`s) the controller's budget asks for, while a router and an autoscaler ask for
snapshots: their round trips, the share of one core the actor used (its headroom is the inverse),
and the busiest hub's. The actor runs one task at a time (one thread); the senders and hubs share
the machine's two cores with it, so the flood's rate is capped by them as much as by the actor,
and the CPU figures are the actor's own.

Prints one table (with a `--before` JSON of an older run beside it) and writes `--json`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoscale.controller import DEFAULT_MAX_RELAY_CALLS_PER_S, LoadBook, load_view
from autoscale.keys import deployment_key
from autoscale.load import relay_hubs
from autoscale.relay import ReportRelay
from autoscale.routing import choose_replica
from replicas.scheduling.histogram import LogHistogram
from loadtests.harness.report import OMIT, bench_parser, report
from replicas.protocol import ReplicaLoad

REPORT_HZ = 10
GAPS_PER_REPORT = 100
WINDOW_S = 10.0  # the autoscaler's TBT window here
TBT_SLO_S = 0.05
KEY = "SERVE_REPLICA::llm#LLMServer#{:05d}"  # Serve's replica key shape
VARIANTS = 16  # distinct pre-built reports per replica (built once, not timed)
NODE_REPLICAS = 8  # replicas a node relay batches (one per GPU of an 8-GPU node)


def tbt_payload(gaps: list[float]) -> dict[str, Any]:
    """The TBT part of a report, as the reporter sends it."""
    return {"tbt_histogram": LogHistogram.of(gaps)}


def synthetic_gaps(rng: random.Random, n: int) -> list[float]:
    """Heavy-tailed decode gaps: a lognormal body around 25 ms and 1% Pareto stalls from 100 ms."""
    return [0.1 * rng.paretovariate(1.5) if rng.random() < 0.01 else rng.lognormvariate(math.log(0.025), 0.3)
            for _ in range(n)]


def synthetic_reports(n: int, seed: int) -> tuple[list[str], list[list[ReplicaLoad]]]:
    """Replica keys and, per replica, VARIANTS reports (loads and gaps vary)."""
    rng = random.Random(seed)
    keys = [KEY.format(i) for i in range(n)]
    reports = [[ReplicaLoad(replica_id=k, running_tokens=rng.randrange(20_000), waiting_tokens=rng.randrange(4_000),
                            free_blocks=rng.randrange(2_000), total_blocks=2_000, block_size=16,
                            num_running=rng.randrange(64), num_waiting=rng.randrange(8),
                            **tbt_payload(synthetic_gaps(rng, GAPS_PER_REPORT)))
                for _ in range(VARIANTS)] for k in keys]
    return keys, reports


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_book(n: int, seed: int, repeats: int) -> dict[str, float]:
    """The in-process figures at `n` replicas (seconds)."""
    keys, reports = synthetic_reports(n, seed)
    clock = Clock()
    book = LoadBook(window_s=30.0, stale_after_s=2.0, clock=clock)
    rounds = int(WINDOW_S * REPORT_HZ)
    per_round = []
    for r in range(rounds):  # 10 s of reports: the window is full
        clock.t += 1.0 / REPORT_HZ
        t0 = time.perf_counter()
        for k, variants in zip(keys, reports):
            book.report(k, variants[r % VARIANTS])
        per_round.append((time.perf_counter() - t0) / n)
    relayed = LoadBook(window_s=30.0, stale_after_s=2.0, clock=clock)
    per_relayed = []
    for r in range(VARIANTS):  # a node relay's batches, as `report_many` receives them
        batches = []
        for k in range(0, n, NODE_REPLICAS):
            relay = ReportRelay()
            for j in range(k, min(k + NODE_REPLICAS, n)):
                relay.add(keys[j], reports[j][r])
            batches.append(pickle.dumps(relay.take()))
        t0 = time.perf_counter()
        for blob in batches:
            relayed.report_many(*pickle.loads(blob))
        per_relayed.append((time.perf_counter() - t0) / n)
    router = median_s(lambda: book.snapshot(with_tbt=False), repeats)
    autoscaler = median_s(lambda: book.snapshot(keys, window_s=WINDOW_S, since=clock.t - WINDOW_S,
                                                 tbt_slo_s=TBT_SLO_S), max(1, repeats // 4 if n >= 1000 else repeats))
    loads = book.snapshot(with_tbt=False).replicas
    rng = random.Random(seed)
    in_flight = {k: rng.randrange(512) for k in rng.sample(keys, min(n, 32))}
    route = median_s(lambda: choose_replica(300, 600, loads, in_flight, rng=rng), repeats * 4)
    gaps = synthetic_gaps(rng, GAPS_PER_REPORT)
    binning = median_s(lambda: tbt_payload(gaps), repeats * 4)
    return {"report_s": statistics.median(per_round), "relayed_report_s": statistics.median(per_relayed),
            "router_snapshot_s": router,
            "autoscaler_snapshot_s": autoscaler, "choose_replica_s": route, "bin_one_report_s": binning}


# ---- the Ray actor -----------------------------------------------------------------------------


def bench_actor(n: int, seed: int, flood_reports: int, paced_s: float, senders: int) -> dict[str, Any]:
    """The real `LoadController` fed by `senders` sender actors (see the module doc)."""
    import ray

    from autoscale.controller import get_or_create_controller, kill_controller

    ray.init(num_cpus=senders + 1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    name, namespace = f"bench_fleet_{os.getpid()}", "bench_fleet"
    try:
        ctl = get_or_create_controller(name, namespace, window_s=30.0, stale_after_s=30.0)

        def cpu_s() -> float:  # the actor process's CPU time, every thread (Ray's included)
            return ray.get(ctl.__ray_call__.remote(lambda self: sum(os.times()[:2])))

        keys, reports = synthetic_reports(n, seed)
        shares = [(keys[s::senders], reports[s::senders]) for s in range(senders)]
        pool = [Sender.remote(name, namespace, k, r) for k, r in shares]
        ray.get([p.ready.remote() for p in pool])
        out: dict[str, Any] = {"senders": senders}
        for batch in (1, NODE_REPLICAS, 50):  # one report a call; a node's replicas a call
            ray.get([p.prepare.remote(batch) for p in pool])
            per = flood_reports // senders
            t0, c0 = time.perf_counter(), cpu_s()
            ray.get([p.flood.remote(per, batch) for p in pool])
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
            out[f"flood_batch{batch}_reports_per_s"] = per * senders / wall
            out[f"flood_batch{batch}_actor_cpu_us_per_report"] = cpu / (per * senders) * 1e6
        # What one router's refresh costs the actor: the snapshot over its replicas, as Ray
        # pickles a reply; the deployment's routing view pickled for one router (each asks a
        # view of its own: with and without the prefix sketches in turn); and the view as 16
        # routers refreshing within its 20 ms share it.
        calls, deployment = 192, deployment_key(keys[0])
        for label, ask in (("snapshot", lambda i: ctl.snapshot.remote(keys, with_tbt=False)),
                           ("routing_view_alone", lambda i: ctl.routing_view.remote(deployment, bool(i % 2))),
                           ("routing_view_16_routers", lambda i: ctl.routing_view.remote(deployment))):
            c0 = cpu_s()
            for i in range(calls):
                ray.get(ask(i))
                if label == "routing_view_16_routers" and i % 16 == 15:
                    time.sleep(0.025)  # the next round of refreshes finds the view aged out
            out[f"router_{label}_actor_cpu_us_per_call"] = (cpu_s() - c0) / calls * 1e6
        # 10 Hz from every replica, a node's at a time, while the snapshots are asked: the node
        # relays' flushes straight to the controller, then through the hubs it asks for.
        hubs = relay_hubs(n / NODE_REPLICAS * REPORT_HZ, DEFAULT_MAX_RELAY_CALLS_PER_S)
        for route, k in (("direct", 0), ("hubs", hubs)):
            out.update(paced(ctl, pool, keys, paced_s, route, k, cpu_s))
        return out
    finally:
        kill_controller(name, namespace)
        ray.shutdown()


def machine_busy() -> tuple[float, float]:
    """The machine's busy and total CPU ticks since boot, all cores (Linux's /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [float(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def paced(ctl: Any, pool: list[Any], keys: list[str], seconds: float, route: str, hubs: int,
          cpu_s: Callable[[], float]) -> dict[str, Any]:
    """Every replica at 10 Hz, node relays of 8 flushing to the controller (`hubs` 0) or through
    `hubs` real hub relays, for `seconds`, while a router and an autoscaler ask for snapshots."""
    import ray

    from autoscale.relay import get_or_create_hub

    ray.get([p.prepare.remote(NODE_REPLICAS, hubs) for p in pool])
    hub_handles = [get_or_create_hub(*ray.get(pool[0].names.remote()), k) for k in range(hubs)]
    hub_cpu = [lambda h=h: ray.get(h.__ray_call__.remote(lambda self: sum(os.times()[:2]))) for h in hub_handles]
    c0, h0, m0 = cpu_s(), [f() for f in hub_cpu], machine_busy()
    start = time.perf_counter()
    runs = [p.paced.remote(REPORT_HZ, seconds) for p in pool]
    lat: dict[str, list[float]] = {"router": [], "autoscaler": []}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        load_view(ray.get(ctl.routing_view.remote(deployment_key(keys[0]))))
        lat["router"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ray.get(ctl.snapshot.remote(keys, WINDOW_S, None, TBT_SLO_S))
        lat["autoscaler"].append(time.perf_counter() - t0)
        time.sleep(0.05)
    sent, lag = zip(*ray.get(runs))
    cpu, wall, m1 = cpu_s() - c0, time.perf_counter() - start, machine_busy()
    out: dict[str, Any] = {f"paced_{route}_hubs": hubs,
                           f"paced_{route}_machine_busy_share": (m1[0] - m0[0]) / (m1[1] - m0[1]), f"paced_{route}_reports_per_s": sum(sent) / seconds,
                           f"paced_{route}_max_lag_s": max(lag),
                           f"paced_{route}_actor_cpu_share": cpu / wall,  # of one core: reports and snapshots
                           f"paced_{route}_headroom_x": wall / cpu}
    if hubs:
        out[f"paced_{route}_busiest_hub_cpu_share"] = max(f() - c for f, c in zip(hub_cpu, h0)) / wall
    for kind, xs in lat.items():
        xs.sort()
        out[f"paced_{route}_{kind}_snapshot_p50_s"] = xs[len(xs) // 2]
        out[f"paced_{route}_{kind}_snapshot_max_s"] = xs[-1]
    for h in hub_handles:
        ray.kill(h, no_restart=True)
    return out


def _sender_class() -> Any:
    import ray

    from autoscale.relay import ReportRelay, get_or_create_hub, hub_index

    @ray.remote(num_cpus=1)
    class Sender:
        """Reports for its share of the fleet, fire-and-forget as `LoadReporter` sends them
        (`batch` 1), or as a `NodeRelay` of `batch` replicas forwards them (built by the relay's
        own `ReportRelay`, before the clock starts)."""

        def __init__(self, name: str, namespace: str, keys: list[str], reports: list[list[ReplicaLoad]]) -> None:
            self.name, self.namespace = name, namespace
            self.ctl = ray.get_actor(name, namespace=namespace)
            self.keys, self.reports = keys, reports
            self.batch, self.calls = 1, []

        def ready(self) -> bool:
            return True

        def names(self) -> tuple[str, str]:
            return self.name, self.namespace

        def prepare(self, batch: int, hubs: int = 0) -> None:
            """Per round of reports, the calls: (method, arguments). A batch is a node's relay's
            flush, to the controller or to the hub its node hashes to."""
            keys, reports = self.keys, self.reports
            self.batch, self.calls = batch, []
            targets = [get_or_create_hub(self.name, self.namespace, k) for k in range(hubs)]
            for r in range(VARIANTS):
                if batch == 1:
                    self.calls.append([(self.ctl.report, (k, variants[r])) for k, variants in zip(keys, reports)])
                    continue
                chunks = []
                for k in range(0, len(keys), batch):
                    relay = ReportRelay()
                    for j in range(k, min(k + batch, len(keys))):
                        relay.add(keys[j], reports[j][r])
                    target = targets[hub_index(keys[k], hubs)] if hubs else self.ctl
                    chunks.append((target.report_many, relay.take()))
                self.calls.append(chunks)

        def _send(self, r: int) -> Any:
            ref = None
            for method, args in self.calls[r % VARIANTS]:
                ref = method.remote(*args)
            return ref

        def flood(self, total: int, batch: int) -> int:
            """`total` reports as fast as they can be sent; returns once all are absorbed."""
            assert batch == self.batch, "prepare(batch) first"
            ref, sent, r = None, 0, 0
            while sent < total:
                ref = self._send(r)
                sent += len(self.keys)
                r += 1
            ray.get(ref)  # one caller's calls run in order: the last done, all done
            return sent

        def paced(self, hz: int, seconds: float) -> tuple[int, float]:
            """Every replica of the share reports `hz` times a second for `seconds` (as `prepare`
            set up); returns the reports sent and how long after it was due the last one was
            taken (by the controller, or by a hub)."""
            start, sent = time.perf_counter(), 0
            rounds = int(hz * seconds)
            ref = None
            for r in range(rounds):
                due = start + r / hz
                time.sleep(max(0.0, due - time.perf_counter()))
                ref = self._send(r)
                sent += len(self.keys)
            ray.get(ref)
            return sent, time.perf_counter() - (start + (rounds - 1) / hz)

    return Sender


Sender: Any = None


# ---- the table ---------------------------------------------------------------------------------


ROWS = (("report_s", "LoadBook.report() per report", 1e6, "us"),
        ("relayed_report_s", "a relay's batch of 8: unpickle + report_many, per report", 1e6, "us"),
        ("router_snapshot_s", "router snapshot (with_tbt=False)", 1e3, "ms"),
        ("autoscaler_snapshot_s", "autoscaler snapshot, 10 s TBT window", 1e3, "ms"),
        ("choose_replica_s", "routing.choose_replica per request", 1e6, "us"),
        ("bin_one_report_s", "reporter: bin one report's 100 gaps", 1e6, "us"))


def table(result: dict[str, Any], before: dict[str, Any] | None) -> str:
    sizes = [str(n) for n in result["book"]]
    head = ["| at N replicas, 10 Hz x ~100 gaps |"] + [f" N = {n} |" for n in sizes]
    if before:
        head += [f" before N = {n} |" for n in sizes if n in before["book"]]
    lines = ["".join(head), "|---|" + "---:|" * (len(head) - 1)]
    for key, label, scale, unit in ROWS:
        cells = [f" {result['book'][n][key] * scale:,.2f} {unit} |" for n in sizes]
        if before:
            cells += [f" {before['book'][n][key] * scale:,.2f} {unit} |" if key in before["book"][n] else " - |"
                      for n in sizes if n in before["book"]]
        lines.append(f"| {label} |" + "".join(cells))
    actor = result.get("actor")
    if actor:
        lines.append("")
        lines.append(f"LoadController actor, {actor['n']} replicas, {actor['senders']} sender actors:")
        for key, value in actor.items():
            if key not in ("n", "senders"):
                lines.append(f"  {key}: {value:,.2f}" if key.endswith(("_share", "_x", "_per_report", "_per_call"))
                             else f"  {key}: {value:,.0f}" if key.endswith("_per_s") or not key.endswith("_s")
                             else f"  {key}: {value * 1e3:.2f} ms")
    return "\n".join(lines)


def main() -> None:
    p = bench_parser("loadtests.bench.fleet", __doc__, model=OMIT, json_path="loadtests/out/bench_fleet.json",
                     quick="skip the Ray actor part", repeats=20,
                     repeats_help="timed repetitions of each snapshot (a quarter of it at N >= 1,000); medians")
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--actor-replicas", type=int, default=1000)
    p.add_argument("--flood-reports", type=int, default=20_000, help="reports per flood run")
    p.add_argument("--paced-s", type=float, default=5.0)
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--before", type=Path, default=None, help="an older run's JSON, printed beside")
    args = p.parse_args()
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                       text=True).stdout.strip(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "book": {}}
    for n in args.sizes:
        result["book"][str(n)] = bench_book(n, args.seed, args.repeats)
    if not args.quick:
        global Sender
        Sender = _sender_class()
        result["actor"] = {"n": args.actor_replicas, **bench_actor(
            args.actor_replicas, args.seed, args.flood_reports, args.paced_s, args.senders)}
    before = json.loads(args.before.read_text()) if args.before else None
    report(table(result, before), result, args.json)


if __name__ == "__main__":
    main()
