"""The server's memory: RSS of its Ray workers by role, sampled every second, and its slope."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from loadtests.harness import procs
GROUPS = ("LLMServer", "OpenAIIngress", "ProxyActor")
MB = 1024 * 1024


def slope_per_min(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against ts (seconds), per minute; None under 2 distinct ts."""
    if len(ts) < 2 or max(ts) == min(ts):
        return None
    t = np.asarray(ts, dtype=float)
    y = np.asarray(ys, dtype=float)
    t = t - t.mean()
    return float(60.0 * (t * (y - y.mean())).sum() / (t * t).sum())


Sample = tuple[float, dict[str, int]]  # (monotonic time, {group: RSS bytes summed over processes})


def rss_slopes(samples: Sequence[Sample], t0: float, t1: float) -> dict[str, float | None]:
    """Each group's RSS slope (MB/min) over the samples taken in [t0, t1]."""
    slopes: dict[str, float | None] = {}
    for group in GROUPS:
        pts = [(ts, rss[group] / MB) for ts, rss in samples if group in rss and t0 <= ts <= t1]
        slopes[group] = slope_per_min([p[0] for p in pts], [p[1] for p in pts])
    return slopes


def rss_at(samples: Sequence[Sample], t: float, group: str) -> int | None:
    """The group's RSS in the last sample at or before `t` (else the first after it)."""
    best: int | None = None
    for ts, rss in samples:
        if group not in rss:
            continue
        if ts <= t or best is None:
            best = rss[group]
        if ts > t:
            break
    return best


def rss_report(samples: Sequence[Sample], group: str, t_start: float, t_end: float,
               after_s: float, tolerance: float) -> dict[str, Any]:
    """Start (at t_start), peak (from t_start on), and RSS `after_s` after t_end, in MB."""
    start = rss_at(samples, t_start, group)
    after = rss_at(samples, t_end + after_s, group)
    peak = max((rss[group] for ts, rss in samples if ts >= t_start and group in rss), default=None)
    ratio = after / start if start and after is not None else None
    mb = lambda v: None if v is None else round(v / MB, 1)  # noqa: E731
    return {"start_mb": mb(start), "peak_mb": mb(peak), "after_mb": mb(after), "after_s": after_s,
            "after_over_start": ratio,
            "within": None if ratio is None else ratio <= 1 + tolerance}


def group_of(cmdline: str) -> str | None:
    """The RSS group of a process by its title (`ray::ServeReplica:llm:LLMServer`), or None. An
    engine replica's own engine process (`replica.engine_process`) counts with its replica."""
    if "replicas.serving.engine_process" in cmdline:
        return "LLMServer"
    if "ServeReplica:" in cmdline:
        for group in ("LLMServer", "OpenAIIngress"):
            if f":{group}" in cmdline:
                return group
        return None
    return "ProxyActor" if "ray::ProxyActor" in cmdline else None


Pids = Callable[[], Iterable[int]]  # the server's processes now (every process on the machine: None)


def server_processes(pids: Pids | None) -> list[tuple[int, str, int]]:
    """(pid, command line, RSS bytes) of the server's processes."""
    table = procs.table()
    keep = table.keys() if pids is None else set(pids())
    return [(pid, table[pid][1], table[pid][2]) for pid in keep if pid in table]


class RssSampler:
    """A thread that sums the RSS of each group's processes about every `interval_s`."""

    def __init__(self, pids: Pids | None, interval_s: float = 1.0) -> None:
        self.server_pids, self.interval_s = pids, interval_s
        self.samples: list[Sample] = []
        self.pids: dict[str, set[int]] = {g: set() for g in GROUPS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def sample_once(self) -> Sample:
        rss: dict[str, int] = {}
        for pid, cmd, value in server_processes(self.server_pids):
            group = group_of(cmd)
            if group is not None:
                rss[group] = rss.get(group, 0) + value
                self.pids[group].add(pid)
        return time.monotonic(), rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample_once())
            self._stop.wait(self.interval_s)

    def series(self, t0: float, step_s: float = 10.0) -> dict[str, list[tuple[float, float]]]:
        """Every group's (seconds since t0, MB), one point per `step_s` (for the JSON)."""
        out: dict[str, list[tuple[float, float]]] = {g: [] for g in GROUPS}
        last: dict[str, float] = {}
        for ts, rss in list(self.samples):
            for g, v in rss.items():
                if ts - last.get(g, -math.inf) >= step_s:
                    out[g].append((round(ts - t0, 1), round(v / MB, 1)))
                    last[g] = ts
        return {g: pts for g, pts in out.items() if pts}
