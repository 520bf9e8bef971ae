"""A server in a subprocess, started through the product's own entry point: `serve run` on
serve_config.yaml (what `make serve` runs), with the test's settings as the app's `args:`.

It runs on a Ray instance of its own (`-a local`) whose processes all carry a private temp dir
in their command lines (RAY_TMPDIR): ending the server ends `serve run` (SIGINT: Serve and Ray
shut down), then whatever still carries that mark or descends from what did, since Ray's workers
leave its process group (`loadtests.harness.procs`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.http_path import HA_PROXY_ENV
from loadtests.harness import procs
from loadtests.harness.serve_local import free_port
from loadtests.harness.serve_run import HAPROXY_PORT_ENVS

REPO = Path(__file__).resolve().parents[2]
STOP_S = 60.0  # serve run shuts Serve and Ray down in this time at most


DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def serve_run_config(app_args: dict[str, Any], port: int, ha_proxy: bool = True) -> dict[str, Any]:
    """serve_config.yaml with `app_args` as its application's `args:`, HTTP on 127.0.0.1:`port`,
    its replicas stopping without the window they stay open for HAProxy to take them out (5 s
    as shipped; these servers stop only at the end of their test); without `ha_proxy`, on
    Serve's Python proxy (its HAProxy switch taken out)."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["applications"][0]["args"] = app_args
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    env_vars = config["controller_options"]["runtime_env"]["env_vars"]
    env_vars[DRAIN_ENV] = "0"
    if not ha_proxy:
        del env_vars[HA_PROXY_ENV]
    return config


@contextlib.contextmanager
def serve_run(app_args: dict[str, Any], log_path: Path, timeout_s: float = 600.0,
              ha_proxy: bool = True) -> Iterator[str]:
    """`serve run` of serve_config.yaml under `app_args` for a `with` block (`ha_proxy`: as
    `serve_run_config`): yields its base URL once GET /health answers 200, and ends every process
    of it afterwards, even on error."""
    temp_dir = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))  # short: Ray's socket paths
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = temp_dir / "serve_config.yaml"
    config.write_text(yaml.safe_dump(serve_run_config(app_args, port, ha_proxy), sort_keys=False))
    env = {**os.environ, "RAY_TMPDIR": str(temp_dir), "RAY_worker_niceness": "0", "RAY_USAGE_STATS_ENABLED": "0",
           **{name: str(free_port()) for name in HAPROXY_PORT_ENVS}}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        with procs.interruptible():  # it stops on SIGINT (below)
            proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "-a", "local", str(config)],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, timeout_s, log_path)
            yield url
        finally:
            before = procs.started([proc.pid], str(temp_dir))  # listed before the stop too: an orphan is no one's descendant
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_S)
            procs.terminate({**before, **procs.started([proc.pid], str(temp_dir))}, grace_s=5.0)
            proc.wait(10)
            shutil.rmtree(temp_dir, ignore_errors=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s:.0f} s:\n{log_path.read_text()[-4000:]}")

