"""Admission at the cluster's door: the ingress refuses what the replicas cannot start in time.

Before a request is queued anywhere (Serve's handle queue, a replica's inbox), the ingress asks
`await AdmissionGate.decide(prompt_tokens)`. The view is the controller's: every engine replica of
this application reports its waiting prompt tokens, the bound its queue admits and its measured
drain rate (`replicas.scheduling.admission`) about every 100 ms; the gate refreshes that snapshot in the
background and adds the prompts it admitted itself that no report shows yet. Over the summed
bound the answer is a 429 with a Retry-After computed from the summed drain rate, without
touching a replica: at once on a view younger than 0.5 s, else after one refresh (<= 0.1 s). With no fresh snapshot (controller gone, first
requests) the gate admits, and the replicas' own bounds (the same rule) are the backstop.

Plain asyncio and an injected clock; the snapshot source is a coroutine function, so the gate
is tested without Ray.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from autoscale.demand import DemandCounts
from replicas.protocol import ReplicaLoad
from replicas.scheduling.admission import Decision, QueueView, door_decision

logger = logging.getLogger(__name__)

Fetch = Callable[[], Awaitable[Mapping[str, ReplicaLoad]]]
LOG_EVERY_S = 5.0
SETTLED_KEEP_S = 5.0  # well past the oldest view `decide` uses (max_age_s) plus report age


class AdmissionGate:
    """The door's token view of the cluster; `decide` is O(replicas) and admits without waiting."""

    def __init__(self, fetch: Fetch | None, *, refresh_s: float = 0.05, max_age_s: float = 1.0,
                 refuse_age_s: float = 0.5, refresh_wait_s: float = 0.1,
                 reflect_grace_s: float = 0.05, ticket_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._fetch = fetch
        self.refresh_s, self.max_age_s = refresh_s, max_age_s
        self.refuse_age_s, self.refresh_wait_s = refuse_age_s, refresh_wait_s
        self.reflect_grace_s, self.ticket_ttl_s = reflect_grace_s, ticket_ttl_s
        self._clock = clock
        self._loads: Mapping[str, ReplicaLoad] = {}
        self._loads_at = float("-inf")  # gate clock when the snapshot arrived
        self._last_refresh = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._tickets: dict[int, _Ticket] = {}  # admitted, no first token yet
        # Left a replica's queue within SETTLED_KEEP_S (gate clock): only those can still be in a
        # report fresh enough to decide on.
        self._settled: deque[tuple[float, _Ticket]] = deque(maxlen=4096)
        # `_unreflected` over the snapshot `_base_loads`, kept up to date by every admission,
        # acknowledgement and settlement: a decision walks the tickets only when a new snapshot
        # arrives, not once per request (under overload, hundreds of tickets per request).
        self._base_loads: Mapping[str, ReplicaLoad] | None = None
        self._base = 0
        self._ids = itertools.count()
        self.num_refused = 0
        self.num_decided = 0
        self.num_failed_refreshes = 0
        self._logged_at, self._logged = clock(), (0, 0)  # the first line counts from the start

    # ---- deciding -------------------------------------------------------------------------

    async def decide(self, prompt_tokens: int) -> Decision:
        """Admit or refuse one prompt now (and start a snapshot refresh when one is due).

        Admitting never waits. A refusal is only made on a view younger than `refuse_age_s`:
        with an older one the gate first waits (at most `refresh_wait_s`) for a fresh one, so a
        queue that drained while no request came is not refused from memory.
        """
        decision = self._decide(prompt_tokens, self._clock())
        if decision.admitted or self._clock() - self._loads_at <= self.refuse_age_s:
            return self._count(decision)
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.refresh_wait_s)
            except Exception:  # timed out or failed: decide on what is there
                pass
        now = self._clock()
        if now - self._loads_at > self.refuse_age_s:  # still no fresh view: do not refuse on it
            return Decision(True, decision.queued_tokens, decision.bound_tokens)
        return self._count(self._decide(prompt_tokens, now))

    def _decide(self, prompt_tokens: int, now: float) -> Decision:
        self._maybe_refresh(now)
        loads = self._loads if now - self._loads_at <= self.max_age_s else {}
        queues = [QueueView(load.waiting_tokens, load.queue_bound_tokens, load.drain_tps)
                  for load in loads.values() if load.queue_bound_tokens is not None]
        return door_decision(prompt_tokens, queues, self._unreflected(loads, now) if queues else 0)

    def _count(self, decision: Decision) -> Decision:
        self.num_decided += 1
        if not decision.admitted:
            self.num_refused += 1
        now = self._clock()
        if now - self._logged_at >= LOG_EVERY_S or self._logged == (0, 0):
            decided, refused = self.num_decided - self._logged[0], self.num_refused - self._logged[1]
            view = (f"view {now - self._loads_at:.2f} s old" if self._loads
                    else "no load report yet: the replicas decide")
            logger.info("admission: %d decided, %d refused in the last %.0f s; now %d prompt tokens "
                        "queued of a bound of %d over %d replicas (%s)", decided, refused,
                        now - self._logged_at, decision.queued_tokens, decision.bound_tokens,
                        len(self._loads), view)
            self._logged_at, self._logged = now, (self.num_decided, self.num_refused)
        return decision

    def admit(self, prompt_tokens: int) -> int:
        """Count an admitted prompt until `settle(ticket)` (first token, refusal or failure)."""
        ticket = next(self._ids)
        self._tickets[ticket] = _Ticket(prompt_tokens, self._clock())
        self._base += prompt_tokens  # in no replica's queue yet: counted (`_waiting`)
        return ticket

    def acknowledged(self, ticket: int, replica_id: str | None, at: float) -> None:
        """Replica `replica_id` queued it at `at` (its own clock): its reports from then on count it."""
        entry = self._tickets.get(ticket)
        if entry is not None:
            self._base -= self._waiting(entry)
            entry.replica_id, entry.queued_at = replica_id, at
            self._base += self._waiting(entry)

    def requeued(self, ticket: int) -> None:
        """Sent again (its replica died): no replica holds it until the next acknowledgement."""
        entry = self._tickets.get(ticket)
        if entry is not None:
            self._base -= self._waiting(entry)
            entry.replica_id, entry.queued_at = None, None
            self._base += self._waiting(entry)

    def settle(self, ticket: int, left_at: float | None = None) -> None:
        """Its first token came (it left the queue at `left_at`, the replica's clock), or it ended."""
        entry = self._tickets.pop(ticket, None)
        if entry is None:
            return
        self._base -= self._waiting(entry)
        if entry.queued_at is not None and left_at is not None:
            entry.left_at = left_at
            self._settled.append((self._clock(), entry))
            self._base -= self._left(entry)

    def _unreflected(self, loads: Mapping[str, ReplicaLoad], now: float) -> int:
        """Our own admissions the reports do not show right, judged per replica on its own
        clock: prompts no replica has queued yet (Serve's handle queue, in transit) or queued
        after that replica's report was taken, minus those that left its queue after the report.
        Summed over every ticket when a new snapshot arrives, kept since by each change."""
        if loads is self._base_loads:
            return self._base
        self._base_loads = loads
        for ticket, entry in list(self._tickets.items()):
            if now - entry.admitted_at > self.ticket_ttl_s:  # never settled (a lost stream)
                del self._tickets[ticket]
        while self._settled and now - self._settled[0][0] > SETTLED_KEEP_S:
            self._settled.popleft()
        self._base = (sum(self._waiting(entry) for entry in self._tickets.values())
                      - sum(self._left(entry) for _, entry in self._settled))
        return self._base

    def _waiting(self, entry: _Ticket) -> int:
        """A ticket's tokens if the snapshot `_base_loads` does not show it waiting: no replica
        queued it yet, or its replica's report was taken before it was queued."""
        if entry.queued_at is None:
            return entry.tokens
        load = (self._base_loads or {}).get(entry.replica_id or "")
        return entry.tokens if load is not None and entry.queued_at >= load.timestamp - self.reflect_grace_s else 0

    def _left(self, entry: _Ticket) -> int:
        """A settled ticket's tokens if the snapshot still shows it waiting, though it started."""
        load = (self._base_loads or {}).get(entry.replica_id or "")
        return entry.tokens if load is not None and entry.queued_at < load.timestamp <= entry.left_at else 0

    # ---- the snapshot ---------------------------------------------------------------------

    def _maybe_refresh(self, now: float) -> None:
        if self._fetch is None or now - self._last_refresh < self.refresh_s:
            return
        if self._task is not None and not self._task.done():
            return
        self._last_refresh = now
        try:
            self._task = asyncio.get_running_loop().create_task(self._refresh())
        except RuntimeError:  # no running loop (a synchronous caller): keep the cached view
            self._task = None

    async def _refresh(self) -> None:
        assert self._fetch is not None
        try:
            self._loads = dict(await self._fetch())
            self._loads_at = self._clock()
        except Exception as exc:  # controller gone or slow: the replicas' own bounds decide
            self.num_failed_refreshes += 1
            if self.num_failed_refreshes == 1 or self.num_failed_refreshes % 100 == 0:
                logger.warning("admission: controller snapshot failed (%d times): %r",
                               self.num_failed_refreshes, exc)
            self._last_refresh = self._clock() + 1.0  # back off for about a second


@dataclass
class _Ticket:
    """One admitted prompt; replica times are that replica's wall clock (its reports' clock)."""

    tokens: int
    admitted_at: float  # the gate's clock
    replica_id: str | None = None
    queued_at: float | None = None
    left_at: float | None = None


def controller_fetch(controller_name: str, namespace: str, app_name: str | None,
                     deployment: str, timeout_s: float = 1.0,
                     demand: tuple[str, Callable[[float], DemandCounts | None]] | None = None) -> Fetch:
    """A `Fetch` reading the controller actor's snapshot, kept to this app's engine replicas.
    `demand`: (source, counts(now)): the caller's demand counters ride along when they are due
    (`autoscale.demand`), sent without waiting for an answer."""
    from autoscale.controller import get_or_create_controller, load_view
    from autoscale.keys import deployment_key_of

    handle: list[Any] = []
    send_demand = (None if demand is None else
                   controller_demand(controller_name, namespace, app_name, deployment, *demand, handle=handle))

    async def fetch() -> Mapping[str, ReplicaLoad]:
        if not handle:
            handle.append(get_or_create_controller(controller_name, namespace))
        if send_demand is not None:
            send_demand(time.time())
        try:
            ref = handle[0].routing_view.remote(None if app_name is None else deployment_key_of(app_name, deployment))
            snap = load_view(await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s))
        except Exception:
            handle.clear()  # look it up again next time (it may have restarted)
            raise
        if app_name is not None:  # the view holds that deployment's replicas only
            return snap.replicas
        return {key: load for key, load in snap.replicas.items() if _is_replica_of(key, app_name, deployment)}

    return fetch


def controller_demand(controller_name: str, namespace: str, app_name: str | None, deployment: str,
                      source: str, counts: Callable[[float], DemandCounts | None],
                      handle: list[Any] | None = None) -> Callable[[float], bool]:
    """`send(now)`: `counts(now)` to the controller's demand log for this app's engine replicas
    when they are due (`DemandCounter.to_send`), without waiting for an answer; True when sent.
    `handle`: a list holding the controller's handle to share (looked up on first use, dropped
    when a send fails, so a restarted controller is found again)."""
    from autoscale.controller import get_or_create_controller
    from autoscale.keys import deployment_key_of

    held: list[Any] = [] if handle is None else handle
    key = deployment_key_of(app_name, deployment)

    def send(now: float) -> bool:
        due = counts(now)
        if due is None:
            return False
        if not held:
            held.append(get_or_create_controller(controller_name, namespace))
        try:
            held[0].report_demand.remote(key, source, due)
        except Exception:
            held.clear()
            raise
        return True

    return send


def _is_replica_of(key: str, app_name: str | None, deployment: str) -> bool:
    from ray.serve._private.common import ReplicaID

    try:
        replica = ReplicaID.from_full_id_str(key)
    except Exception:
        return False
    dep = replica.deployment_id
    return dep.name == deployment and (app_name is None or dep.app_name == app_name)
