"""The HTTP path's CPU, by process: per request and per streamed event, accepted and refused.

    python -m loadtests.bench.http_path [--baseline-ref REF] [--start make] [--json PATH]

Starts its own server (`loadtests/harness/serve_local.served`, `--start` as a user starts it, the
tiny embedded model), finds its processes by role (the HTTP proxy: Serve's Python proxy or
HAProxy with its manager; the ingress; the engine replica; the rest of Ray), and reads each one's
CPU time (user + system, every thread) around three runs, one request at a time:
- `stream`: streamed completions, a `--prompt-tokens` prompt (token ids), `--max-tokens` output
  tokens (ignore_eos), the default stream interval;
- `whole`: the same, not streamed;
- `refused`: a request the door answers 429 (its in-flight limit set to one, held by one long
  non-streamed request): CPU in every process per refusal, less what the held request costs in
  the same time.
Each run's CPU is net of the process's idle CPU over the same wall time (timers, metric pushes),
measured first. With `--baseline-ref`, the same runs against that commit's code (a git worktree),
the two servers one after the other, `--repeats` times interleaved; medians, and after/before.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.harness.report import OMIT, bench_parser, report
from loadtests.harness.serve_local import Server, served
from loadtests.harness.serve_run import REPO
from loadtests.load.overload.cpu import ENGINE_LOOP, ROLES as SERVER_ROLES, cpu_times, role_of

PATH_ROLES = ("proxy", "ingress")  # the HTTP path the target sums
# With `replica.engine_process` the engine loop's process is told apart ("engine loop"): "engine"
# is then the replica's own process, whose work is the HTTP path's (with the ingress in the
# replica), the intake and the streams' text; the table's last column adds it to PATH_ROLES.
ROLES = (*SERVER_ROLES, ENGINE_LOOP)
GAP_S = 0.05  # between two requests (the idle CPU over it is taken off)


def processes(server: Server) -> dict[str, list[str]]:
    """Each role's process titles (what the figures add up)."""
    out: dict[str, list[str]] = {r: [] for r in ROLES}
    for pid in server.pids():
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        out[role_of(title, split_engine=True)].append(title[:60])
    return {r: sorted(titles) for r, titles in out.items()}


def cpu_by_role(server: Server) -> dict[str, float]:
    """CPU seconds (user + system, all threads) each role's processes have used so far."""
    out = dict.fromkeys(ROLES, 0.0)
    for role, used, _ in cpu_times(server.pids(), split_engine=True).values():
        out[role] += used
    return out


def measured(server: Server, fn: Callable[[], int]) -> tuple[dict[str, float], float, int]:
    """(CPU seconds by role, wall seconds, items fn counted) over one call of `fn`."""
    c0, t0 = cpu_by_role(server), time.perf_counter()
    items = fn()
    wall, c1 = time.perf_counter() - t0, cpu_by_role(server)
    return {r: c1[r] - c0[r] for r in ROLES}, wall, items


def net_ms(cpu: dict[str, float], wall: float, idle: dict[str, float], per: int) -> dict[str, float]:
    """CPU ms per item by role, less the idle rate (CPU s per wall s) over the same wall time."""
    return {r: max(0.0, cpu[r] - idle[r] * wall) * 1000 / max(per, 1) for r in ROLES}


def body(args: Any, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
    return {"prompt": [5 + i % 200 for i in range(args.prompt_tokens)], "stream": stream,
            "max_tokens": max_tokens or args.max_tokens, "ignore_eos": True, "temperature": 0}


def run_server(server: Server, args: Any) -> dict[str, Any]:
    """The three runs against one server: CPU ms by role per request and per streamed event."""
    url = f"{server}/v1/completions"
    with httpx.Client(timeout=120) as client:
        for _ in range(3):  # warm up: the first requests compile, connect, fill caches
            time.sleep(1.0)
            resp = client.post(url, json=body(args, False))
            if resp.status_code != 200:
                raise RuntimeError(f"warm-up: {resp.status_code} {resp.text}")
        time.sleep(1.0)
        cpu, wall, _ = measured(server, lambda: time.sleep(args.idle_s) or 0)
        idle = {r: cpu[r] / wall for r in ROLES}

        retried = 0

        def send(stream: bool) -> int:
            """One request, sent again while the door's one slot is not yet free (it frees just
            after the previous response's last byte); the SSE events it got."""
            nonlocal retried
            while True:
                time.sleep(GAP_S)
                with client.stream("POST", url, json=body(args, stream)) as resp:
                    if resp.status_code == 429:
                        resp.read()
                        retried += 1
                        continue
                    resp.raise_for_status()
                    return sum(line.startswith("data: ") for line in resp.iter_lines())

        def stream() -> int:
            return sum(send(True) for _ in range(args.requests))

        def whole() -> int:
            return sum(send(False) * 0 + 1 for _ in range(args.requests))

        out: dict[str, Any] = {"proxy_door": server.health.get("proxy_door") is not None,
                               "http_path": server.health.get("http_path"), "processes": processes(server)}
        cpu, wall, events = measured(server, stream)
        out["stream_ms_per_request"] = net_ms(cpu, wall, idle, args.requests)
        out["stream_ms_per_event"] = net_ms(cpu, wall, idle, events)
        out["stream_events_per_request"] = events / args.requests
        cpu, wall, _ = measured(server, whole)
        out["whole_ms_per_request"] = net_ms(cpu, wall, idle, args.requests)
        out["retried_429s"] = retried
        out.update(refused(server, client, url, args, out["whole_ms_per_request"]))
    return out


def refused(server: Server, client: httpx.Client, url: str, args: Any,
            whole_ms: dict[str, float]) -> dict[str, Any]:
    """CPU per 429: long requests, one after another, hold the door's single slot while
    `--refusals` requests are sent; what the holding alone costs per second is measured first and
    taken off, and so is what a request let through between two held ones costs (`whole_ms`)."""
    stop = threading.Event()

    def hold() -> None:
        with httpx.Client(timeout=120) as holder:
            while not stop.is_set():
                holder.post(url, json=body(args, False, args.hold_tokens))

    held = threading.Thread(target=hold)
    held.start()
    time.sleep(1.0)  # it is in flight
    try:
        cpu, wall, _ = measured(server, lambda: time.sleep(args.idle_s) or 0)
        holding = {r: cpu[r] / wall for r in ROLES}
        codes: dict[int, int] = {}

        def refuse() -> int:
            for _ in range(args.refusals):
                status = client.post(url, json=body(args, False)).status_code
                codes[status] = codes.get(status, 0) + 1
            return codes.get(429, 0)

        cpu, wall, n = measured(server, refuse)
    finally:
        stop.set()
        held.join()
    served = codes.get(200, 0)
    cpu = {r: cpu[r] - served * whole_ms[r] / 1000 for r in ROLES}
    return {"refused_ms_per_request": net_ms(cpu, wall, holding, n), "refused_status": codes,
            "refused_wall_ms_per_request": 1000 * wall / max(n, 1)}


def baseline_tree(ref: str) -> Path:
    """A git worktree of `ref` (the server's code, its serve_config.yaml) in a temp dir."""
    path = Path(tempfile.mkdtemp(prefix="http-path-base-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=REPO, check=True,
                   capture_output=True)
    return path


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict) and all(isinstance(v, float) for v in value.values()):
            out[key] = {r: statistics.median(run[key][r] for run in runs) for r in value}
        elif isinstance(value, float):
            out[key] = statistics.median(run[key] for run in runs)
        else:
            out[key] = value
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| code | run | " + " | ".join(ROLES) + " | proxy + ingress | + the replica's own process |",
            "|---|---|" + "---:|" * (len(ROLES) + 2)]
    for name, res in results.items():
        for key in ("stream_ms_per_request", "stream_ms_per_event", "whole_ms_per_request",
                    "refused_ms_per_request"):
            cells = res[key]
            path = sum(cells[r] for r in PATH_ROLES)
            apart = f"{path + cells['engine']:.3f}" if cells[ENGINE_LOOP] > 0 else "-"  # the loop ran apart
            rows.append(f"| {name} | {key.replace('_ms', ' ms')} | " + " | ".join(f"{cells[r]:.3f}" for r in ROLES)
                        + f" | {path:.3f} | {apart} |")
    if "baseline" in results and "current" in results:
        for key in ("stream_ms_per_request", "refused_ms_per_request"):
            base, current = results["baseline"][key], results["current"][key]
            before, after = (sum(cells[r] for r in PATH_ROLES) for cells in (base, current))
            line = f"{key}: proxy + ingress after / before = {after / before:.3f}"
            if current[ENGINE_LOOP] > 0:  # against the same sum where the baseline's loop ran apart too
                whole_before = before + (base["engine"] if base[ENGINE_LOOP] > 0 else 0.0)
                line += f"; with the replica's own process {(after + current['engine']) / whole_before:.3f}"
            rows.append("\n" + line)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = bench_parser("loadtests.bench.http_path", __doc__, model="embedded:tiny", seed=OMIT)
    p.add_argument("--start", default="make", help="how the server starts (loadtests.harness.serve_run)")
    p.add_argument("--baseline-ref", help="also measure this commit's code (a git worktree)")
    p.add_argument("--repeats", type=int, default=1, help="servers per code, interleaved; medians")
    p.add_argument("--requests", type=int, default=40, help="requests per run, one at a time")
    p.add_argument("--refusals", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--hold-tokens", type=int, default=1800, help="each holding request's output tokens")
    p.add_argument("--idle-s", type=float, default=4.0, help="idle CPU measured over this")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="an app setting for both servers (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the current code's server (repeatable)")
    args = p.parse_args(argv)
    from loadtests.harness.serve_local import merge_args, parse_sets

    app_args = merge_args({"model": args.model, "proxy_door": {"max_requests": 1, "min_requests": 1},
                           "ingress_min_requests": 1}, parse_sets(args.sets))
    env = dict(pair.split("=", 1) for pair in args.env)
    codes: dict[str, tuple[Path | None, dict[str, str]]] = {"current": (None, env)}
    if args.baseline_ref:
        codes = {"baseline": (baseline_tree(args.baseline_ref), {}), **codes}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in codes}
    log_dir = Path(tempfile.mkdtemp(prefix="http-path-logs-"))
    try:
        for i in range(args.repeats):
            for name, (repo, extra) in codes.items():
                with served(app_args, log_dir / f"{name}-{i}.log", start=args.start, env=extra,
                            repo=repo) as server:
                    runs[name].append(run_server(server, args))
                    print(name, i, runs[name][-1], flush=True)
                time.sleep(10)  # Ray's shutdown keeps the CPUs busy a while
    finally:
        for repo, _ in codes.values():
            if repo is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(repo)], cwd=REPO, check=False)
    results = {name: medians(r) for name, r in runs.items()}
    result = {"args": vars(args), "results": results}
    return report(table(results), result, args.json)


if __name__ == "__main__":
    main()
