"""Routing policies for the simulator: thin adapters around `autoscale.routing`'s pure functions.

The ranking is the production code (`choose_replica`, `power_of_two`, `round_robin`) with the
production tuning (`RouterTuning`: the same candidate sample size, prefix bound and grace;
pass another record to compare, e.g. `sample_size=None` for the full ranking); these classes
only hold what the Serve router holds between requests:

- token_load: the replicas' latest load reports plus the router's `InFlightBook` (requests routed
  but not yet visible in a report). A request routed to replica r stops counting as in flight
  once r reports at least `reflect_grace_s` after the send, exactly the book's rule; the adapter
  removes such entries at report time so the book stays small at cluster scale.
- ttft: the same reports and book, ranked by predicted time to first token (prompt backlog over
  the replica's prefill rate; the simulated replicas report their cost model's rate).
- prefix: production's `choose_by_prefix` on the same reports and book: the replica holding the
  longest cached prefix of the prompt within a bounded token-load imbalance, the sample widened
  by the router's `PrefixHints` as in Serve. The replicas' caches are read exactly (`BlockManager.num_cached_leading`) where production reads a Bloom
  sketch refreshed every ~0.1 s: the simulated view is a little fresher and never false-positive.
- power_of_two: two random replicas, fewer ongoing requests first (Serve's default probes the
  replicas' live queue lengths, so counts here are exact, not reported).
- round_robin: rotate.

`prefill_backlog` is a what-if (see its class), not a production policy.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import replace
from collections.abc import Mapping, Sequence

from autoscale.inflight import InFlightBook
from autoscale.load import ReplicaLoad
from autoscale.prefix_hints import PrefixHints
from autoscale.router_tuning import RouterTuning
from autoscale.routing import (RequestCost, choose_by_prefix, choose_by_ttft, choose_replica, power_of_two,
                               round_robin)
from loadtests.sim.replica import SimReplica
from replicas.scheduling.kv_cache import BlockManager
from replicas.scheduling.prefix_hash import block_hashes

ROUTERS = ("token_load", "ttft", "prefix", "power_of_two", "round_robin")
WHAT_IF_ROUTERS = ("prefill_backlog", "settled")


class Router:
    """Picks a replica for each request; told when requests are routed, reported and finished."""

    needs_reports = False

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        raise NotImplementedError

    def routed(self, request_id: str, replica: SimReplica, cost: RequestCost, now: float) -> None:
        pass

    def reported(self, replica: SimReplica, load: ReplicaLoad, now: float) -> None:
        pass

    def completed(self, request_id: str, now: float) -> None:
        pass

    def removed(self, replica: SimReplica) -> None:
        pass


class TokenLoadRouter(Router):
    needs_reports = True
    rank = staticmethod(choose_replica)

    def __init__(self, seed: int = 0, tuning: RouterTuning = RouterTuning()) -> None:
        self.rng = random.Random(seed)
        self.tuning = tuning
        self.book = InFlightBook(reflect_grace_s=tuning.reflect_grace_s)
        self.grace = tuning.reflect_grace_s
        self.loads: dict[str, ReplicaLoad] = {}
        self._sent: dict[str, deque[tuple[float, str]]] = {}
        self._by_id: dict[str, SimReplica] = {}
        # What no report shows yet, kept as sends come and go: `reported` completes every send a
        # report reflects, so every entry the book holds counts (a view over no loads: O(1) a
        # change, no sweep per decision; a view over `self.loads`, which reports change in place,
        # would judge a send's removal by a newer report than its addition).
        self._in_flight = self.book.view({})

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        in_flight, in_flight_kv = self._in_flight
        ranked = self.rank(cost.tokens, cost.kv_tokens, self.loads, in_flight, candidates=_Ids(replicas),
                           in_flight_kv=in_flight_kv, rng=self.rng, sample_size=self.tuning.sample_size)
        return self._replica(ranked[0], replicas)

    def _replica(self, replica_id: str, replicas: Sequence[SimReplica]) -> SimReplica:
        """The replica of an id the ranking returned (ids are never reused: a hit is right)."""
        r = self._by_id.get(replica_id)
        if r is None:
            self._by_id = {r.replica_id: r for r in replicas}
            r = self._by_id[replica_id]
        return r

    def routed(self, request_id: str, replica: SimReplica, cost: RequestCost, now: float) -> None:
        self.book.tentative(request_id, replica.replica_id, cost, now)
        self.book.routed(request_id, replica.replica_id, now)
        self._sent.setdefault(replica.replica_id, deque()).append((now, request_id))

    def reported(self, replica: SimReplica, load: ReplicaLoad, now: float) -> None:
        self.loads[replica.replica_id] = load
        sent = self._sent.get(replica.replica_id)
        while sent and load.timestamp >= sent[0][0] + self.grace:
            self._reflected(sent.popleft()[1])

    def _reflected(self, request_id: str) -> None:
        """A report shows the request: the book would skip it from now on."""
        self.book.completed(request_id)

    def completed(self, request_id: str, now: float) -> None:
        self.book.completed(request_id)

    def removed(self, replica: SimReplica) -> None:
        self.loads.pop(replica.replica_id, None)
        self.book.forget_replica(replica.replica_id)
        self._sent.pop(replica.replica_id, None)


class SettledRouter(TokenLoadRouter):
    """What-if, not production: token load less the prompts of requests that finished after their
    replica's latest report.

    A report made while a request ran counts its tokens (its prompt and output so far) until the
    replica's next report after it finished, so a replica that just finished a burst looks busy
    for a report period (longer with relays and hubs: `SimConfig.report_delay_s`) and the next
    burst all goes elsewhere. The router knows when its requests finish and what their prompts
    were: it takes those off (at least what the report held for each) until the replica reports
    again. Measured side by side with token_load, with identical staleness.
    """

    def __init__(self, seed: int = 0, tuning: RouterTuning = RouterTuning()) -> None:
        super().__init__(seed, tuning)
        self._prompt: dict[str, tuple[str, int, bool]] = {}  # request -> (replica, prompt tokens, reported)
        self._settled: dict[str, list[tuple[float, int]]] = {}  # replica -> (finished at, tokens)
        self._less: dict[str, int] = {}  # replica -> tokens its latest report holds of finished requests

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        in_flight, in_flight_kv = self._in_flight
        ranked = self.rank(cost.tokens, cost.kv_tokens, self.loads, _Less(in_flight, self._less),
                           candidates=_Ids(replicas), in_flight_kv=in_flight_kv, rng=self.rng,
                           sample_size=self.tuning.sample_size)
        return self._replica(ranked[0], replicas)

    def routed(self, request_id: str, replica: SimReplica, cost: RequestCost, now: float) -> None:
        super().routed(request_id, replica, cost, now)
        self._prompt[request_id] = (replica.replica_id, cost.tokens, False)

    def _reflected(self, request_id: str) -> None:
        super()._reflected(request_id)
        known = self._prompt.get(request_id)
        if known is not None:
            self._prompt[request_id] = (known[0], known[1], True)

    def reported(self, replica: SimReplica, load: ReplicaLoad, now: float) -> None:
        super().reported(replica, load, now)
        settled = self._settled.get(replica.replica_id)
        if settled:  # what finished before this report (plus grace) is out of it
            left = [(t, n) for t, n in settled if load.timestamp < t + self.grace]
            self._settled[replica.replica_id] = left
            self._less[replica.replica_id] = sum(n for _, n in left)

    def completed(self, request_id: str, now: float) -> None:
        super().completed(request_id, now)
        replica_id, tokens, reported = self._prompt.pop(request_id, (None, 0, False))
        if replica_id is None or not reported or replica_id not in self.loads:
            return
        self._settled.setdefault(replica_id, []).append((now, tokens))
        self._less[replica_id] = self._less.get(replica_id, 0) + tokens

    def removed(self, replica: SimReplica) -> None:
        super().removed(replica)
        self._settled.pop(replica.replica_id, None)
        self._less.pop(replica.replica_id, None)


class _Less(Mapping[str, int]):
    """In-flight tokens less the finished requests' a report still holds, per replica."""

    def __init__(self, in_flight: Mapping[str, int], less: Mapping[str, int]) -> None:
        self.in_flight, self.less = in_flight, less

    def get(self, key: str, default: int = 0) -> int:  # type: ignore[override]
        return self.in_flight.get(key, default) - self.less.get(key, 0)

    def __getitem__(self, key: str) -> int:
        return self.get(key)

    def __iter__(self):  # noqa: ANN204
        return iter({*self.in_flight, *self.less})

    def __len__(self) -> int:
        return len({*self.in_flight, *self.less})


class _Ids(Sequence[str]):
    """The replicas' ids as a sequence, without building a list per decision (the ranking draws
    a sample of them; only a failed filter scans further)."""

    def __init__(self, replicas: Sequence[SimReplica]) -> None:
        self.replicas = replicas

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as Sequence has it
        if isinstance(i, slice):
            return [r.replica_id for r in self.replicas[i]]
        return self.replicas[i].replica_id


class TtftRouter(TokenLoadRouter):
    """Production's `ttft` ranking (`routing.choose_by_ttft`) on the same reports and book."""

    rank = staticmethod(choose_by_ttft)


class _LiveCache:
    """A replica's prefix cache as `choose_by_prefix` asks a sketch: leading blocks held."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        return self.blocks.num_cached_leading(hashes)


class PrefixRouter(TokenLoadRouter):
    """Production's `prefix` ranking (`routing.choose_by_prefix`) on the same reports and book."""

    def __init__(self, seed: int = 0, tuning: RouterTuning = RouterTuning()) -> None:
        super().__init__(seed, tuning)
        self.hints = PrefixHints(tuning.prefix_hints)

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        in_flight, in_flight_kv = self._in_flight
        by_id = {r.replica_id: r for r in replicas}
        hashes = block_hashes(prompt, replicas[0].blocks.block_size) if prompt is not None and replicas else []
        hint = self.hints.lookup(hashes) if hashes else None
        ranked = choose_by_prefix(cost.tokens, cost.kv_tokens, self.loads, in_flight, prompt_hashes=hashes,
                                  max_imbalance=self.tuning.prefix_imbalance, candidates=list(by_id),
                                  in_flight_kv=in_flight_kv, rng=self.rng, sample_size=self.tuning.sample_size,
                                  affinity=[hint] if hint in by_id else [])
        if hashes:
            self.hints.record(hashes, ranked[0])
        return by_id[ranked[0]]

    def reported(self, replica: SimReplica, load: ReplicaLoad, now: float) -> None:
        super().reported(replica, replace(load, prefix_sketch=_LiveCache(replica.blocks)), now)


class PrefillBacklogRouter(TokenLoadRouter):
    """What-if, not production: the same `choose_replica` fed the same reports, minus running KV.

    Token load counts the KV of every running stream; under stall_free a new request's TTFT
    depends on the prompt tokens queued ahead of it instead. Zeroing `running_tokens` makes the
    production ranking order replicas by waiting + in-flight prompt tokens (KV headroom still
    filters). Kept to measure that alternative side by side, with identical staleness.
    """

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        in_flight, in_flight_kv = self._in_flight
        backlog = {k: replace(v, running_tokens=0) for k, v in self.loads.items()}
        by_id = {r.replica_id: r for r in replicas}
        ranked = choose_replica(cost.tokens, cost.kv_tokens, backlog, in_flight, candidates=list(by_id),
                                in_flight_kv=in_flight_kv, rng=self.rng, sample_size=self.tuning.sample_size)
        return by_id[ranked[0]]


class PowerOfTwoRouter(Router):
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        by_id = {r.replica_id: r for r in replicas}
        queues = {r.replica_id: r.num_requests for r in replicas}
        return by_id[power_of_two(list(by_id), queues, self.rng)[0]]


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self.turn = 0

    def choose(self, cost: RequestCost, replicas: Sequence[SimReplica], now: float,
               prompt: Sequence[int] | None = None) -> SimReplica:
        ids = [r.replica_id for r in replicas]
        first = round_robin(ids, self.turn)[0]
        self.turn += 1
        return replicas[ids.index(first)]


def make_router(name: str, seed: int = 0, tuning: RouterTuning = RouterTuning()) -> Router:
    """The simulator's router `name`; the token-load family ranks with `tuning`."""
    if name == "token_load":
        return TokenLoadRouter(seed, tuning)
    if name == "ttft":
        return TtftRouter(seed, tuning)
    if name == "prefix":
        return PrefixRouter(seed, tuning)
    if name == "power_of_two":
        return PowerOfTwoRouter(seed)
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "prefill_backlog":
        return PrefillBacklogRouter(seed, tuning)
    if name == "settled":
        return SettledRouter(seed, tuning)
    raise ValueError(f"router must be one of {ROUTERS + WHAT_IF_ROUTERS}, got {name!r}")
