"""Serve the OpenAI app on a private Ray instance, for load tests and the policy sweep.

    python -m loadtests.harness.serve_local --port 8123 --set engine.policy=dynamic --set engine.max_batch_prefill_tokens=2048

Starts its OWN local Ray cluster (`address="local"`: never joins a cluster that another job or
a pytest session already runs on this machine), Serve with HTTP on 127.0.0.1:PORT, and the app
`app.builder.build_app(args)`; then blocks until SIGTERM/SIGINT and shuts both down. Every
`--set key=value` is a setting of `app.args.AppArgs` (docs/settings.md; values parsed as JSON
when they parse; `engine.policy=dynamic` sets a field of a nested record).
Readiness: poll `GET /health` (see `wait_healthy`), or wait for the READY line on stdout.

Benchmarks and tests get a server from `served()`, the one harness: this launcher by default, or
`serve run` / `ray start` as a user starts them (`loadtests/harness/serve_run.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.proxy_door import proxy_env
from loadtests.harness.serve_run import HAPROXY_PORT_ENVS, Stack, commands, config_args, serve_config

READY = "SERVE_LOCAL_READY"


# Ports handed out for servers to listen on: above Ray's worker ports (10002-19999) and below the
# kernel's ephemeral range (32768 and up on Linux), where the outgoing connections of the server's
# own processes would take a port between our check and its bind.
PORTS = range(20000, 32768)
DIRECT_WAIT_S = 120.0  # HAProxy serving the replicas itself after /health first answers, at most


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, from PORTS."""
    for port in random.sample(PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`["a=1", "engine.policy=dynamic"]` -> `{"a": 1, "engine": {"policy": "dynamic"}}` (JSON
    values where they parse; a dotted key sets a field of a nested record, merged into the rest)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set wants key=value, got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *path, leaf = key.split(".")
        merge_args(out, functools.reduce(lambda v, k: {k: v}, reversed(path), {leaf: value}))
    return out


def merge_args(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`more` merged into `base` (in place), nested records key by key."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_args(base[key], value)
        else:
            base[key] = value
    return base


def serve_forever(port: int, app_args: dict[str, Any], ray_cpus: int, metrics_port: int | None = None) -> None:
    """Start Ray + Serve + the app; block until a termination signal.

    With `metrics_port`, Ray exports its Prometheus metrics there, refreshed every second.
    """
    # The node's processes get HAProxy mode and the door (its settings come from the app), its
    # workers full priority; before Serve is imported, which reads its mode once.
    os.environ.update(proxy_env(os.environ))
    import ray
    from ray import serve

    from app.builder import build_app

    stop = threading.Event()
    metrics: dict[str, Any] = {} if metrics_port is None else {
        "_metrics_export_port": metrics_port, "_system_config": {"metrics_report_interval_ms": 1000}}
    ray.init(address="local", num_cpus=ray_cpus, include_dashboard=False,
             configure_logging=False, log_to_driver=False, **metrics)
    # After ray.init: Ray installs a SIGTERM handler of its own that exits without cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        serve.run(build_app(app_args), name="llm", route_prefix="/")
        print(f"{READY} http://127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# ---- the one harness: a server for a `with` block -----------------------------------------


class Server(str):
    """A server that `served` started. The string is its base URL (what a caller mostly needs);
    it also says how it was started, what /health said once it was up (`proxy_door`: the door's
    settings or null; `niceness`), and which processes are its own."""

    start: str
    health: dict[str, Any]
    stack: Stack

    def __new__(cls, url: str, start: str, health: dict[str, Any], stack: Stack) -> Server:
        server = super().__new__(cls, url)
        server.start, server.health, server.stack = start, health, stack
        return server

    @property
    def url(self) -> str:
        return str(self)

    def pids(self) -> list[int]:
        """Every process of this server now (RSS sampling)."""
        return self.stack.pids()


def launcher(port: int, app_args: dict[str, Any], ray_cpus: int = 4, metrics_port: int | None = None) -> list[str]:
    """The command that runs this module's server (`start="local"`)."""
    cmd = [sys.executable, "-m", "loadtests.harness.serve_local", "--port", str(port), "--ray-cpus",
           str(ray_cpus)] + [a for k, v in app_args.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return cmd + ([] if metrics_port is None else ["--metrics-port", str(metrics_port)])


@contextlib.contextmanager
def served(app_args: dict[str, Any], log_path: str | Path, *, start: str = "local", ray_cpus: int = 4,
           metrics_port: int | None = None, env: dict[str, str] | None = None,
           timeout_s: float = 600.0, repo: Path | None = None) -> Iterator[Server]:
    """A server of its own for a `with` block, started as `start` says (`serve_run.START_MODES`:
    this module's launcher by default, or `serve run` / `ray start` as a user starts them, with
    serve_config.yaml under `app_args`): yields it once /health answers 200 (in HAProxy mode, once
    HAProxy forwards to the replicas' own servers: `wait_direct`), prints the end of
    its log when it fails to come up, and ends every process it started, even on error.
    `ray_cpus` and `metrics_port` apply to the launcher; `env` adds to every command's environment;
    `repo`: another checkout to serve (its code and serve_config.yaml), as a baseline."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    stack = Stack(log_path) if repo is None else Stack(log_path, repo)
    try:
        port = free_port()
        if start == "local":
            last = stack.run(launcher(port, app_args, ray_cpus, metrics_port), stack.env(env))
        else:
            config = stack.temp_dir / "serve_config.yaml"
            config.write_text(yaml.safe_dump(serve_config(
                merge_args(config_args(stack.repo / "serve_config.yaml"), app_args), port,
                stack.repo / "serve_config.yaml"),
                                             sort_keys=False))
            ports = {name: free_port() for name in ("gcs", "client", "agent", "metrics", "dashboard")}
            haproxy = {name: str(free_port()) for name in HAPROXY_PORT_ENVS}
            steps = commands(start, config, stack.temp_dir, ports, stack.env({**haproxy, **(env or {})}))
            for argv, step_env in steps[:-1]:
                stack.run(argv, step_env, to_end=True)
            last = stack.run(*steps[-1])
        url = f"http://127.0.0.1:{port}"
        try:
            health = wait_direct(url, wait_healthy(url, last, timeout_s=timeout_s), last)
        except Exception:
            stack.log.flush()
            print(Path(log_path).read_text()[-4000:])
            raise
        yield Server(url, start, health, stack)
    finally:
        stack.close()


def wait_healthy(base_url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180.0) -> dict[str, Any]:
    """Poll GET /health until it answers 200 (its JSON body returned); raise if `proc` exits or
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            resp = httpx.get(f"{base_url}/health", timeout=5)
            if resp.status_code == 200:
                return resp.json()
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health not healthy after {timeout_s:.0f} s")


def wait_direct(base_url: str, health: dict[str, Any], proc: subprocess.Popen | None = None,
                timeout_s: float = DIRECT_WAIT_S) -> dict[str, Any]:
    """In Ray's HAProxy mode, poll /health until HAProxy forwards to the replicas' own servers
    (`http_path.door` "ingress"): until it has seen them healthy twice, 5 s apart, it sends
    requests through Ray's fallback Python proxy, whose costs and door are not the path's. The
    last /health body; `health` as it is on any other path."""
    deadline = time.monotonic() + timeout_s
    while (health.get("http_path") or {}).get("proxy") == "haproxy" and health["http_path"].get("door") != "ingress":
        if time.monotonic() > deadline:
            raise TimeoutError(f"HAProxy still sends {base_url} through its fallback proxy after {timeout_s:.0f} s")
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        time.sleep(1.0)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(f"{base_url}/health", timeout=5).json()
    return health


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.harness.serve_local", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=("stall_free", "dynamic", "static"))
    p.add_argument("--model")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="an app.args.AppArgs field (repeatable)")
    p.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the private Ray instance")
    p.add_argument("--metrics-port", type=int, help="export Ray's Prometheus metrics on this port")
    args = p.parse_args(argv)
    app_args = parse_sets(args.sets)
    if args.policy is not None:
        merge_args(app_args, {"engine": {"policy": args.policy}})
    if args.model is not None:
        app_args["model"] = args.model
    serve_forever(args.port, app_args, args.ray_cpus, args.metrics_port)


if __name__ == "__main__":
    main()
