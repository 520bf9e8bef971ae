"""Serving processes at full CPU priority.

Ray starts its workers, and so every replica and the HTTP proxy, at nice 15 unless the node was
started with `RAY_worker_niceness=0`, so that its own daemons stay responsive under task load. A
server's replicas are the latency path: at 15 any other process on the node (a co-located client,
Ray's dashboard agent) takes the cores first. A process may raise its own priority only with the
right (root, CAP_SYS_NICE or RLIMIT_NICE): each serving process tries, and says loudly when it
cannot.
"""

from __future__ import annotations

import logging
import os
import threading

NICENESS_ENV = "RAY_worker_niceness"
SERVING_NICENESS = 0
README_SECTION = "README.md, 'On a Ray cluster'"


def serve_at_full_priority(log: logging.Logger, what: str) -> int:
    """Set every thread of this process to SERVING_NICENESS (Linux keeps a niceness per thread,
    and threads started later inherit their parent's); returns the niceness it has after."""
    nice = set_niceness(SERVING_NICENESS)
    if nice > SERVING_NICENESS:
        log.warning("%s runs at nice %d and may not raise it: any other process on this node takes "
                    "the cores first, and latency suffers under load. Start the Ray node with "
                    "%s=%d (see %s).", what, nice, NICENESS_ENV, SERVING_NICENESS, README_SECTION)
    return nice


def set_niceness(target: int, lower_only: bool = True) -> int:
    """Set every thread of this process to niceness `target` (threads started later inherit
    their parent's): where a thread is above it, or any other when not `lower_only`. A thread
    the process has no right to lower keeps its own. Returns the process's niceness after."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's own niceness
        tids = [0]
    for tid in tids:
        _set(tid, target, lower_only)
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_thread_niceness(target: int) -> int:
    """Set the calling thread's niceness to `target` where the process may (Linux keeps one per
    thread; elsewhere the process's); returns the thread's niceness after."""
    tid = threading.get_native_id() if os.path.isdir("/proc/self/task") else 0
    _set(tid, target, lower_only=False)
    return os.getpriority(os.PRIO_PROCESS, tid)


def _set(tid: int, target: int, lower_only: bool) -> None:
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if now > target or (now < target and not lower_only):
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # no right to lower it, or the thread is gone
        pass
