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

NICENESS_ENV = "RAY_worker_niceness"
SERVING_NICENESS = 0
README_SECTION = "README.md, 'On a Ray cluster'"


def serve_at_full_priority(log: logging.Logger, what: str) -> int:
    """Set every thread of this process to SERVING_NICENESS (Linux keeps a niceness per thread,
    and threads started later inherit their parent's); returns the niceness it has after."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's own niceness
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > SERVING_NICENESS:
                os.setpriority(os.PRIO_PROCESS, tid, SERVING_NICENESS)
        except OSError:  # no right to raise it, or the thread is gone
            pass
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > SERVING_NICENESS:
        log.warning("%s runs at nice %d and may not raise it: any other process on this node takes "
                    "the cores first, and latency suffers under load. Start the Ray node with "
                    "%s=%d (see %s).", what, nice, NICENESS_ENV, SERVING_NICENESS, README_SECTION)
    return nice
