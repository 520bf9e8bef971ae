"""A server started the way a user starts one, and everything it started ended afterwards.

Start modes (`START_MODES`):
- `local`: `python -m loadtests.harness.serve_local` (its own Ray from `ray.init(address="local")`, Serve and
  the app in one launcher; the proxy door and worker priority from `app.proxy_door.proxy_env`).
- `make`: what `make serve` runs, `serve run <config>` with `RAY_worker_niceness=0`, on a Ray
  instance of its own (`-a local`: it never joins another cluster on this machine).
- `serve-run`: plain `serve run -a local <config>`, no niceness in its environment: Ray's workers
  then run at its default nice 15.
- `cluster`: the README's "On a Ray cluster" block on one machine: `ray start --head` with
  `RAY_worker_niceness=0` on private ports, then `serve run -a <head> <config>`.
The config is serve_config.yaml with the app's settings merged in and the HTTP port replaced,
written to a private temp dir. That dir is also every Ray process's temp dir (`RAY_TMPDIR`,
`--temp-dir`): the mark `close` finds them by (`loadtests.harness.procs`), since Ray's workers leave
their launcher's process group. Not `ray stop`: it ends every Ray instance of this user on the
machine, other people's included.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import yaml

from loadtests.harness import procs

START_MODES = ("local", "make", "serve-run", "cluster")
REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO / "serve_config.yaml"
BIN = Path(sys.executable).parent  # the venv's `serve` and `ray`
NICENESS_ENV = "RAY_worker_niceness"
AUTH_TOKEN_FILE = Path.home() / ".ray" / "auth_token"
STOP_GRACE_S = 60.0  # serve run / the launcher shut Serve and Ray down in this time at most
# Ports Ray's HAProxy (serve_config.yaml's HTTP path) also listens on, on every interface (8404 and
# 9101 by default): a server of its own gets its own, so it never meets another instance's, or
# one a killed instance left behind.
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def serve_config(app_args: dict[str, Any], port: int, path: Path = SERVE_CONFIG) -> dict[str, Any]:
    """serve_config.yaml with `app_args` as its first application's `args:` and the HTTP server
    on 127.0.0.1:`port`."""
    config = yaml.safe_load(path.read_text())
    config["applications"][0]["args"] = copy.deepcopy(app_args)
    config["http_options"] = {**(config.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    return config


def config_args(path: Path = SERVE_CONFIG) -> dict[str, Any]:
    """The `args:` of serve_config.yaml's first application."""
    return dict(yaml.safe_load(path.read_text())["applications"][0].get("args") or {})


def auth_mode(env: dict[str, str]) -> str:
    """The client's RAY_AUTH_MODE for a head started here: the caller's own, else `token` when a
    token is at hand (`ray start --head` turns token auth on whenever ~/.ray/auth_token exists),
    else `disabled`."""
    if env.get("RAY_AUTH_MODE"):
        return env["RAY_AUTH_MODE"]
    has_token = env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH") or AUTH_TOKEN_FILE.exists()
    return "token" if has_token else "disabled"


def commands(start: str, config: Path, temp_dir: Path, ports: dict[str, int],
             env: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
    """The commands (argv, environment) that start a server in mode `start`, in order; each but
    the last runs to its end first. `ports`: gcs, client, agent, metrics, dashboard (cluster mode)."""
    nice = {**env, NICENESS_ENV: "0"}
    plain = {k: v for k, v in env.items() if k != NICENESS_ENV}
    own_ray = [str(BIN / "serve"), "run", "-a", "local", str(config)]  # a Ray instance of its own
    if start == "make":
        return [(own_ray, nice)]
    if start == "serve-run":
        return [(own_ray, plain)]
    if start == "cluster":
        auth = {"RAY_AUTH_MODE": auth_mode(env)}
        head = [str(BIN / "ray"), "start", "--head", "--port", str(ports["gcs"]), "--temp-dir", str(temp_dir),
                "--ray-client-server-port", str(ports["client"]),
                "--dashboard-agent-listen-port", str(ports["agent"]),
                "--metrics-export-port", str(ports["metrics"]),
                "--include-dashboard", "false", "--dashboard-port", str(ports["dashboard"]),
                "--disable-usage-stats"]
        return [(head, {**nice, **auth}),
                ([str(BIN / "serve"), "run", "-a", f"127.0.0.1:{ports['gcs']}", str(config)], {**env, **auth})]
    raise ValueError(f"start must be one of {', '.join(START_MODES)}, got {start!r}")


class Stack:
    """The processes one server needs, each started in a session of its own, their output in one
    log, and the private temp dir that marks every Ray process among them."""

    def __init__(self, log_path: str | Path, repo: Path = REPO) -> None:
        self.repo = repo  # where the server's code comes from (another checkout: a baseline)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="lt-", dir="/tmp"))  # short: Ray's socket paths
        self.procs: list[subprocess.Popen] = []
        self.log: IO[str] = open(log_path, "w")  # noqa: SIM115 - closed by close()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This environment for a server of its own: no other cluster's address, Ray's files here."""
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
               "RAY_TMPDIR": str(self.temp_dir), **(extra or {})}
        if self.repo != REPO:  # ahead of the venv's editable install of this checkout
            env["PYTHONPATH"] = str(self.repo)
        env.pop("RAY_ADDRESS", None)
        return env

    def run(self, argv: list[str], env: dict[str, str], *, to_end: bool = False) -> subprocess.Popen:
        """Start `argv` (in the repo, so `app` imports); with `to_end`, wait for it and raise
        when it fails."""
        self.log.write(f"$ {' '.join(argv)}\n")
        self.log.flush()
        with procs.interruptible():  # it stops on SIGINT (`close`)
            proc = subprocess.Popen(argv, cwd=self.repo, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        if to_end and proc.wait(STOP_GRACE_S * 3) != 0:
            raise RuntimeError(f"{argv[0]} {argv[1]} exited with code {proc.returncode} (log: {self.log.name})")
        return proc

    def pids(self) -> list[int]:
        """Every process of this server: the commands still running, every process of its Ray
        instance, and their descendants."""
        return sorted(self.started())

    def started(self) -> dict[int, int]:
        """`pids`, each with its start time (`procs.terminate` ends only those processes)."""
        return procs.started([p.pid for p in self.procs], str(self.temp_dir))

    def close(self) -> None:
        """Stop the last command first (SIGINT: `serve run` shuts Serve down, the launcher Ray),
        then end whatever of this server is left, and remove its temp dir. The processes are
        listed before the stop as well as after: one whose parent ended is no one's descendant."""
        try:
            before = self.started()
            for proc in reversed(self.procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        pass
            procs.terminate({**before, **self.started()})
            for proc in self.procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        finally:
            self.log.close()
            shutil.rmtree(self.temp_dir, ignore_errors=True)
