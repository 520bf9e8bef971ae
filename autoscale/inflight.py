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
        # (loads, tokens, kv) of the last `view`, kept equal to unreflected(loads) as entries change.
        self._view: tuple[Mapping[str, ReplicaLoad], dict[str, int], dict[str, int]] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def tentative(self, request_id: str, replica_id: str, cost: RequestCost, now: float) -> None:
        """The router ranked `replica_id` first for this request; count it there until confirmed."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.confirmed:
            self._put(request_id, _Entry(replica_id, cost, now, False))

    def routed(self, request_id: str, replica_id: str, now: float, cost: RequestCost | None = None) -> None:
        """Serve sent the request to `replica_id` (not necessarily the one ranked first)."""
        entry = self._entries.get(request_id)
        if cost is None:
            cost = entry.cost if entry is not None else RequestCost(0, 0)
        self._put(request_id, _Entry(replica_id, cost, now, True))

    def completed(self, request_id: str) -> None:
        self._put(request_id, None)

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica that left (its requests will complete or fail on their own)."""
        for rid in [k for k, e in self._entries.items() if e.replica_id == replica_id]:
            self._put(rid, None)

    def prune(self, now: float) -> None:
        """Drop tentative choices that were never confirmed and confirmations never completed."""
        dead = [k for k, e in self._entries.items()
                if now - e.routed_at > (self.ttl_s if e.confirmed else self.tentative_ttl_s)]
        for k in dead:
            self._put(k, None)

    def unreflected(self, loads: Mapping[str, ReplicaLoad]) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica: (tokens, KV tokens) of requests its latest report in `loads` does not show."""
        tokens: dict[str, int] = defaultdict(int)
        kv: dict[str, int] = defaultdict(int)
        for e in self._entries.values():
            if self._counts(e, loads):
                tokens[e.replica_id] += e.cost.tokens
                kv[e.replica_id] += e.cost.kv_tokens
        return dict(tokens), dict(kv)

    def view(self, loads: Mapping[str, ReplicaLoad]) -> tuple[dict[str, int], dict[str, int]]:
        """`unreflected(loads)` as live dicts the book keeps current as requests come and go,
        until the next `view`: one sweep now, O(1) a change after. For a caller holding one
        unchanging `loads` between snapshots (the router), so a decision costs no sweep."""
        tokens, kv = self.unreflected(loads)
        self._view = (loads, tokens, kv)
        return tokens, kv

    def _counts(self, e: _Entry, loads: Mapping[str, ReplicaLoad]) -> bool:
        load = loads.get(e.replica_id)  # a confirmed send its replica's report includes: no more
        return not (e.confirmed and load is not None and load.timestamp >= e.routed_at + self.reflect_grace_s)

    def _put(self, request_id: str, entry: _Entry | None) -> None:
        """Set (or with None drop) an entry, moving its tokens in the live view."""
        old = self._entries.pop(request_id, None)
        if entry is not None:
            self._entries[request_id] = entry
        if self._view is None:
            return
        loads, tokens, kv = self._view
        for e, sign in ((old, -1), (entry, 1)):
            if e is not None and self._counts(e, loads):
                r = e.replica_id
                tokens[r] = tokens.get(r, 0) + sign * e.cost.tokens
                kv[r] = kv.get(r, 0) + sign * e.cost.kv_tokens
                if tokens[r] == 0 and kv[r] == 0:
                    del tokens[r], kv[r]

    def outstanding(self) -> dict[str, int]:
        """Tokens of every request not yet completed, per replica (the local view)."""
        return self.unreflected({})[0]
