"""The replica side of load reporting: throttled, fire-and-forget pushes to the controller.

A `LoadReporter` lives inside a replica (it is not an actor). Feed it the replica's latest
`ReplicaLoad` as often as you like, e.g. after every iteration or from a 20 ms poll; it sends at
most every `interval_s` (~100 ms) or the longer period the controller's last reply asked for (a
large fleet), sooner (but not within `min_interval_s`) when the token load jumps, and an
unchanged load (an idle replica: no pass, no new TBT gap, the same tokens and requests) only
every `heartbeat_s`. Between sends it bins the TBT gaps that are new since the last call (from the
engine's (count, latest gaps) pair) into one `LogHistogram`, so the controller's window sees
(nearly) every gap whatever the period, in a report of fixed size. Sending never raises and never
blocks on the controller: a dead or missing controller is looked up again later, and routing
falls back to its local view meanwhile. With `relay` (the default) reports go to the node's
`autoscale.relay.NodeRelay`, which forwards the node's reports to the controller in one call every
100 ms, so the controller's intake grows with the nodes, not the replicas.

The app builder hands the replica a factory for it (`replicas.serving.deployment.LoadSink`); the replica
calls `start(load, iterations, tbt)`, `autoscaling_stats()` and `stop()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE, get_or_create_controller
from autoscale.datagrams import DatagramSender
from autoscale.demand import Demand
from autoscale.keys import current_replica_key
from autoscale.load import ReportThrottle, TbtWindow
from autoscale.relay import get_or_create_relay
from autoscale.scaling import DEFAULT_WINDOW_S
from replicas.scheduling.histogram import LogHistogram
from replicas.protocol import ReplicaLoad

logger = logging.getLogger(__name__)

LOOKUP_RETRY_S = 2.0


def new_tbt_samples(seen: int, total: int, tail: Sequence[float]) -> list[float]:
    """Samples of `tail` (the engine's latest TBT samples) taken after the first `seen`.

    `total` counts every sample the engine ever took, so the last `total - seen` of the tail
    are new; if more than the tail arrived in between, the older ones are lost.
    """
    fresh = max(0, total - seen)
    return list(tail[len(tail) - min(fresh, len(tail)):])


class LoadReporter:
    """Throttled load reports from one replica to the controller."""

    def __init__(self, replica_id: str | None = None, *, controller: Any = None,
                 controller_name: str = DEFAULT_CONTROLLER_NAME, namespace: str = DEFAULT_NAMESPACE,
                 interval_s: float = 0.1, min_interval_s: float = 0.02, change_tokens: int = 256,
                 change_fraction: float = 0.25, heartbeat_s: float = 1.0, tbt_window_s: float = DEFAULT_WINDOW_S,
                 relay: bool = True, clock: Callable[[], float] = time.time,
                 send: Callable[[str, ReplicaLoad], float | None] | None = None) -> None:
        """`send(replica_id, load)` replaces the controller (tests, a relay); like the
        controller's `report` it may return the report period the fleet asks for."""
        self._replica_id = replica_id
        self._controller = controller  # the controller's handle, or the node relay's with `relay`
        self.controller_name, self.namespace = controller_name, namespace
        self.relay = relay
        self.throttle = ReportThrottle(interval_s, min_interval_s, change_tokens, change_fraction, heartbeat_s)
        self._clock = clock
        self._send_fn = send
        self._window = TbtWindow(tbt_window_s)  # local TBT window for record_autoscaling_stats
        self._seen_tbt = 0  # engine TBT samples already taken in
        self._pending_tbt = LogHistogram()  # gaps since the last report
        self.fleet_interval_s = 0.0  # the report period the controller last asked for
        self._last_shape: tuple[int, ...] = ()
        self._last_iter_start = float("-inf")
        self._iter_durations: list[float] = []
        self._last_sent = float("-inf")
        self._last_tokens = 0
        self._last_load: ReplicaLoad | None = None
        self._last_future: Any = None
        self._lookup_after = 0.0
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._context_after = 0.0  # when to look for Serve's replica context again
        self._poll_failing = False
        self.num_sent = 0
        self.num_failed = 0
        self.num_datagrams = 0  # of num_sent, those that went to the node relay's socket
        self._datagrams: DatagramSender | None = None  # the node relay's socket, from its reply
        self._called_at = float("-inf")  # the last report by actor call (its timestamp)
        # `demand(now)`: the demand counters due to ride with the report going now (an engine
        # replica serving HTTP itself: its ingress's and its door's, `DemandCounter.to_send`).
        self.demand: Callable[[float], Sequence[Demand]] | None = None

    @property
    def replica_id(self) -> str | None:
        """Given, or Serve's key for the replica we run in; None outside a replica (then the
        reporter stays idle: an engine built in a plain test must not start reporting). The
        context is looked up again every LOOKUP_RETRY_S, so one failed lookup is not final."""
        if self._replica_id is None and self._clock() >= self._context_after:
            try:
                self._replica_id = current_replica_key()
            except Exception as exc:
                if self._context_after == 0.0:
                    logger.info("no Serve replica context (%r): load reports wait for one", exc)
                self._context_after = self._clock() + LOOKUP_RETRY_S
        return self._replica_id

    # ---- feeding --------------------------------------------------------------------------

    def maybe_report(self, load: ReplicaLoad, now: float | None = None,
                     iterations: Sequence[Any] | None = None,
                     tbt: tuple[int, Sequence[float]] = (0, ())) -> bool:
        """Take the latest load; send a report if one is due. True when one was sent.

        `tbt` is (TBT samples the engine ever took, its latest samples, oldest first).
        """
        replica_id = self.replica_id
        if replica_id is None:
            return False
        now = self._clock() if now is None else now
        total, tail = tbt
        fresh = new_tbt_samples(self._seen_tbt, total, tail)
        self._seen_tbt = total
        if fresh:
            gaps = LogHistogram.of(fresh)
            self._pending_tbt.merge(gaps)
            self._window.add(gaps, now)
        if iterations is not None:
            self._collect_iterations(iterations)

        tokens = load.token_load
        shape = (load.running_tokens, load.waiting_tokens, load.num_running, load.num_waiting, load.free_blocks)
        changed = bool(self._pending_tbt) or bool(self._iter_durations) or shape != self._last_shape
        self._read_reply()
        if not self.throttle.due(now - self._last_sent, tokens - self._last_tokens, self._last_tokens,
                                 changed, self.fleet_interval_s):
            return False

        durations, self._iter_durations = self._iter_durations, []
        entry = dataclasses.replace(
            load, replica_id=replica_id, tbt_histogram=self._pending_tbt or None,
            iterations=len(durations), iteration_mean_s=sum(durations) / len(durations) if durations else 0.0,
            iteration_max_s=max(durations, default=0.0), timestamp=now)
        self._pending_tbt = LogHistogram()
        self._last_sent, self._last_tokens, self._last_load, self._last_shape = now, tokens, entry, shape
        self._send(replica_id, entry, tuple(self.demand(now)) if self.demand is not None else ())
        return True

    def _collect_iterations(self, iterations: Sequence[Any]) -> None:
        """Durations of iterations newer than the last seen, read from the deque's tail.

        The engine thread may append meanwhile; reading by negative index and keying on start
        time tolerates that (a shifted index re-reads an entry, which the start check skips).
        """
        seen: dict[float, float] = {}
        for k in range(1, min(len(iterations), 1024) + 1):
            try:
                it = iterations[-k]
            except IndexError:
                break
            if it.start <= self._last_iter_start:
                break
            seen[it.start] = it.duration
        if seen:
            self._last_iter_start = max(seen)
            self._iter_durations.extend(seen[s] for s in sorted(seen))

    # ---- sending --------------------------------------------------------------------------

    def _send(self, replica_id: str, payload: ReplicaLoad, demand: tuple[Demand, ...] = ()) -> None:
        """One report, with the demand counters riding on it when there are any (a lost report
        loses no demand: the counters only grow, and the next report that carries them counts)."""
        message = (replica_id, payload, demand) if demand else (replica_id, payload)
        try:
            if self._send_fn is not None:
                self._take_interval(self._send_fn(*message))
            elif not self._by_datagram(message):
                handle = self._handle()
                if handle is None:
                    return
                self._last_future = handle.report.remote(*message).future()
                self._called_at = payload.timestamp
            self.num_sent += 1
        except Exception as exc:  # reporting must never hurt serving
            self.num_failed += 1
            self._controller = None
            self._lookup_after = self._clock() + LOOKUP_RETRY_S
            logger.debug("load report failed: %r", exc)

    def _by_datagram(self, message: tuple) -> bool:
        """`message` (replica_id, load[, demands]) sent to the node relay's socket: while one is
        known and a call went out within a heartbeat (a call's reply brings the controller's
        period and a restarted relay's socket). A datagram that cannot go drops the socket: this
        report goes by call."""
        sender = self._datagrams
        if sender is None or message[1].timestamp - self._called_at >= self.throttle.heartbeat_s:
            return False
        if sender.send(message):
            self.num_datagrams += 1
            return True
        sender.close()
        self._datagrams = None
        return False

    def _read_reply(self) -> None:
        """The report period from the controller's reply to the last report, once it is in."""
        last = self._last_future
        if last is not None and last.done() and last.exception() is None:
            self._take_interval(last.result())

    def _take_interval(self, reply: Any) -> None:
        """A report's reply: the controller's report period, or a node relay's (period, its
        datagram socket or None)."""
        if isinstance(reply, tuple) and len(reply) == 2:
            reply, path = reply
            if self._datagrams is not None and self._datagrams.path != path:
                self._datagrams.close()
                self._datagrams = None
            if isinstance(path, str) and self._datagrams is None:
                self._datagrams = DatagramSender(path)
        if isinstance(reply, (int, float)) and reply >= 0:
            self.fleet_interval_s = float(reply)

    def _handle(self) -> Any:
        """The controller's (or the node relay's) handle; re-looked-up after a report failed."""
        last = self._last_future
        if last is not None and last.done() and last.exception() is not None:
            self.num_failed += 1
            self._controller, self._last_future = None, None
            self._lookup_after = self._clock() + LOOKUP_RETRY_S
        if self._controller is None and self._clock() >= self._lookup_after:
            if not ray.is_initialized():  # never start Ray from a report
                return None
            try:
                find = get_or_create_relay if self.relay else get_or_create_controller
                self._controller = find(self.controller_name, self.namespace)
            except Exception as exc:
                self._lookup_after = self._clock() + LOOKUP_RETRY_S
                logger.debug("controller lookup failed: %r", exc)
        return self._controller

    # ---- what the replica exposes ------------------------------------------------------------

    def autoscaling_stats(self, now: float | None = None) -> dict[str, float]:
        """Metrics for Serve's `record_autoscaling_stats` (the policy's fallback input)."""
        now = self._clock() if now is None else now
        gaps = self._window.histogram(now)
        p50, p99 = gaps.quantiles((50, 99))
        load = self._last_load
        return {
            "tbt_p50_s": p50 or 0.0,
            "tbt_p99_s": p99 or 0.0,
            "num_tbt_samples": float(gaps.count),
            "running_tokens": float(load.running_tokens if load else 0),
            "waiting_tokens": float(load.waiting_tokens if load else 0),
        }

    # ---- polling ----------------------------------------------------------------------------

    def start(self, get_load: Callable[[], ReplicaLoad],
              get_iterations: Callable[[], Sequence[Any]] | None = None,
              get_tbt: Callable[[], tuple[int, Sequence[float]]] | None = None,
              poll_s: float = 0.02) -> None:
        """Poll every `poll_s`: an asyncio task on the running loop, else a thread."""
        def poll() -> None:
            self.maybe_report(get_load(), iterations=get_iterations() if get_iterations else None,
                              tbt=get_tbt() if get_tbt else (0, ()))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._task = loop.create_task(self.run(poll, poll_s))
        else:
            self._thread = threading.Thread(target=self._run_thread, args=(poll, poll_s),
                                            name="load-reporter", daemon=True)
            self._thread.start()

    async def run(self, poll: Callable[[], None], poll_s: float = 0.02) -> None:
        """The polling loop as a coroutine (until `stop`)."""
        while not self._stop.is_set():
            self._poll_once(poll)
            await asyncio.sleep(poll_s)

    def _run_thread(self, poll: Callable[[], None], poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self._poll_once(poll)

    def _poll_once(self, poll: Callable[[], None]) -> None:
        """One poll; a failure is logged once (with its cause) until polls succeed again."""
        try:
            poll()
        except Exception:  # a bad poll must not end reporting
            if not self._poll_failing:
                logger.exception("load report poll failed; retrying every poll (logged once)")
            self._poll_failing = True
            return
        if self._poll_failing:
            logger.info("load report polls work again")
            self._poll_failing = False

    def stop(self, deregister: bool = True) -> None:
        """Stop polling and (by default) tell the controller this replica is gone."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if deregister and self._send_fn is None and self._controller is not None and self._replica_id:
            try:
                self._controller.remove.remote(self._replica_id)
            except Exception as exc:  # the controller drops silent replicas itself soon
                logger.debug("deregistering from the controller failed: %r", exc)
