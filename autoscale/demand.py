"""Demand the fleet served and refused, as rates over a window (pure; the controller and the
simulator keep one each).

Admission keeps TBT and queues low by refusing work: the door, the ingress, a replica's queue
bound and SLO admission answer 429 instead of letting streams slow down. The scaling signals
that admission protects (TBT p99, queued tokens, token load) therefore stay low while demand goes
unserved, so the autoscaler needs the demand itself: tokens per second (prompt + max_tokens) of
requests served and of requests refused, wherever they were refused (`scaling.refusing`).

Every source keeps monotone counters of the tokens it served and refused and reports them now
and then (a replica in its `ReplicaLoad`, the door and the ingress on their own): `DemandLog`
turns successive counter values into timestamped increments and reads rates over any part of its
window. The first value a source reports is its baseline (what it counted before the log knew
it is history, not a burst).
"""

from __future__ import annotations

from collections import deque

__all__ = ["DemandLog"]


class DemandLog:
    """Increments of served and refused tokens, kept `window_s` seconds, read as rates."""

    def __init__(self, window_s: float, start_t: float = 0.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.start_t = start_t  # rates never cover time before the log began
        self._events: deque[tuple[float, int, int]] = deque()  # (t, served, refused) increments
        self._counters: dict[str, tuple[int, int]] = {}  # source -> last (served, refused)

    def add(self, t: float, served: int = 0, refused: int = 0) -> None:
        """Tokens served and refused at time `t` (times must not go backwards much)."""
        if served or refused:
            self._events.append((t, served, refused))
        self._prune(t)

    def report(self, source: str, t: float, served_total: int, refused_total: int) -> None:
        """A source's counters at `t`: their growth since its previous report is added."""
        last = self._counters.get(source)
        self._counters[source] = (served_total, refused_total)
        if last is not None:
            self.add(t, served_total - last[0], refused_total - last[1])

    def forget(self, source: str) -> None:
        """The source went away (its increments stay in the window)."""
        self._counters.pop(source, None)

    def rates(self, now: float, since: float | None = None) -> tuple[float, float]:
        """(served, refused) tokens per second over (max(since, now - window_s, start), now]."""
        self._prune(now)
        start = max(now - self.window_s, self.start_t, since if since is not None else -float("inf"))
        span = now - start
        if span <= 0:
            return 0.0, 0.0
        served = refused = 0
        for t, s, r in reversed(self._events):
            if t <= start:  # an increment covers the time before it: (start, now]
                break
            served += s
            refused += r
        return served / span, refused / span

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        while events and events[0][0] < horizon:
            events.popleft()
