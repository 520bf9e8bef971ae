"""The server's CPU by process role: which process a command line is (`role_of`), and the core
seconds each role used over a window of a run, beside the load generator's own."""

from __future__ import annotations

import os
from collections.abc import Iterable

import psutil

from app.ingress_router import INGRESS_ROUTER_DEPLOYMENT
from loadtests.load.overload.rss import group_of

# "proxy": Serve's Python proxy, or HAProxy with the actor that manages it and the ingress request
# router it asks which replica serves (app/ingress_router.py); "engine": the engine
# replica (with the ingress in it, its HTTP work too) and its engine process; "controller": the
# load controller and Serve's; "ray": every other process of the server
ROLES = ("proxy", "ingress", "engine", "controller", "ray")
ENGINE_LOOP = "engine loop"  # `replica.engine_process`'s process, told apart where asked
CLIENT = "client"  # the load generator (this process)


def role_of(cmdline: str, split_engine: bool = False) -> str:
    """The role of a server process by its command line; with `split_engine`, the engine's own
    process is ENGINE_LOOP rather than "engine"."""
    if "haproxy" in cmdline.lower() or f":{INGRESS_ROUTER_DEPLOYMENT}" in cmdline:
        return "proxy"
    if "LoadController" in cmdline or "ServeController" in cmdline:
        return "controller"
    if "replicas.serving.engine_process" in cmdline:
        return ENGINE_LOOP if split_engine else "engine"
    group = group_of(cmdline)
    return {"ProxyActor": "proxy", "OpenAIIngress": "ingress", "LLMServer": "engine"}.get(group or "", "ray")


Reading = dict[int, tuple[str, float, str]]  # pid -> (role, CPU seconds so far, title)


def cpu_times(pids: Iterable[int], split_engine: bool = True) -> Reading:
    """pid -> (role, CPU seconds used so far: user + system, every thread, its title) for the
    live `pids` (the engine's process apart from its replica unless `split_engine` is false),
    and this process as CLIENT."""
    out: Reading = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            title = " ".join(proc.cmdline())
            role = CLIENT if pid == os.getpid() else role_of(title, split_engine)
            out[pid] = (role, times.user + times.system, title)
        except psutil.Error:  # gone since the listing
            continue
    return out


def _used(before: Reading, after: Reading) -> list[tuple[str, str, float]]:
    """(role, title, core seconds) of every process between two readings (a process started in
    between counts from 0; one that ended in between is not seen)."""
    return [(role, title, max(0.0, t1 - before.get(pid, (role, 0.0, title))[1]))
            for pid, (role, t1, title) in after.items()]


def used_by_role(before: Reading, after: Reading) -> dict[str, float]:
    """Core seconds each role used between two `cpu_times`, most first."""
    out: dict[str, float] = {}
    for role, _, used in _used(before, after):
        out[role] = out.get(role, 0.0) + used
    return {role: round(used, 2) for role, used in sorted(out.items(), key=lambda kv: -kv[1])}


def busiest(before: Reading, after: Reading, n: int = 10, width: int = 80) -> list[tuple[str, str, float]]:
    """The `n` processes that used the most CPU between two readings: (role, title cut to
    `width`, core seconds)."""
    top = sorted(_used(before, after), key=lambda r: -r[2])[:n]
    return [(role, title[:width], round(used, 2)) for role, title, used in top]
