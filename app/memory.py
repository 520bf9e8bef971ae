"""Give memory back after a busy spell: once the ingress (or proxy) is quiet again, collect
garbage and ask glibc to return its free heap pages to the system (`malloc_trim`).

Why: an overload leaves the front's Python processes holding hundreds of MB of freed arena
memory after the overload has ended (docs/results/overload.md has the measurement), which the
allocator keeps for reuse. A trim costs a few
milliseconds, so it runs at most once per quiet spell, never in a busy one.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

CHECK_EVERY_S = 5.0
log = logging.getLogger("ray.serve")  # the Serve log of the process (proxy or ingress replica)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where there is none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class IdleTrim:
    """`step(idle)` once a check: trims on the first idle check after a busy one."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self._busy_since_trim = False
        self.num_trims = 0
        self.last_s = 0.0  # how long the last trim (collection and malloc_trim) took

    def step(self, idle: bool) -> bool:
        """True when it trimmed."""
        if not idle:
            self._busy_since_trim = True
            return False
        if not self._busy_since_trim:
            return False
        self._busy_since_trim = False
        start = time.perf_counter()
        gc.collect()
        if self._trim is not None:
            self._trim(0)
        self.last_s = time.perf_counter() - start
        self.num_trims += 1
        return True


async def trim_when_idle(is_idle: Callable[[], bool], every_s: float = CHECK_EVERY_S,
                         trimmer: IdleTrim | None = None) -> None:
    """Forever: every `every_s`, `trimmer.step(is_idle())`."""
    trimmer = trimmer or IdleTrim()
    while True:
        await asyncio.sleep(every_s)
        if trimmer.step(is_idle()):
            log.info("memory: quiet after a busy spell: garbage collected and freed heap returned in %.0f ms "
                     "(this loop was blocked that long)", 1000 * trimmer.last_s)
