"""The server's CPU by process role: which process a command line is (`role_of`), and the core
seconds each role used over a window of a run, beside the load generator's own."""

from __future__ import annotations

import os
from collections.abc import Iterable

import psutil

from loadtests.load.overload.rss import group_of

# "proxy": Serve's Python proxy, or HAProxy with the actor that manages it; "engine": the engine
# replica (with the ingress in it, its HTTP work too) and its engine process; "controller": the
# load controller and Serve's; "ray": every other process of the server
ROLES = ("proxy", "ingress", "engine", "controller", "ray")
ENGINE_LOOP = "engine loop"  # `replica.engine_process`'s process, told apart where asked
CLIENT = "client"  # the load generator (this process)


def role_of(cmdline: str, split_engine: bool = False) -> str:
    """The role of a server process by its command line; with `split_engine`, the engine's own
    process is ENGINE_LOOP rather than "engine"."""
    if "haproxy" in cmdline.lower():
        return "proxy"
    if "LoadController" in cmdline or "ServeController" in cmdline:
        return "controller"
    if "replicas.serving.engine_process" in cmdline:
        return ENGINE_LOOP if split_engine else "engine"
    group = group_of(cmdline)
    return {"ProxyActor": "proxy", "OpenAIIngress": "ingress", "LLMServer": "engine"}.get(group or "", "ray")


def cpu_times(pids: Iterable[int]) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds used so far: user + system, every thread) for the live `pids`
    (the engine's process split from its replica), and this process as CLIENT."""
    out: dict[int, tuple[str, float]] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            role = CLIENT if pid == os.getpid() else role_of(" ".join(proc.cmdline()), split_engine=True)
            out[pid] = (role, times.user + times.system)
        except psutil.Error:  # gone since the listing
            continue
    return out


def used_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """Core seconds each role used between two `cpu_times` (a process started in between counts
    from 0; one that ended in between is not seen)."""
    out: dict[str, float] = {}
    for pid, (role, t1) in after.items():
        t0 = before.get(pid, (role, 0.0))[1]
        out[role] = round(out.get(role, 0.0) + max(0.0, t1 - t0), 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
