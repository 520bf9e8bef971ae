"""The router's own ledger of requests it routed: the part of the load no report shows yet.

Reports arrive every ~50-100 ms and the router reads them ~50 ms late, so a burst of requests
would all see the same loads and pile onto one replica. The ledger closes that gap:

- `tentative` when `choose_replicas` ranks a replica first (Serve has not sent it yet: under a
  burst many routing tasks choose before any send completes);
- `routed` when Serve confirms the replica accepted it (it may be a lower-ranked one);
- `completed` when the response finishes (a stream's last item, an error, or a cancel).

A sent request counts toward a replica until that replica's report is at least `reflect_grace_s`
newer than the send (the report then includes it). With no report at all (controller
unreachable) every request not yet completed counts: the router's local view.
Plain Python, no Ray: unit-tested directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from replicas.protocol import ReplicaLoad
from autoscale.routing import RequestCost


@dataclass
class _Entry:
    replica_id: str
    cost: RequestCost
    routed_at: float
    confirmed: bool


class InFlightBook:
    """Requests routed by this router, keyed by Serve's internal request id."""

    def __init__(self, reflect_grace_s: float = 0.05, tentative_ttl_s: float = 2.0,
                 ttl_s: float = 3600.0) -> None:
        self.reflect_grace_s = reflect_grace_s
        self.tentative_ttl_s = tentative_ttl_s  # a choice never confirmed (rejected, cancelled)
        self.ttl_s = ttl_s  # a completion we never heard about
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def tentative(self, request_id: str, replica_id: str, cost: RequestCost, now: float) -> None:
        """The router ranked `replica_id` first for this request; count it there until confirmed."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.confirmed:
            self._entries[request_id] = _Entry(replica_id, cost, now, False)

    def routed(self, request_id: str, replica_id: str, now: float, cost: RequestCost | None = None) -> None:
        """Serve sent the request to `replica_id` (not necessarily the one ranked first)."""
        entry = self._entries.get(request_id)
        if cost is None:
            cost = entry.cost if entry is not None else RequestCost(0, 0)
        self._entries[request_id] = _Entry(replica_id, cost, now, True)

    def completed(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica that left (its requests will complete or fail on their own)."""
        for rid in [k for k, e in self._entries.items() if e.replica_id == replica_id]:
            del self._entries[rid]

    def prune(self, now: float) -> None:
        """Drop tentative choices that were never confirmed and confirmations never completed."""
        dead = [k for k, e in self._entries.items()
                if now - e.routed_at > (self.ttl_s if e.confirmed else self.tentative_ttl_s)]
        for k in dead:
            del self._entries[k]

    def unreflected(self, loads: Mapping[str, ReplicaLoad]) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica: (tokens, KV tokens) of requests its latest report in `loads` does not show."""
        tokens: dict[str, int] = defaultdict(int)
        kv: dict[str, int] = defaultdict(int)
        for e in self._entries.values():
            load = loads.get(e.replica_id)
            if e.confirmed and load is not None and load.timestamp >= e.routed_at + self.reflect_grace_s:
                continue  # the replica's report already includes it
            tokens[e.replica_id] += e.cost.tokens
            kv[e.replica_id] += e.cost.kv_tokens
        return dict(tokens), dict(kv)

    def outstanding(self) -> dict[str, int]:
        """Tokens of every request not yet completed, per replica (the local view)."""
        return self.unreflected({})[0]
