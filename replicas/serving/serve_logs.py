"""Our modules' log lines in the Serve replica's own log (and its console), at INFO.

Serve configures only its `ray.serve` logger in a replica (to the replica's log file, without
propagating); lines from `app.*`, `replicas.*` and `autoscale.*` went to the unconfigured root
logger and were lost below WARNING. Each replica class calls `use_serve_log()` once.
"""

from __future__ import annotations

import logging

PACKAGES = ("app", "replicas", "autoscale")


def use_serve_log(level: int = logging.INFO) -> None:
    """Give our packages' loggers the handlers Serve gave `ray.serve` (once; idempotent)."""
    handlers = logging.getLogger("ray.serve").handlers
    if not handlers:  # not in a Serve replica (tests, scripts): leave logging as it is
        return
    for name in PACKAGES:
        package = logging.getLogger(name)
        package.setLevel(level)
        for handler in handlers:
            if handler not in package.handlers:
                package.addHandler(handler)
        package.propagate = False
