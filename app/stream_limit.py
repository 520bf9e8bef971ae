"""The door's second bound: requests in flight at this ingress, limited by how well it keeps up.

The token door (`app.admission`) asks whether the engine replicas can *start* a request within
the queue deadline. It cannot see the path the tokens take back (replica -> ingress -> proxy ->
client), which in Python and Ray costs about a millisecond of CPU per item per hop
(docs/results/overload.md). When that path saturates the engine still has room, so the token door
keeps admitting, and every stream slows together: the collapse the door exists to prevent.

`StreamLimit` is an adaptive concurrency limit (AIMD, as TCP's congestion window and Netflix's
concurrency-limits). Its signal is this ingress's event-loop lag, how late a short timer fires
(`watch_loop`), which rises when the process cannot keep up with the items it relays, whatever
the cause (its own CPU share, the GIL, a saturated host). Every `interval_s`, the mean lag of the
interval against `target_s`:

- over in each of the last `persist` intervals (2 s; CoDel's rule: a standing queue, not a
  burst passing through, which a server should absorb):
  limit <- max(min_limit, min(limit, in_flight) x DECREASE), at most once a `cooldown_s` (what
  was admitted needs a moment to show its cost, as TCP cuts once per round trip);
- over, but not through all of them: the limit holds;
- under: the limit grows, + max(1, limit x GROW_BINDING); once the lag has stayed under the
  target for `settle_s`, x GROW_IDLE + 1 (so a quiet ingress is soon open to a burst again, but
  a lull inside an overload does not throw the door open: it would let a flood in);

never above `max_limit` (`ingress_max_ongoing_requests`). A request is admitted while fewer than
`limit` are in flight; a refusal's Retry-After is the excess over the rate requests end.

Pure, with an injected clock; the watcher is plain asyncio, so all of it is tested without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replicas.scheduling.admission import MAX_RETRY_AFTER_S, STALLED_RETRY_AFTER_S  # one Retry-After bound, every 429

DEFAULT_TARGET_MS = 50.0  # AppArgs.ingress_lag_target_ms
DEFAULT_MIN_LIMIT = 8  # AppArgs.ingress_min_requests
DECREASE = 0.8
GROW_BINDING = 0.05
GROW_IDLE = 1.5
PERSIST = 4  # control intervals (0.5 s each) the lag must stay over the target before a cut
TICK_S = 0.02  # the watcher's timer
RATE_WINDOW_S = 10.0  # requests ended this recently give the Retry-After's drain rate
LOG_EVERY_S = 5.0  # the limit's log line, at most this often


@dataclass(frozen=True)
class LimitState:
    """What the last control step saw and set (for metrics and the refusal's message)."""

    limit: int
    in_flight: int
    lag_s: float  # mean event-loop lag over the interval


class StreamLimit:
    """In-flight requests at one ingress against an adaptive limit; see the module docstring."""

    def __init__(self, max_limit: int, *, target_s: float, min_limit: int = DEFAULT_MIN_LIMIT,
                 interval_s: float = 0.5, cooldown_s: float = 1.0, settle_s: float = 5.0,
                 persist: int = PERSIST,
                 clock: Callable[[], float]) -> None:
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit ({min_limit}) <= max_limit ({max_limit})")
        self.max_limit, self.min_limit = max_limit, min_limit
        self.target_s, self.interval_s, self.cooldown_s = target_s, interval_s, cooldown_s
        self.settle_s = settle_s
        self._clock = clock
        self._limit = float(max_limit)
        self.in_flight = 0
        self._ended: deque[float] = deque()
        self._lag_sum, self._lag_n = 0.0, 0
        self._interval_start = clock()
        self._decreased_at = float("-inf")
        self._over_at = float("-inf")  # the last interval whose lag was over the target
        # The last `persist` intervals' mean lags: only a lag that stays over the target through
        # all of them cuts (CoDel's rule: a standing queue, not a burst passing through).
        self._recent: deque[float] = deque(maxlen=persist)
        self.state = LimitState(max_limit, 0, 0.0)
        self.num_refused = 0
        self.num_refused_retries = 0  # of which the client said they were retries
        self.on_step: Callable[[LimitState], None] | None = None  # metrics
        self.enabled = True

    def configure(self, enabled: bool, target_s: float, max_limit: int, min_limit: int) -> None:
        """New settings; the limit it learned is kept within the new bounds."""
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit ({min_limit}) <= max_limit ({max_limit})")
        self.enabled, self.target_s = enabled, target_s
        self.max_limit, self.min_limit = max_limit, min_limit
        self._limit = min(float(max_limit), max(float(min_limit), self._limit))

    @property
    def limit(self) -> int:
        return int(self._limit)

    # ---- requests -----------------------------------------------------------------------

    def admits(self) -> bool:
        return not self.enabled or self.in_flight < self.limit

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        now = self._clock()
        self._ended.append(now)
        self._forget_ended(now)

    def refuse(self, retry: bool = False) -> int:
        """Count a refusal (`retry`: of a request the client says it retries, counted before as
        demand); its Retry-After (`retry_after_s`)."""
        self.num_refused += 1
        self.num_refused_retries += retry
        return self.retry_after_s()

    @property
    def num_refused_demand(self) -> int:
        """Refusals that are new demand (`autoscale.demand`): all but the marked retries."""
        return self.num_refused - self.num_refused_retries

    def retry_after_s(self) -> int:
        """Whole seconds until the requests over the limit have ended at the recent rate."""
        self._forget_ended(self._clock())
        if not self._ended:
            return STALLED_RETRY_AFTER_S
        excess = self.in_flight - self.limit + 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(excess / (len(self._ended) / RATE_WINDOW_S))))

    def _forget_ended(self, now: float) -> None:
        while self._ended and now - self._ended[0] > RATE_WINDOW_S:
            self._ended.popleft()

    # ---- control ------------------------------------------------------------------------

    def observe(self, lag_s: float) -> None:
        """One lag sample from the watcher; runs the control step when an interval is over."""
        self._lag_sum += max(0.0, lag_s)
        self._lag_n += 1
        now = self._clock()
        if now - self._interval_start >= self.interval_s:
            self._step(now, self._lag_sum / self._lag_n)
            self._lag_sum, self._lag_n, self._interval_start = 0.0, 0, now

    def _step(self, now: float, lag_s: float) -> None:
        self._recent.append(lag_s)
        if lag_s > self.target_s:
            self._over_at = now
            standing = len(self._recent) == self._recent.maxlen and min(self._recent) > self.target_s
            if standing and now - self._decreased_at >= self.cooldown_s:
                base = min(self._limit, float(self.in_flight))
                self._limit = max(float(self.min_limit), base * DECREASE)
                self._decreased_at = now
            # over but not (yet) standing: hold the limit where it is
        elif now - self._over_at >= self.settle_s:
            self._limit = min(float(self.max_limit), self._limit * GROW_IDLE + 1.0)
        else:
            self._limit = min(float(self.max_limit), self._limit + max(1.0, self._limit * GROW_BINDING))
        self.state = LimitState(self.limit, self.in_flight, lag_s)
        if self.on_step is not None:
            self.on_step(self.state)


async def watch_loop(observe: Callable[[float], None], clock: Callable[[], float],
                     tick_s: float = TICK_S) -> None:
    """Forever: sleep `tick_s` on the running loop and report how late it woke to `observe`
    (a `StreamLimit.observe`; the overload script's load generator records its own lag with it)."""
    while True:
        start = clock()
        await asyncio.sleep(tick_s)
        observe(clock() - start - tick_s)


def limit_observer(limit: StreamLimit, role: str, logger: logging.Logger) -> Callable[[LimitState], None]:
    """Each control step of `limit` at a `role` ("ingress", "proxy"): gauges `<role>_requests_in_flight`,
    `<role>_request_limit`, `<role>_loop_lag_seconds` (when Ray is here), and a log line at most
    every LOG_EVERY_S while it holds requests back or refuses."""
    gauges: dict[str, Any] = {}
    try:
        from replicas.serving.metric_backends import RayBackend
        from replicas.serving.metrics import PREFIX
        backend = RayBackend()
        gauges = {name: backend.gauge(PREFIX + name, doc, ()) for name, doc in (
            (f"{role}_requests_in_flight", f"Generation requests in flight at this {role}."),
            (f"{role}_request_limit", f"The {role}'s adaptive in-flight limit (app/stream_limit.py)."),
            (f"{role}_loop_lag_seconds", f"Mean event-loop lag of the {role} over the last interval."))}
    except Exception:  # noqa: BLE001 - no Ray (unit tests): no gauges
        pass
    logged = [float("-inf"), 0]  # when, refusals counted then

    def record(state: LimitState) -> None:
        for name, value in ((f"{role}_requests_in_flight", state.in_flight),
                            (f"{role}_request_limit", state.limit), (f"{role}_loop_lag_seconds", state.lag_s)):
            if name in gauges:
                gauges[name].record(value, {})
        now = time.monotonic()
        if (state.limit < limit.max_limit or limit.num_refused > logged[1]) and now - logged[0] >= LOG_EVERY_S:
            logger.info("%s in-flight limit %d (%d in flight), event-loop lag %.0f ms (target %.0f ms); "
                        "%d refused since the last line", role, state.limit, state.in_flight,
                        1000 * state.lag_s, 1000 * limit.target_s, limit.num_refused - logged[1])
            logged[:] = [now, limit.num_refused]

    return record
