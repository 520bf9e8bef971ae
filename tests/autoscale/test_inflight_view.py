"""The ledger's live view equals a fresh `unreflected` sweep after every change (tentative,
routed elsewhere, completed, a replica forgotten, pruned), so the router reads it per request
without sweeping the ledger."""

from __future__ import annotations

import random

import pytest

from autoscale.inflight import InFlightBook
from autoscale.load import ReplicaLoad
from autoscale.routing import RequestCost

pytestmark = pytest.mark.unit


def nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


@pytest.mark.parametrize("seed", range(4))
def test_the_view_follows_every_change(seed):
    rng = random.Random(seed)
    book = InFlightBook(reflect_grace_s=0.05, tentative_ttl_s=2.0, ttl_s=30.0)
    replicas = ["a", "b", "c", "d"]
    loads = {r: ReplicaLoad(r, timestamp=10.0 + rng.random()) for r in replicas[:3]}  # d: no report
    tokens, kv = book.view(loads)
    now = 9.0
    for step in range(600):
        now += rng.random() * 0.02
        op, rid = rng.random(), f"q{rng.randrange(80)}"
        if op < 0.35:
            book.tentative(rid, rng.choice(replicas), RequestCost(rng.randrange(1, 500), rng.randrange(1, 900)), now)
        elif op < 0.65:
            book.routed(rid, rng.choice(replicas), now)
        elif op < 0.9:
            book.completed(rid)
        elif op < 0.95:
            book.prune(now + rng.choice([0.0, 3.0, 40.0]))
        else:
            book.forget_replica(rng.choice(replicas))
        swept = book.unreflected(loads)
        assert (nonzero(tokens), nonzero(kv)) == (nonzero(swept[0]), nonzero(swept[1])), step
    assert tokens or len(book) == 0


def test_a_new_view_replaces_the_old_one():
    book = InFlightBook(reflect_grace_s=0.0)
    book.routed("q1", "a", now=1.0, cost=RequestCost(100, 200))
    old = book.view({})
    assert old == ({"a": 100}, {"a": 200})
    reported = {"a": ReplicaLoad("a", timestamp=2.0)}  # a's report includes q1
    new = book.view(reported)
    assert new == ({}, {})
    book.routed("q2", "a", now=3.0, cost=RequestCost(7, 9))
    assert new == ({"a": 7}, {"a": 9}) and old == ({"a": 100}, {"a": 200})  # the old one is let go
