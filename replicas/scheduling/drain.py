"""The rate an engine's waiting prompt tokens drain, measured from its own pass records.

The engine notes when its backlog forms and clears (on its loop thread, after every change)
and keeps its passes; `DrainMeter.rate` reads both (`admission.drain_rate`) from any thread:
the engine's queue deadline (`Scheduler.expire`) and the replica's admission and load report
ask the same measure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from replicas.scheduling import admission

RECENT_PASSES = 512  # passes read for the drain rate, newest first
DRAIN_REFRESH_S = 0.1  # the drain rate is recomputed at most this often


class DrainMeter:
    """Waiting prompt tokens prefilled per second lately, cached for DRAIN_REFRESH_S."""

    def __init__(self, passes: Sequence[Any], budget_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """`passes`: the engine's pass records (`admission.PassRecord`), appended by its loop
        thread; `budget_tokens`: its prompt budget per pass (max_batch_prefill_tokens)."""
        self.passes, self.budget_tokens, self.clock = passes, budget_tokens, clock
        self.backlog_since: float | None = None  # when prompts last began to wait for their first token
        self._rate: float | None = None
        self._at = float("-inf")
        self._lock = threading.Lock()  # the loop thread and the replica's event loop both ask

    def reset(self) -> None:
        """Forget the backlog and the cached rate (the passes are the engine's to clear)."""
        with self._lock:
            self.backlog_since, self._rate, self._at = None, None, float("-inf")

    def note_backlog(self, waiting: bool) -> None:
        """Whether prompts wait for their first token now (on the engine's loop thread)."""
        if not waiting:
            self.backlog_since = None
        elif self.backlog_since is None:
            self.backlog_since = self.clock()

    def rate(self, running_since: float | None = None) -> float | None:
        """`admission.drain_rate` over the newest RECENT_PASSES passes; `running_since`: when
        the pass in progress began (None: none is)."""
        with self._lock:
            now = self.clock()
            if now - self._at >= DRAIN_REFRESH_S:
                self._rate = admission.drain_rate(newest(self.passes, RECENT_PASSES), self.budget_tokens,
                                                  self.backlog_since, now, running_since=running_since)
                self._at = now
            return self._rate


def newest(passes: Sequence[Any], n: int) -> list[Any]:
    """The last `n` entries of a deque another thread appends to, oldest first.

    Read by negative index (copying the whole deque, or iterating it, races the appends).
    """
    out = []
    for k in range(1, n + 1):
        try:
            out.append(passes[-k])
        except IndexError:
            break
    out.reverse()
    return out
