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
it); while the requests it forwarded take long to reach the ingress (the median of the last
second's, by the time their response started less the ingress's own part, which the ingress
stamps on it: under overload Serve's proxy -> ingress call holds requests for seconds, and what
the ingress then refuses comes back that late; off by default: measured, it did not cure that);
while the streams it relays arrive slowly (the gaps between a stream's chunks in the last second
over a target at a quantile: the app's TBT SLO at p99 where it has one, else 250 ms at
p90; what is admitted keeps its quality, as the issue asks); while it relays as many requests
as its stream cap, the number it learned keeps those gaps under the target (cut to 0.9 x the
requests in flight when the gaps turn slow, grown by 5% at a time only while they stay quick
and the cap binds, held otherwise, through quiet spells too: without it, each time the gaps
recovered the door let a flood in, which made them slow again for as long as those streams ran,
and after the overload every new request waited for the flood to drain); for a moment after the ingress
refused one (the server just said no); and while as many of the requests it forwarded wait for an
answer as the server has lately taken without refusing (a window learned as TCP's congestion
window). It also keeps the ingress's lag-adaptive in-flight limit
(`app.stream_limit.StreamLimit`) on the proxy's own event loop, for a proxy that is itself the
one falling behind. The ingress keeps its own limit
and the token door (`app.admission`): this door only answers early what they would refuse late.

Serve builds its proxy's middleware from the callable named by the environment variable
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, read where the proxy starts. serve_config.yaml sets it
for the Serve controller it starts (`controller_options.runtime_env`), and the proxies inherit it,
so `make serve` and `serve run serve_config.yaml` on any Ray instance get the door; a Serve
instance started without it has none, which the ingress reports (`/health`, a warning).

Its settings are the app's `proxy_door:` section (`ProxyDoorConfig`), validated with the rest of
the app's arguments; the app builder publishes them in Ray's KV store and each proxy's door picks
them up within `REFRESH_S` (until then it runs on the defaults).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import os
import socket
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass as std_dataclass

from pydantic import Field
from pydantic.dataclasses import dataclass

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError
from app.http_path import HA_PROXY_ENV, runs_in
from autoscale.demand import Demand, DemandCounter, DemandCounts
from replicas.config import STRICT
from replicas.serving.priority import NICENESS_ENV, SERVING_NICENESS, serve_at_full_priority
from replicas.serving.startup_gc import freeze_startup_objects
from app.middleware import GENERATION_PATHS, INGRESS_MS_HEADER, StreamLimitMiddleware, is_client_retry, refuse
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
DEFAULT_MAX_REQUESTS = 1024
DEFAULT_WAIT_TARGET_MS = 2000.0
DEFAULT_GAP_TARGET_MS = 250.0
DEFAULT_GAP_QUANTILE = 0.9
SLO_GAP_QUANTILE = 0.99  # a TBT SLO is a p99 (the autoscaler reads it so: autoscale/scaling.py)
KV_KEY, KV_NAMESPACE = b"proxy_door", "stallfree"
REFRESH_S = 2.0  # how often a door reads its settings again
PASSED_HEADER = b"x-stallfree-proxy-door"  # on every request the door lets through: its settings


@dataclass(frozen=True, config=STRICT)
class ProxyDoorConfig:
    """The door in Serve's HTTP proxy (`proxy_door:` in serve_config.yaml)."""

    enabled: bool = Field(True, description=
        "answer generation requests 429 in the HTTP proxy while the server is behind (false: "
        "the ingress's own limits answer, later)")
    lag_target_ms: float = Field(DEFAULT_TARGET_MS, gt=0, description=
        "the proxy's in-flight limit adapts to keep its event-loop lag under this")
    max_requests: int = Field(DEFAULT_MAX_REQUESTS, ge=1, description=
        "generation requests in flight at one proxy, at most")
    min_requests: int = Field(DEFAULT_MIN_LIMIT, ge=1, description=
        "the in-flight limit and the stream cap never go below this")
    wait_target_ms: float = Field(DEFAULT_WAIT_TARGET_MS, gt=0, description=
        "the door closes while the median wait for a first token is over this")
    gap_target_ms: float | None = Field(None, gt=0, description=
        "the door closes while the gaps between a stream's chunks in the last second are longer "
        f"at gap_quantile; null: engine.tbt_slo_ms, else {DEFAULT_GAP_TARGET_MS:g} ms")
    gap_quantile: float | None = Field(None, gt=0, lt=1, description=
        f"null: {SLO_GAP_QUANTILE:g} when the gap target is the SLO (a p99), else {DEFAULT_GAP_QUANTILE:g}")
    watch_gaps: bool = Field(True, description="false: stream gaps never close the door")
    hop_target_ms: float | None = Field(None, gt=0, description=
        "the door closes while the requests it forwarded in the last second took longer than this "
        "to reach the ingress, at the median (Serve's proxy -> ingress call, which under overload "
        "holds requests for seconds: the ingress's own refusals then come back that late); null "
        "(the default): off. At 500 ms under 10x overload on 2 cores it cut the accepted streams' "
        "TBT p99 (381-529 against 691-1118 ms) but not the late refusals' latency (docs/admission.md)")

    def __post_init__(self) -> None:
        if self.min_requests > self.max_requests:
            raise ValueError(f"need min_requests ({self.min_requests}) <= max_requests ({self.max_requests})")

    def settings(self, tbt_slo_ms: float | None) -> DoorSettings:
        """The door's numbers, the gap target following the app's TBT SLO where not set: the gaps
        the operator called acceptable, at the SLO's own quantile."""
        follows_slo = self.gap_target_ms is None and tbt_slo_ms is not None
        gap = self.gap_target_ms or tbt_slo_ms or DEFAULT_GAP_TARGET_MS
        quantile = self.gap_quantile or (SLO_GAP_QUANTILE if follows_slo else DEFAULT_GAP_QUANTILE)
        return DoorSettings(self.enabled, self.lag_target_ms / 1000, self.max_requests,
                            self.min_requests, self.wait_target_ms / 1000,
                            gap / 1000 if self.watch_gaps else None, round(1 - quantile, 9),
                            hop_target_s=None if self.hop_target_ms is None else self.hop_target_ms / 1000)


@std_dataclass(frozen=True)
class DoorSettings:
    """What a running door reads (seconds; `slow_share` = 1 - the gap quantile)."""

    enabled: bool
    lag_target_s: float
    max_requests: int
    min_requests: int
    wait_target_s: float
    gap_target_s: float | None
    slow_share: float
    # Where the door's refusals go as refused demand (`autoscale.demand`): the controller actor's
    # name and namespace and the engine deployment's key; "": not reported.
    controller_name: str = ""
    controller_namespace: str = ""
    deployment: str = ""
    hop_target_s: float | None = None  # the way to the ingress (`Pending.hop`); None: not watched


def publish(settings: DoorSettings) -> None:
    """Hand the app's door settings to every proxy (they read them within REFRESH_S)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(KV_KEY, json.dumps(dataclasses.asdict(settings)).encode(),
                                 overwrite=True, namespace=KV_NAMESPACE)


def published() -> DoorSettings | None:
    """The settings an app published, or None (none yet, or no Ray here)."""
    try:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
    except Exception:  # noqa: BLE001 - no Ray connection (unit tests)
        return None
    return DoorSettings(**json.loads(raw)) if raw else None


def middlewares() -> list[Middleware]:
    """Serve's proxy callback: the door as Starlette middleware, on the default settings until an
    app publishes its own. Serve calls it in its Python proxy, and in an ingress replica that
    serves HTTP itself (direct ingress)."""
    where = runs_in()
    if where == "proxy":  # an ingress replica sets its own priority
        serve_at_full_priority(logger, "the HTTP proxy")
        freeze_startup_objects(logger, "the HTTP proxy")
    settings = ProxyDoorConfig().settings(None)
    limit = StreamLimit(settings.max_requests, target_s=settings.lag_target_s,
                        min_limit=settings.min_requests, clock=time.perf_counter)
    limit.on_step = limit_observer(limit, "proxy", logger)
    pending = Pending(settings.wait_target_s, time.monotonic, log=logger)
    door = Door(pending, limit, published, time.monotonic, where)
    door.apply(settings)
    _doors.add(door)
    # Serve wraps the proxy's app in this list's order: the last one sees a request first. The
    # in-flight limit outside, so the waits only see 429s that came from the ingress.
    return [Middleware(PendingMiddleware, pending=pending, count=_refusal_counter(), door=door),
            Middleware(StreamLimitMiddleware, limit=limit, where="proxy" if where == "proxy" else "door")]


_doors: weakref.WeakSet[Door] = weakref.WeakSet()  # the doors `middlewares` made in this process


def doors_here() -> list[Door]:
    """The doors serving HTTP in this process (an engine replica's own server's, in HAProxy mode)."""
    return list(_doors)


class Door:
    """The door's settings, applied to its two parts and read again every REFRESH_S (off the
    event loop: the read is a call to Ray's KV store). Its refusals go to the controller as
    refused demand with those reads, unless something in its process carries them (`carried`:
    an engine replica's load reports, `ReplicaIngress`), which asks `demand_due`."""

    def __init__(self, pending: Pending, limit: StreamLimit, read: Callable[[], DoorSettings | None],
                 clock: Callable[[], float], where: str = "proxy") -> None:
        self.pending, self.limit, self._read, self._clock = pending, limit, read, clock
        self.where = where  # the process it runs in (`runs_in`), shown with its settings
        self.settings: DoorSettings | None = None
        self.summary = b"{}"  # the settings in force, as JSON (PASSED_HEADER)
        self._read_at = float("-inf")
        self._reading: asyncio.Task[None] | None = None
        self.demand = DemandCounter()  # its refusals are unsized: no body was read
        self.source = f"door:{socket.gethostname()}:{os.getpid()}"
        self.carried = False  # its demand rides with this process's load reports (`demand_due`)

    def apply(self, settings: DoorSettings) -> None:
        if settings == self.settings:
            return
        self.settings = settings
        self.summary = json.dumps({**dataclasses.asdict(settings), "runs_in": self.where},
                                  separators=(",", ":")).encode()
        self.limit.configure(settings.enabled, settings.lag_target_s, settings.max_requests,
                             settings.min_requests)
        self.pending.configure(settings)
        logger.info("proxy door %s: at most %d generation requests in flight, the limit adapting to "
                    "keep the proxy's event-loop lag under %.0f ms; closed while the median wait for "
                    "a first token is over %.0f ms, the way to the ingress takes over %s, or over %.0f%% "
                    "of stream gaps are over %s",
                    "on" if settings.enabled else "off", settings.max_requests,
                    1000 * settings.lag_target_s, 1000 * settings.wait_target_s,
                    "(off)" if settings.hop_target_s is None else f"{1000 * settings.hop_target_s:.0f} ms",
                    100 * settings.slow_share,
                    "(off)" if settings.gap_target_s is None else f"{1000 * settings.gap_target_s:.0f} ms")

    def refresh(self) -> None:
        """Start a read of the published settings when the last is REFRESH_S old."""
        now = self._clock()
        if now - self._read_at < REFRESH_S or (self._reading is not None and not self._reading.done()):
            return
        self._read_at = now
        self._reading = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        settings = await asyncio.to_thread(self._read)
        if settings is not None:
            self.apply(settings)
        if self.carried:
            return
        counts = self._counts_due(self._clock())
        if counts is not None and self.settings is not None and self.settings.controller_name:
            await asyncio.to_thread(self._report, self.settings, counts)

    def _counts_due(self, now: float) -> DemandCounts | None:
        return self.demand.to_send(now, unsized=self.pending.num_refused_demand + self.limit.num_refused_demand)

    def demand_due(self, now: float) -> Demand | None:
        """Its refusals as a demand report when one is due (for whoever carries them), once it
        knows the deployment they are for (the app's published settings)."""
        if self.settings is None or not self.settings.deployment:
            return None
        counts = self._counts_due(now)
        return None if counts is None else (self.settings.deployment, self.source, counts)

    def _report(self, settings: DoorSettings, counts: DemandCounts) -> None:
        """The door's refusals to the controller, as refused demand (sent, not waited for)."""
        from autoscale.controller import get_or_create_controller

        try:
            controller = get_or_create_controller(settings.controller_name, settings.controller_namespace)
            controller.report_demand.remote(settings.deployment, self.source, counts)
        except Exception as exc:  # noqa: BLE001 - the controller may be restarting: next time
            logger.debug("proxy door: demand report failed: %r", exc)


def _refusal_counter() -> Callable[[str], None] | None:
    """`stallfree_proxy_refusals_total{reason}` when Ray is here (the proxy), else None."""
    try:
        from replicas.serving.metric_backends import RayBackend
        from replicas.serving.metrics import PREFIX
        counter = RayBackend().counter(PREFIX + "proxy_refusals_total", "Generation requests the proxy "
                                       "answered 429 itself, by why (app/proxy_door.py).", ("reason",))
    except Exception:  # noqa: BLE001 - no Ray (unit tests)
        return None
    return lambda reason: counter.record(1, {"reason": reason})


def proxy_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a Ray node started for this app gets: `env` with the door's callback set
    and Ray's workers at `SERVING_NICENESS` (each unless the caller set their own; HAProxy mode
    only where the caller sets `HA_PROXY_ENV`, as serve_config.yaml leaves it off)."""
    return {CALLBACK_ENV: IMPORT_PATH, NICENESS_ENV: str(SERVING_NICENESS), **env}


CAP_DECREASE = 0.9  # the stream cap's cut: this x the requests in flight when the gaps turned slow
CAP_COOLDOWN_S = 2.0  # at most one cut this often (the gap window must show what the last did)
CAP_GROW_EVERY_S = 1.0  # at most one growth step this often (about the time an admitted request
# takes to show in the gaps: its first token under load)
CAP_GROW_BINDING = 0.05  # while the gaps are quick and the cap binds: + this share of it (at least 1)
# The window of requests forwarded and not yet answered (no response start), learned as TCP's
# congestion window: a 429 from downstream cuts it to this x those waiting (at most once a
# WINDOW_COOLDOWN_S: the requests already on their way bring the same news), each answer that
# admits grows it by 1/window (one a window's worth of answers).
WINDOW_DECREASE = 0.5
WINDOW_COOLDOWN_S = 0.5


class Pending:
    """Generation requests the proxy forwarded that have no response yet (their first token,
    or a refusal: the ingress sends nothing before either), and whether they stand in a queue.

    The proxy sees every request's wait from outside, whatever it waits for: the Ray hops, an
    ingress starved of CPU, the token door, the engine's queue. Like CoDel, it tells a standing
    queue from one slow request: the door closes while at least `min_pending` requests wait and
    their median wait is over `target_s` (one long prompt prefilling does not close it; many
    requests queueing do). A 429 from downstream closes it too, for `hold_s` (at most its
    Retry-After): the server said no, so the next arrivals are answered here, not sent to hear it.
    And it cuts the window of requests forwarded and not yet answered (`window`, as TCP's
    congestion window: `WINDOW_DECREASE` x those on their way, at most once a `WINDOW_COOLDOWN_S`,
    never under `min_cap`; +1/window for each request admitted downstream, up to `max_cap`):
    without it the door reopened after each hold and let a round trip's worth of arrivals through
    to be refused late.
    So does the way to the ingress (`hop`): while the median time the last `hop_window_s`'s
    responses took there and back, the ingress's own part taken off, is over `hop_target_s`.

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
                 hop_target_s: float | None = None, hop_window_s: float = 1.0, min_hops: int = 4,
                 log: logging.Logger | None = None) -> None:
        self.enabled = True
        self.hop_target_s, self.hop_window_s, self.min_hops = hop_target_s, hop_window_s, min_hops
        self._hops: deque[tuple[float, float]] = deque()  # (when reported, seconds), last window
        self._hop_slow = False
        self.median_hop_s = 0.0
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
        self.num_refused_retries = 0  # of which the client said they were retries (counted before)
        self.max_cap, self.min_cap = max_cap, min_cap
        self.cap = float(max_cap)
        self.window = float(max_cap)  # forwarded and not answered, at most (`window_cut`, `admitted`)
        self._window_cut_at = float("-inf")
        self.in_flight = 0  # forwarded, not ended (`start` .. `ended`)
        self._cut_at = self._grown_at = float("-inf")
        self._log = log

    def configure(self, settings: DoorSettings) -> None:
        """Take new settings; what it learned (the stream cap) is kept within the new bounds."""
        self.enabled, self.target_s = settings.enabled, settings.wait_target_s
        self.hop_target_s = settings.hop_target_s
        self.gap_target_s, self.slow_share = settings.gap_target_s, settings.slow_share
        self.min_gaps = max(20, round(2 / settings.slow_share))
        self.max_cap, self.min_cap = settings.max_requests, settings.min_requests
        self.cap = min(float(self.max_cap), max(float(self.min_cap), self.cap))
        self.window = min(float(self.max_cap), max(float(self.min_cap), self.window))

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

    @property
    def unanswered(self) -> int:
        """Forwarded requests with no response start yet (no first token, no refusal)."""
        return len(self._started)

    def now(self) -> float:
        return self._clock()

    def gap(self, seconds: float) -> None:
        """A stream's chunk came `seconds` after its previous one."""
        if self.gap_target_s is None:
            return
        slow = seconds > self.gap_target_s
        self._gaps.append((self._clock(), slow))
        self._num_slow += slow

    def hop(self, seconds: float) -> None:
        """A forwarded request took `seconds` to reach the ingress and come back (its response's
        start, less the ingress's own time before it: `middleware.INGRESS_MS_HEADER`)."""
        if self.hop_target_s is not None:
            self._hops.append((self._clock(), seconds))

    def slow_hop(self, now: float) -> bool:
        """The median of the last window's hops (at least `min_hops` of them) is over the target:
        a standing queue on the way to the ingress, not one slow call."""
        hops = self._hops
        while hops and now - hops[0][0] > self.hop_window_s:
            hops.popleft()
        if self.hop_target_s is None or len(hops) < self.min_hops:
            self.median_hop_s = 0.0
            return False
        self.median_hop_s = sorted(h for _, h in hops)[len(hops) // 2]
        return self.median_hop_s > self.hop_target_s

    def slow_streams(self, now: float) -> bool:
        """Over `slow_share` of the last window's chunk gaps (at least `min_gaps` of them) were
        over the gap target."""
        gaps = self._gaps
        while gaps and now - gaps[0][0] > self.gap_window_s:
            self._num_slow -= gaps.popleft()[1]
        return len(gaps) >= self.min_gaps and self._num_slow > self.slow_share * len(gaps)

    def saw_429(self, retry_after: int) -> None:
        now = self._clock()
        self.retry_after = max(1, retry_after)
        self.held_until = max(self.held_until, now + min(self.hold_s, self.retry_after))
        if now - self._window_cut_at >= WINDOW_COOLDOWN_S:  # those still on their way were sent too many
            self.window = max(float(self.min_cap), WINDOW_DECREASE * self.unanswered)
            self._window_cut_at = now

    def admitted(self) -> None:
        """A forwarded request was answered with its first token (not refused): the window grows."""
        if self.window < self.max_cap:
            self.window = min(float(self.max_cap), self.window + 1 / max(self.window, 1.0))

    @property
    def num_refused_demand(self) -> int:
        """Refusals that are new demand (`autoscale.demand`): all but the marked retries."""
        return self.num_refused - self.num_refused_retries

    def admits(self) -> bool:
        if not self.enabled:
            return True
        now = self._clock()
        if now < self.held_until:
            self.reason = "refused downstream"
            return False
        if self.unanswered >= self.window:
            self.reason = "unanswered window"
            self.retry_after = 1
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
            self._hop_slow = self.slow_hop(now)
            if self._hop_slow and not self._queueing:
                self.retry_after = max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.median_hop_s)))
            self._slow = self.slow_streams(now)
            if self._slow and not (self._queueing or self._hop_slow):
                self.retry_after = 1
            self._adapt_cap(now)
        if self._queueing:
            self.reason = "queueing"
        elif self._hop_slow:
            self.reason = "slow hop"
        elif self._slow:
            self.reason = "slow streams"
        elif self.in_flight >= self.cap:
            self.reason = "stream cap"
            self.retry_after = 1
            return False
        return not (self._queueing or self._hop_slow or self._slow)

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

    def __init__(self, app: ASGIApp, pending: Pending, count: Callable[[str], None] | None = None,
                 door: Door | None = None) -> None:
        self.app, self.pending, self.count = app, pending, count  # count(reason): each refusal
        self.door = door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.door is not None:
            self.door.refresh()
        # The ingress learns from this header that requests pass a door, and its settings (its
        # /health shows them).
        if self.door is not None:
            scope = {**scope, "headers": [*scope.get("headers", ()), (PASSED_HEADER, self.door.summary)]}
        if not scope.get("path", "").endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        pending = self.pending
        if not pending.admits():
            pending.num_refused += 1
            pending.num_refused_retries += is_client_retry(scope)
            retry = pending.retry_after
            if pending.reason == "queueing":
                why = (f"the requests before this one wait {pending.median_wait_s:.1f} s for their "
                       f"first token (the proxy's target {pending.target_s:.1f} s)")
            elif pending.reason == "slow hop":
                why = (f"the requests it forwarded lately took {pending.median_hop_s:.1f} s to reach the "
                       f"ingress (the proxy's target {pending.hop_target_s:.1f} s)")
            elif pending.reason == "slow streams":
                why = (f"the streams it serves already arrive slowly (more than {pending.slow_share:.0%} "
                       f"of their gaps over {1000 * pending.gap_target_s:.0f} ms)")
            elif pending.reason == "stream cap":
                why = (f"it relays {pending.in_flight} requests, as many as it found keep their streams' "
                       f"gaps under {1000 * (pending.gap_target_s or 0):.0f} ms")
            elif pending.reason == "unanswered window":
                why = (f"{pending.unanswered} requests it forwarded wait for their first token or refusal, "
                       f"as many as the server has lately taken without refusing")
            else:
                why = "it refused a request moments ago"
            if self.count is not None:
                self.count(pending.reason)
            await refuse(send, OpenAIError(429, f"the server is at capacity: {why}; retry after {retry} s",
                                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)}))
            return
        key = pending.start()
        forwarded = pending.now()

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
                headers = message.get("headers", ())
                ingress_ms = next((v for k, v in headers if k == INGRESS_MS_HEADER), None)
                if ingress_ms is not None and ingress_ms.isdigit():  # the way there and back
                    pending.hop(pending.now() - forwarded - int(ingress_ms) / 1000)
                if message["status"] == 429:
                    retry = next((v for k, v in headers if k.lower() == b"retry-after"), b"1")
                    pending.saw_429(int(retry) if retry.isdigit() else 1)
                elif message["status"] < 300:
                    pending.admitted()
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            pending.answered(key)
            pending.ended()
