"""`TokenLoadRouter`: a Ray Serve 2.60 request router that balances predicted token load.

Each request goes to the replica with the lowest predicted token load after adding it: the
load replicas last reported to the controller (fresh, ~100 ms old, not Serve's 10 s routing
stats) plus what this router sent them that no report shows yet (`InFlightBook`), never to a
replica whose KV cache cannot hold it while another can. The ranking is `routing.choose_replica`
over a random sample of `sample_size` candidates (power of d choices), so a decision costs the
same at 4 replicas as at 1,000; a fleet no larger than the sample is ranked whole.

Serve calls `choose_replicas` from its routing tasks; we return the sample one replica per rank,
so Serve probes them in our order and takes the first that accepts (a full `max_ongoing_requests`
queue rejects; when all of them do, Serve backs off and asks again, and we draw a new sample). The controller snapshot is refreshed in the background at most every
`refresh_interval_s` while requests arrive. After a quiet spell the cached one is stale (older
than `stale_after_s`), so the first request waits for the refresh already under way, at most
`stale_wait_s`; a burst that follows then ranks on fresh loads plus the ledger. An unreachable
controller only means the router ranks by its own in-flight ledger (local view); a request
never fails for it.

Why no `FIFOMixin`: with it, a routing task may hand the replica it chose for one request to
another pending request (FIFO order), so the choice made for a 4k-token prompt could serve a
10-token one. The base class matches the chosen replica to the exact request it was chosen for.

Configure it per deployment (see `serve_options.request_router_config`); every other keyword
is a field of `RouterTuning` (autoscale/router_tuning.py), where the defaults live:

    RequestRouterConfig(request_router_class="autoscale.router.TokenLoadRouter",
                        request_router_kwargs={"controller_name": ..., "namespace": ...,
                                               "ranking": "prefix", "sample_size": 16})

Handle calls are expected as `generate(prompt_token_ids, params, ...)` (see
`routing.request_cost` for the accepted shapes); other methods cost nothing. An HTTP request from
Serve's proxy to replicas that serve HTTP themselves (`ingress_in_replica`) arrives with its body
unread: it is booked at the replicas' mean tokens per running request (`unread_request_tokens`
while none runs), so a burst between two load reports spreads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE, get_or_create_controller, load_view
from autoscale.inflight import InFlightBook
from autoscale.keys import deployment_key, replica_key
from autoscale.prefix_hints import PrefixHints
from autoscale.router_tuning import RouterTuning
from replicas.protocol import ReplicaLoad
from autoscale.routing import (RequestCost, choose_by_prefix, choose_by_ttft, choose_replica,
                               prompt_block_hashes, prompt_of, request_cost, sketch_block_size)

NO_LOADS: Mapping[str, ReplicaLoad] = MappingProxyType({})  # the local view: one object, so its ledger view is kept
RANKINGS = {"token_load": choose_replica, "ttft": choose_by_ttft, "prefix": choose_by_prefix}

logger = logging.getLogger(__name__)


class TokenLoadRouter(RequestRouter):
    """Least predicted token load with KV headroom; falls back to its own ledger."""

    def initialize_state(self, controller_name: str = DEFAULT_CONTROLLER_NAME,
                         namespace: str = DEFAULT_NAMESPACE, **tuning: Any) -> None:
        """Serve passes `RequestRouterConfig.request_router_kwargs` here: the controller's
        address and the fields of `RouterTuning` (validated there; an unknown one is an error)."""
        self.tuning = t = RouterTuning.from_kwargs(tuning)
        self._rank = RANKINGS[t.ranking]
        self._by_prefix = t.ranking == "prefix"
        self._hints = PrefixHints(t.prefix_hints)
        self._controller_name, self._namespace = controller_name, namespace
        self._rng = random.Random(t.seed)
        self._book = InFlightBook(reflect_grace_s=t.reflect_grace_s)
        self._keys: dict[ReplicaID, str] = {}
        # Serve passes the same candidate list object until its replica set changes: its keys
        # are worked out once per change, not per request.
        self._candidates: list[RunningReplica] | None = None
        self._candidate_keys: list[str] = []
        self._deployment: str | None = None  # the candidates' deployment_key (None: several, or none seen)
        self._by_key: dict[str, RunningReplica] = {}
        self._odd_call_logged = False
        self._controller: Any = None
        self._loads: dict[str, ReplicaLoad] = {}  # replaced, never changed, by each snapshot
        self._unread: tuple[object, RequestCost] = (None, RequestCost(0, 0))  # (of which loads, cost)
        # The ledger's unreflected tokens against `_view_loads`, kept current by the book.
        self._view_loads: Mapping[str, ReplicaLoad] | None = None
        self._in_flight: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._block_size: int | None = None  # of the replicas' prefix sketches in `_view_loads`
        self._loads_at = float("-inf")  # router clock when the cached snapshot arrived
        self._last_refresh = float("-inf")
        self._refresh_task: asyncio.Task[None] | None = None
        self.num_local_view = 0  # routings done without a fresh snapshot (for tests and metrics)

    # ---- Serve hooks --------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Rank a sample of the candidates by predicted token load (or TTFT) after adding this
        request; the few best, one per rank."""
        if pending_request is not None:
            # Back off between full rounds when every replica rejects (queues full); without
            # this flag Serve's routing loop would spin on choose_replicas.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        keys, by_key = self._candidate_index(candidate_replicas)
        await self._refresh_if_stale(time.time())
        now = time.time()
        cost = self._cost(pending_request)
        loads = self._fresh_loads(now)
        if loads is not self._view_loads:  # a new snapshot (or none): the ledger's view of it
            self._in_flight = self._book.view(loads)
            self._view_loads = loads
            self._block_size = sketch_block_size(loads) if self._by_prefix else None
        in_flight, in_flight_kv = self._in_flight
        extra: dict[str, Any] = {}
        hashes: list[int] = []
        if self._by_prefix and pending_request is not None:
            hashes = prompt_block_hashes(prompt_of(pending_request.args, pending_request.kwargs), self._block_size)
            hint = self._hints.lookup(hashes) if hashes else None
            extra = {"prompt_hashes": hashes, "max_imbalance": self.tuning.prefix_imbalance,
                     "affinity": [hint] if hint in by_key else []}
        ranked = self._rank(cost.tokens, cost.kv_tokens, loads, in_flight, candidates=keys,
                            in_flight_kv=in_flight_kv, rng=self._rng, sample_size=self.tuning.sample_size,
                            **extra)
        if hashes:
            self._hints.record(hashes, ranked[0])
        if pending_request is not None and cost.tokens:
            self._book.tentative(pending_request.metadata.internal_request_id, ranked[0], cost, now)
        return [[by_key[k]] for k in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Serve sent the request: count it on the replica that accepted it."""
        cost = self._cost(pending_request)
        if cost.tokens:
            self._book.routed(pending_request.metadata.internal_request_id, self._key(replica_id),
                              time.time(), cost)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The response finished (a stream's end, an error or a cancel)."""
        self._book.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._book.forget_replica(self._key(replica_id))

    # ---- helpers --------------------------------------------------------------------------------

    def _candidate_index(self, candidates: list[RunningReplica]) -> tuple[list[str], dict[str, RunningReplica]]:
        """The candidates' keys and key -> replica, rebuilt only when Serve's list changes."""
        if candidates is not self._candidates or len(candidates) != len(self._candidate_keys):
            self._by_key = {self._key(r.replica_id): r for r in candidates}
            self._candidate_keys = list(self._by_key)
            self._candidates = candidates
            deployments = {deployment_key(k) for k in self._candidate_keys}  # whose loads to fetch
            self._deployment = deployments.pop() if len(deployments) == 1 else None  # None: everyone's
        return self._candidate_keys, self._by_key

    def _key(self, replica_id: ReplicaID) -> str:
        key = self._keys.get(replica_id)
        if key is None:
            key = self._keys[replica_id] = replica_key(replica_id)
        return key

    def _cost(self, pending_request: PendingRequest | None) -> RequestCost:
        if pending_request is None:
            return RequestCost(0, 0)
        args = pending_request.args
        if args and isinstance(args[0], (bytes, bytearray)):  # Serve's proxy: an HTTP request, body unread
            return self._unread_cost()
        try:
            return request_cost(pending_request.args, pending_request.kwargs, self.tuning.default_max_tokens)
        except Exception as exc:  # an odd call shape must not break routing: rank it as free
            if not self._odd_call_logged:
                logger.warning("cannot read a request's token cost (%r); routing it as cost 0 "
                               "(logged once)", exc)
                self._odd_call_logged = True
            return RequestCost(0, 0)

    def _unread_cost(self) -> RequestCost:
        """An HTTP request whose body nobody has read (`ingress_in_replica`): the replicas' mean
        tokens per running request in the last snapshot, or `unread_request_tokens` without one."""
        if self._unread[0] is not self._loads:  # once a snapshot, not once a request
            loads = self._loads.values()
            running = sum(load.num_running for load in loads)
            tokens = (sum(load.running_tokens for load in loads) // running if running
                      else self.tuning.unread_request_tokens)
            self._unread = (self._loads, RequestCost(tokens, tokens))
        return self._unread[1]

    def _fresh_loads(self, now: float) -> Mapping[str, ReplicaLoad]:
        if now - self._loads_at > self.tuning.max_snapshot_age_s:
            self.num_local_view += 1
            return NO_LOADS
        return self._loads

    async def _refresh_if_stale(self, now: float) -> None:
        """Start a refresh when due; if the cache is stale, wait for it (bounded, never raises)."""
        self._maybe_refresh(now)
        task = self._refresh_task
        if now - self._loads_at > self.tuning.stale_after_s and task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), self.tuning.stale_wait_s)
            except (asyncio.TimeoutError, TimeoutError):  # rank on what we have; it keeps going
                logger.debug("controller snapshot slower than %.3f s; routing on the cached view",
                             self.tuning.stale_wait_s)

    def _maybe_refresh(self, now: float) -> None:
        """Start a background snapshot fetch if the cached one is older than the interval (and
        drop dead ledger entries then: a sweep of the ledger per refresh, not per request)."""
        if now - self._last_refresh < self.tuning.refresh_interval_s:
            return
        if self._refresh_task is not None and not self._refresh_task.done():
            return
        self._last_refresh = now
        self._book.prune(now)
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            if self._controller is None:
                self._controller = get_or_create_controller(self._controller_name, self._namespace)
            ref = self._controller.routing_view.remote(self._deployment, self._by_prefix)
            blob = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.tuning.snapshot_timeout_s)
            snap = load_view(blob)
            self._loads = dict(snap.replicas)
            self._loads_at = time.time()
        except Exception as exc:  # controller gone or slow: keep routing on the local view
            logger.debug("controller snapshot failed: %r", exc)
            self._controller = None
            self._last_refresh = time.time() + 1.0  # retry the lookup in about a second
