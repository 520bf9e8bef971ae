"""The door in Serve's HTTP proxy: a generation request is answered 429 by the proxy itself (OpenAI's
shape, Retry-After), before it crosses to an ingress replica, while the server is already behind.

Why in the proxy: every HTTP request goes client -> proxy -> ingress -> engine replica, and each
Ray hop costs milliseconds of Python per request and per streamed item. Under overload a refusal
made by the ingress costs ingress and proxy CPU for every refused request, and refused requests
queue on the way to it for seconds (docs/results/overload.md has the runs). Refused here, a
request costs the proxy its HTTP parsing and one small response, and the ingress nothing.

It closes (`Pending`): while at least 4 of the requests it forwarded wait for their first token
and their median wait is over a target (a standing queue, whatever it stands in: the Ray hops, a
starved ingress, the token door, the engine's queue; one long prompt prefilling does not close
it); while the streams it relays arrive slowly (the gaps between a stream's chunks in the last
second over a target at a quantile: the app's TBT SLO at p99 where it has one, else 250 ms at
p90; what is admitted keeps its quality, as the issue asks); while it relays as many requests
as its stream cap, the number it learned keeps those gaps under the target (cut to 0.9 x the
requests in flight when the gaps turn slow, grown by 5% at a time only while they stay quick
and the cap binds, held otherwise, through quiet spells too: without it, each time the gaps
recovered the door let a flood in, which made them slow again for as long as those streams ran,
and after the overload every new request waited for the flood to drain); and for a moment after the ingress
refused one (the server just said no). It also keeps the ingress's lag-adaptive in-flight limit
(`app.stream_limit.StreamLimit`) on the proxy's own event loop, for a proxy that is itself the
one falling behind. The ingress keeps its own limit
and the token door (`app.admission`): this door only answers early what they would refuse late.

Serve builds its proxy's middleware from the callable named by the environment variable
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read in the Ray node's environment when the proxy
starts: `make serve` and `loadtests/serve_local.py` set it to `app.proxy_door:middlewares`; on a
cluster started with `ray start`, set it there (on every node with a proxy). Settings, from the
same environment, checked when the proxy starts:

  STALLFREE_PROXY_WAIT_TARGET_MS  the median wait for a first token over which it closes (2000)
  STALLFREE_PROXY_GAP_TARGET_MS   it closes while the gaps between a stream's chunks in the last
                                  second are longer at their STALLFREE_PROXY_GAP_QUANTILE (the
                                  app's tbt_slo_ms at p99 where it has one: `proxy_env`; else
                                  250 ms at p90); "off": never
  STALLFREE_PROXY_LAG_TARGET_MS   the in-flight limit's lag target (default 50); "off": no door
  STALLFREE_PROXY_MAX_REQUESTS    the most in flight at one proxy (default 1024)
  STALLFREE_PROXY_MIN_REQUESTS    the in-flight limit never falls below this (default 8)
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError
from app.middleware import GENERATION_PATHS, StreamLimitMiddleware, refuse
from app.stream_limit import (DEFAULT_MIN_LIMIT, DEFAULT_TARGET_MS, MAX_RETRY_AFTER_S, StreamLimit,
                              limit_observer)

logger = logging.getLogger("ray.serve")  # the proxy's own log file

IMPORT_PATH = "app.proxy_door:middlewares"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# Ray starts its worker processes, and so every replica and the proxy, at nice 15 (so that its own
# daemons stay responsive under task load). A server's replicas are the latency path: at 15 any
# other process on the node, a co-located client, Ray's dashboard agent, takes the cores first
# (guidellm's throughput profile beside `make serve` on 2 cores: 0 requests completed in 30 s at
# 15, 105 and 213 in two runs at 0). Nodes started for this app run them at 0 unless the caller chose.
NICENESS_ENV = "RAY_worker_niceness"
SERVING_NICENESS = "0"
DEFAULT_MAX_REQUESTS = 1024
DEFAULT_WAIT_TARGET_MS = 2000.0
DEFAULT_GAP_TARGET_MS = 250.0
GAP_ENV = "STALLFREE_PROXY_GAP_TARGET_MS"
DEFAULT_GAP_QUANTILE = 0.9
SLO_GAP_QUANTILE = 0.99  # a TBT SLO is a p99 (the autoscaler reads it so: autoscale/scaling.py)
QUANTILE_ENV = "STALLFREE_PROXY_GAP_QUANTILE"


@dataclass(frozen=True)
class ProxyDoorConfig:
    """The proxy door's settings; `target_ms` None: no door."""

    target_ms: float | None = DEFAULT_TARGET_MS
    max_requests: int = DEFAULT_MAX_REQUESTS
    min_requests: int = DEFAULT_MIN_LIMIT
    wait_target_ms: float = DEFAULT_WAIT_TARGET_MS
    gap_target_ms: float | None = DEFAULT_GAP_TARGET_MS
    gap_quantile: float = DEFAULT_GAP_QUANTILE

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProxyDoorConfig:
        """Read and check the STALLFREE_PROXY_* variables; ValueError naming the bad one."""
        target = _setting(env, "STALLFREE_PROXY_LAG_TARGET_MS", float, DEFAULT_TARGET_MS, may_be_off=True)
        top = _setting(env, "STALLFREE_PROXY_MAX_REQUESTS", int, DEFAULT_MAX_REQUESTS)
        low = _setting(env, "STALLFREE_PROXY_MIN_REQUESTS", int, DEFAULT_MIN_LIMIT)
        if low > top:
            raise ValueError(f"need STALLFREE_PROXY_MIN_REQUESTS ({low}) <= STALLFREE_PROXY_MAX_REQUESTS ({top})")
        wait = _setting(env, "STALLFREE_PROXY_WAIT_TARGET_MS", float, DEFAULT_WAIT_TARGET_MS)
        gap = _setting(env, GAP_ENV, float, DEFAULT_GAP_TARGET_MS, may_be_off=True)
        quantile = _setting(env, QUANTILE_ENV, float, DEFAULT_GAP_QUANTILE)
        if not quantile < 1:
            raise ValueError(f"{QUANTILE_ENV} must be in (0, 1), got {quantile!r}")
        return cls(target, top, low, wait, gap, quantile)


def _setting(env: Mapping[str, str], name: str, kind: type, default: float,  # noqa: ANN202 - int or float
             may_be_off: bool = False):
    """`env[name]` as a positive `kind`: `default` when unset, None for "off" where allowed."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if may_be_off and raw.lower() == "off":
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def middlewares(env: Mapping[str, str] | None = None) -> list[Middleware]:
    """Serve's proxy callback: the door as a Starlette middleware (none when turned off)."""
    config = ProxyDoorConfig.from_env(os.environ if env is None else env)
    if config.target_ms is None:
        logger.info("proxy door off (STALLFREE_PROXY_LAG_TARGET_MS=off)")
        return []
    limit = StreamLimit(config.max_requests, target_s=config.target_ms / 1000,
                        min_limit=config.min_requests, clock=time.perf_counter)
    limit.on_step = limit_observer(limit, "proxy", logger)
    logger.info("proxy door: at most %d generation requests in flight, the limit adapting to keep "
                "the proxy's event-loop lag under %.0f ms; closed while the median wait for a first "
                "token is over %.0f ms or the stream gaps' p%g is over %s", config.max_requests,
                config.target_ms, config.wait_target_ms, 100 * config.gap_quantile,
                "(off)" if config.gap_target_ms is None else f"{config.gap_target_ms:.0f} ms")
    gap_s = config.gap_target_ms / 1000 if config.gap_target_ms is not None else None
    share = 1 - config.gap_quantile
    pending = Pending(config.wait_target_ms / 1000, time.monotonic, gap_target_s=gap_s, slow_share=share,
                      min_gaps=max(20, round(2 / share)), max_cap=config.max_requests,
                      min_cap=config.min_requests, log=logger)
    # Serve wraps the proxy's app in this list's order: the last one sees a request first. The
    # in-flight limit outside, so the waits only see 429s that came from the ingress.
    return [Middleware(PendingMiddleware, pending=pending, count=_refusal_counter()),
            Middleware(StreamLimitMiddleware, limit=limit, where="proxy")]


def _refusal_counter() -> Callable[[str], None] | None:
    """`stallfree_proxy_refusals_total{reason}` when Ray is here (the proxy), else None."""
    try:
        from replicas.metrics import PREFIX, RayBackend
        counter = RayBackend().counter(PREFIX + "proxy_refusals_total", "Generation requests the proxy "
                                       "answered 429 itself, by why (app/proxy_door.py).", ("reason",))
    except Exception:  # noqa: BLE001 - no Ray (unit tests)
        return None
    return lambda reason: counter.record(1, {"reason": reason})


def proxy_env(env: Mapping[str, str], tbt_slo_ms: float | None = None) -> dict[str, str]:
    """The environment a Ray node serving this app starts with: `env` with the proxy door's
    callback set and Ray's workers at `SERVING_NICENESS` (each unless the caller set their own),
    the door's settings checked here, before a proxy fails on them.

    With the app's `tbt_slo_ms` and no gap target of the caller's, the gap target is the SLO, as
    a p99 (`SLO_GAP_QUANTILE`, unless the caller set the quantile): the gaps the operator called
    acceptable. A longer SLO must not be refused for gaps it allows (under the SLO budget a 1 s SLO
    makes passes, and so gaps, of up to 800 ms on purpose); a shorter one is what the admitted
    streams keep under overload (docs/results/overload.md compares the targets).
    """
    out = {CALLBACK_ENV: IMPORT_PATH, NICENESS_ENV: SERVING_NICENESS, **env}
    if tbt_slo_ms is not None and not env.get(GAP_ENV, "").strip():
        out[GAP_ENV] = f"{tbt_slo_ms:g}"
        if not env.get(QUANTILE_ENV, "").strip():
            out[QUANTILE_ENV] = f"{SLO_GAP_QUANTILE:g}"
    ProxyDoorConfig.from_env(out)
    return out


def config_tbt_slo_ms(path: str) -> float | None:
    """The largest `tbt_slo_ms` among a Serve config file's applications (None: none sets one)."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    slos = [float(a["args"]["tbt_slo_ms"]) for a in config.get("applications", [])
            if (a.get("args") or {}).get("tbt_slo_ms") is not None]
    return max(slos, default=None)


CAP_DECREASE = 0.9  # the stream cap's cut: this x the requests in flight when the gaps turned slow
CAP_COOLDOWN_S = 2.0  # at most one cut this often (the gap window must show what the last did)
CAP_GROW_EVERY_S = 1.0  # at most one growth step this often (about the time an admitted request
# takes to show in the gaps: its first token under load)
CAP_GROW_BINDING = 0.05  # while the gaps are quick and the cap binds: + this share of it (at least 1)


class Pending:
    """Generation requests the proxy forwarded that have no response yet (their first token,
    or a refusal: the ingress sends nothing before either), and whether they stand in a queue.

    The proxy sees every request's wait from outside, whatever it waits for: the Ray hops, an
    ingress starved of CPU, the token door, the engine's queue. Like CoDel, it tells a standing
    queue from one slow request: the door closes while at least `min_pending` requests wait and
    their median wait is over `target_s` (one long prompt prefilling does not close it; many
    requests queueing do). A 429 from downstream closes it too, for `hold_s` (at most its
    Retry-After): the server said no, so the next arrivals are answered here, not sent to hear it.

    The stream cap bounds the requests in flight (forwarded and not ended) by how many keep the
    streams' gaps quick, learned as an AIMD limit is: when the gaps turn slow with no more in
    flight than the cap (and at least `min_cap`: a few streams left over are not what made them
    slow), the cap becomes `CAP_DECREASE` x those in flight (at most once a `CAP_COOLDOWN_S`: what
    was cut needs the gap window to show). It grows only while it is used, as TCP grows its window
    only while the sender fills it: with the gaps quick and the cap binding (in flight within one
    of it), by `CAP_GROW_BINDING` of itself (at least one) every `CAP_GROW_EVERY_S`; a cap that
    does not bind tells nothing about more streams, so it holds, through a quiet spell too (as
    TCP does not grow an idle window: a door that regrew while the load stood under it, or x1.5 a
    second once idle, let the next overload in as a flood of 2-5x the streams it had learned to
    keep quick). It starts at `max_cap` (no bound until the gaps first turn slow) and never goes
    under `min_cap`.
    """

    def __init__(self, target_s: float, clock: Callable[[], float], *, min_pending: int = 4,
                 hold_s: float = 0.5, check_every_s: float = 0.05, gap_target_s: float | None = None,
                 gap_window_s: float = 1.0, min_gaps: int = 20, slow_share: float = 0.1,
                 max_cap: int = DEFAULT_MAX_REQUESTS, min_cap: int = DEFAULT_MIN_LIMIT,
                 log: logging.Logger | None = None) -> None:
        self.target_s, self.min_pending, self.hold_s = target_s, min_pending, hold_s
        self.check_every_s = check_every_s
        self.gap_target_s, self.gap_window_s, self.min_gaps = gap_target_s, gap_window_s, min_gaps
        self.slow_share = slow_share
        self._gaps: deque[tuple[float, bool]] = deque()  # (when, over the gap target), last window
        self._num_slow = 0
        self._clock = clock
        self._started: dict[int, float] = {}  # id -> when it arrived, oldest first
        self._ids = itertools.count()
        self._checked_at = float("-inf")
        self._queueing = self._slow = False
        self.median_wait_s = 0.0
        self.reason = ""  # why the last refusal: "queueing", "slow streams", "refused downstream"
        self.held_until = float("-inf")
        self.retry_after = 1
        self.num_refused = 0
        self.max_cap, self.min_cap = max_cap, min_cap
        self.cap = float(max_cap)
        self.in_flight = 0  # forwarded, not ended (`start` .. `ended`)
        self._cut_at = self._grown_at = float("-inf")
        self._log = log

    def start(self) -> int:
        key = next(self._ids)
        self._started[key] = self._clock()
        self.in_flight += 1
        return key

    def ended(self) -> None:
        """A request `start` counted has ended (answered in full, refused, or gone)."""
        self.in_flight -= 1

    def answered(self, key: int) -> None:
        self._started.pop(key, None)

    def now(self) -> float:
        return self._clock()

    def gap(self, seconds: float) -> None:
        """A stream's chunk came `seconds` after its previous one."""
        if self.gap_target_s is None:
            return
        slow = seconds > self.gap_target_s
        self._gaps.append((self._clock(), slow))
        self._num_slow += slow

    def slow_streams(self, now: float) -> bool:
        """Over `slow_share` of the last window's chunk gaps (at least `min_gaps` of them) were
        over the gap target."""
        gaps = self._gaps
        while gaps and now - gaps[0][0] > self.gap_window_s:
            self._num_slow -= gaps.popleft()[1]
        return len(gaps) >= self.min_gaps and self._num_slow > self.slow_share * len(gaps)

    def saw_429(self, retry_after: int) -> None:
        self.retry_after = max(1, retry_after)
        self.held_until = max(self.held_until, self._clock() + min(self.hold_s, self.retry_after))

    def admits(self) -> bool:
        now = self._clock()
        if now < self.held_until:
            self.reason = "refused downstream"
            return False
        if now - self._checked_at >= self.check_every_s:
            self._checked_at = now
            n = len(self._started)
            if n < self.min_pending:
                self._queueing, self.median_wait_s = False, 0.0
            else:
                started = next(itertools.islice(self._started.values(), n // 2, None))
                self.median_wait_s = now - started
                self._queueing = self.median_wait_s > self.target_s
                if self._queueing:
                    self.retry_after = max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.median_wait_s)))
            self._slow = self.slow_streams(now)
            if self._slow and not self._queueing:
                self.retry_after = 1
            self._adapt_cap(now)
        if self._queueing:
            self.reason = "queueing"
        elif self._slow:
            self.reason = "slow streams"
        elif self.in_flight >= self.cap:
            self.reason = "stream cap"
            self.retry_after = 1
            return False
        return not (self._queueing or self._slow)

    def _adapt_cap(self, now: float) -> None:
        """The stream cap's step (see the class docstring), at each check."""
        n = self.in_flight
        if self._slow:
            if self.min_cap <= n <= self.cap and now - self._cut_at >= CAP_COOLDOWN_S:
                old, self.cap = self.cap, max(float(self.min_cap), CAP_DECREASE * n)
                self._cut_at = now
                if self._log is not None:
                    self._log.info("proxy door: stream gaps slow with %d requests in flight: stream cap "
                                   "%.0f -> %.0f", n, old, self.cap)
            return
        if (n >= self.cap - 1 and self.cap < self.max_cap
                and now - max(self._cut_at, self._grown_at) >= CAP_GROW_EVERY_S):
            self.cap = min(float(self.max_cap), self.cap + max(1.0, CAP_GROW_BINDING * self.cap))
            self._grown_at = now


class PendingMiddleware:
    """Generation requests are refused with the proxy's own 429 while `pending` does not admit;
    the others are tracked until their response starts."""

    def __init__(self, app: ASGIApp, pending: Pending, count: Callable[[str], None] | None = None) -> None:
        self.app, self.pending, self.count = app, pending, count  # count(reason): each refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        pending = self.pending
        if not pending.admits():
            pending.num_refused += 1
            retry = pending.retry_after
            if pending.reason == "queueing":
                why = (f"the requests before this one wait {pending.median_wait_s:.1f} s for their "
                       f"first token (the proxy's target {pending.target_s:.1f} s)")
            elif pending.reason == "slow streams":
                why = (f"the streams it serves already arrive slowly (more than {pending.slow_share:.0%} "
                       f"of their gaps over {1000 * pending.gap_target_s:.0f} ms)")
            elif pending.reason == "stream cap":
                why = (f"it relays {pending.in_flight} requests, as many as it found keep their streams' "
                       f"gaps under {1000 * (pending.gap_target_s or 0):.0f} ms")
            else:
                why = "it refused a request moments ago"
            if self.count is not None:
                self.count(pending.reason)
            await refuse(send, OpenAIError(429, f"the server is at capacity: {why}; retry after {retry} s",
                                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)}))
            return
        key = pending.start()

        last_chunk: float | None = None

        async def watching_send(message: Message) -> None:
            nonlocal last_chunk
            if message["type"] == "http.response.body":
                now = pending.now()
                if last_chunk is not None:
                    pending.gap(now - last_chunk)
                last_chunk = now if message.get("more_body") else None
            elif message["type"] == "http.response.start":
                pending.answered(key)
                if message["status"] == 429:
                    retry = next((v for k, v in message.get("headers", ()) if k.lower() == b"retry-after"), b"1")
                    pending.saw_429(int(retry) if retry.isdigit() else 1)
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            pending.answered(key)
            pending.ended()


if __name__ == "__main__":
    # `python -m app.proxy_door [serve_config.yaml]`: check the settings in this environment (with
    # the gap target the config's tbt_slo_ms implies) and print them to stderr; print to stdout
    # what the config adds to the environment, as NAME=value words for `env` (`make serve`).
    import sys
    try:
        slo = config_tbt_slo_ms(sys.argv[1]) if len(sys.argv) > 1 else None
        env = proxy_env(os.environ, slo)
        print(ProxyDoorConfig.from_env(env), file=sys.stderr)
        derived = [k for k in (NICENESS_ENV, GAP_ENV, QUANTILE_ENV)
                   if k in env and env[k] != os.environ.get(k)]
        if derived:  # the workers' priority; the gap target from the SLO
            print(" ".join(f"{k}={env[k]}" for k in derived))
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:
        sys.exit(f"proxy door: {exc}")
