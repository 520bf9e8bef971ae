"""Serve the OpenAI app on a private Ray instance, for load tests and the policy sweep.

    python -m loadtests.serve_local --port 8123 --set engine.policy=dynamic --set engine.max_batch_prefill_tokens=2048

Starts its OWN local Ray cluster (`address="local"`: never joins a cluster that another job or
a pytest session already runs on this machine), Serve with HTTP on 127.0.0.1:PORT, and the app
`app.builder.build_app(args)`; then blocks until SIGTERM/SIGINT and shuts both down. Every
`--set key=value` is a setting of `app.args.AppArgs` (docs/settings.md; values parsed as JSON
when they parse; `engine.policy=dynamic` sets a field of a nested record).
Readiness: poll `GET /health` (see `wait_healthy`), or wait for the READY line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
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

from app.proxy_door import proxy_env

READY = "SERVE_LOCAL_READY"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    import ray
    from ray import serve

    from app.builder import build_app

    stop = threading.Event()
    metrics: dict[str, Any] = {} if metrics_port is None else {
        "_metrics_export_port": metrics_port, "_system_config": {"metrics_report_interval_ms": 1000}}
    # The node's HTTP proxy runs the door (its settings come from the app), its workers at full priority.
    os.environ.update(proxy_env(os.environ))
    ray.init(address="local", num_cpus=ray_cpus, include_dashboard=False,
             configure_logging=False, log_to_driver=False, **metrics)
    # After ray.init: Ray installs a SIGTERM handler of its own that exits without cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="llm", route_prefix="/")
        print(f"{READY} http://127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# ---- helpers for parents (tests, sweep) -----------------------------------------------------


def launch(port: int, app_args: dict[str, Any], *, ray_cpus: int = 4,
           log_path: str | None = None, metrics_port: int | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start this module in a subprocess (its own process group); returns the Popen. Its Ray
    node's HTTP proxy runs the proxy door (`app.proxy_door`); `env` adds to the environment."""
    cmd = [sys.executable, "-m", "loadtests.serve_local", "--port", str(port), "--ray-cpus",
           str(ray_cpus)] + [a for k, v in app_args.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env.pop("RAY_ADDRESS", None)  # never attach to someone else's cluster
    out = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - child owns it
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


@contextlib.contextmanager
def served(app_args: dict[str, Any], log_path: str, *, env: dict[str, str] | None = None,
           timeout_s: float = 150.0) -> Iterator[str]:
    """A server of its own (`launch`) for a `with` block: yields its base URL once healthy,
    prints the end of its log when it fails to come up, stops it at the end."""
    port = free_port()
    proc = launch(port, app_args, log_path=log_path, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout_s=timeout_s)
        except Exception:
            print(Path(log_path).read_text()[-4000:])
            raise
        yield url
    finally:
        stop(proc)


def wait_healthy(base_url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180.0) -> None:
    """Poll GET /health until it answers 200; raise if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM the launcher (it shuts Serve and Ray down); SIGKILL its group if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtests.serve_local", description=__doc__.split("\n")[0])
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
