"""The Serve router, driven without Ray through its hooks: it takes its knobs from one
`RouterTuning` (unknown keywords refused), ranks a seeded sample of a large fleet on the
controller's loads and returns it one replica per rank, and with `ranking: prefix` sends a
conversation's next turn where it sent the previous one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from autoscale.load import ClusterSnapshot, ReplicaLoad
from autoscale.router import TokenLoadRouter

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Replica:  # what the router reads of Serve's RunningReplica
    replica_id: str


@dataclass
class Pending:  # what the router reads of Serve's PendingRequest
    args: tuple
    kwargs: dict
    metadata: Any
    routing_context: Any = field(default_factory=lambda: type("Ctx", (), {})())


class Controller:
    """Answers `routing_view.remote(...)` at once with fixed loads."""

    def __init__(self, loads: dict[str, ReplicaLoad]) -> None:
        self.routing_view = self
        self.loads = loads
        self.calls = 0
        self.asked: list[tuple[str | None, bool]] = []  # (deployment, with_sketches) of each call

    def remote(self, deployment: str | None, with_sketches: bool = False) -> Any:
        self.calls += 1
        self.asked.append((deployment, with_sketches))
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(pickle.dumps(ClusterSnapshot(replicas=self.loads)))
        return type("Ref", (), {"future": lambda _self: done})()


def router(loads: dict[str, ReplicaLoad], **tuning: Any) -> TokenLoadRouter:
    r = TokenLoadRouter.__new__(TokenLoadRouter)  # Serve's constructor wants a live deployment
    r.initialize_state(controller_name="c", namespace="n", **tuning)
    r._replicas = {}
    r._controller = Controller(loads)
    return r


def request(i: int, prompt: list[int], max_tokens: int = 10) -> Pending:
    meta = type("Meta", (), {"internal_request_id": f"q{i}"})()
    return Pending((prompt, {"max_tokens": max_tokens}), {}, meta)


def test_the_router_asks_for_its_deployments_view():
    """The view of the candidates' deployment (Serve's replica key less its last part); of
    everyone when the candidates span several."""
    keys = [f"SERVE_REPLICA::app#LLMServer#{i}" for i in range(3)]
    loads = {k: ReplicaLoad(k, running_tokens=i) for i, k in enumerate(keys)}

    async def route(r: TokenLoadRouter, replicas: list[Replica]) -> None:
        await r.choose_replicas(replicas, request(0, list(range(5))))

    r = router(loads)
    asyncio.run(route(r, [Replica(k) for k in keys]))
    assert r._controller.asked == [("SERVE_REPLICA::app#LLMServer", False)]
    mixed = router(loads, ranking="prefix")
    asyncio.run(route(mixed, [Replica(k) for k in keys] + [Replica("SERVE_REPLICA::app#Other#x")]))
    assert mixed._controller.asked == [(None, True)]


def test_unknown_router_keywords_are_refused():
    with pytest.raises(ValueError, match="sampel_size"):
        router({}, sampel_size=8)
    assert router({}, sample_size=None, seed=3).tuning.sample_size is None


def test_a_large_fleet_gets_the_ranked_sample_of_the_controllers_loads():
    rng = random.Random(0)
    keys = [f"r{i:04d}" for i in range(1000)]
    loads = {k: ReplicaLoad(k, running_tokens=rng.randrange(10_000), free_blocks=1000, total_blocks=1000,
                            block_size=16) for k in keys}
    replicas = [Replica(k) for k in keys]

    async def route(r: TokenLoadRouter, i: int) -> list[str]:
        await r.choose_replicas(replicas, request(i, list(range(50))))  # the first waits for the snapshot
        await asyncio.sleep(0)
        groups = await r.choose_replicas(replicas, request(i, list(range(50))))
        return [g[0].replica_id for g in groups]

    a, b = router(loads, seed=5), router(loads, seed=5)
    ranked = asyncio.run(route(a, 1))
    assert ranked == asyncio.run(route(b, 1))  # seeded: the same sample and order
    assert len(ranked) == 16 and len(set(ranked)) == 16
    assert [loads[k].running_tokens for k in ranked] == sorted(loads[k].running_tokens for k in ranked)
    assert a._candidates is replicas and len(a._candidate_keys) == 1000  # indexed once for this list


def test_prefix_ranking_sends_the_next_turn_where_the_history_went():
    from replicas.scheduling.prefix_hash import PrefixSketch, block_hashes

    keys = [f"r{i:04d}" for i in range(200)]
    turn1 = list(range(1000, 1000 + 16 * 20))
    turn2 = turn1 + list(range(5000, 5100))
    loads = {k: ReplicaLoad(k, running_tokens=100, free_blocks=1000, total_blocks=1000, block_size=16,
                            prefix_sketch=PrefixSketch.of([], 1000)) for k in keys}
    replicas = [Replica(k) for k in keys]

    async def conversation() -> tuple[str, str]:
        # Every request waits for a fresh snapshot, so the second one sees the first's cache.
        r = router(loads, ranking="prefix", seed=1, refresh_interval_s=1e-9, stale_after_s=1e-9)
        first = (await r.choose_replicas(replicas, request(1, turn1)))[0][0].replica_id
        # That replica now caches turn 1 and reports it (load equal to the others').
        loads[first] = ReplicaLoad(first, running_tokens=100, free_blocks=1000, total_blocks=1000,
                                   block_size=16, prefix_sketch=PrefixSketch.of(block_hashes(turn1, 16), 1000))
        second = (await r.choose_replicas(replicas, request(2, turn2)))[0][0].replica_id
        return first, second

    first, second = asyncio.run(conversation())
    assert second == first


def test_http_requests_routed_before_their_body_is_read_spread_over_a_burst():
    """An engine replica that serves HTTP itself (`ingress_in_replica`) gets each request from
    Serve's proxy as bytes, its body unread: the router books it at the replicas' mean tokens per
    running request (256 while none runs), so a burst between two load reports spreads evenly
    over equally loaded replicas instead of following ties at random."""
    keys = ["a", "b"]
    idle = {k: ReplicaLoad(k, free_blocks=1000, total_blocks=1000, block_size=16) for k in keys}
    replicas = [Replica(k) for k in keys]

    async def burst(r: TokenLoadRouter, n: int) -> list[str]:
        chosen = []
        for i in range(n):
            meta = type("Meta", (), {"internal_request_id": f"h{i}"})()
            pending = Pending((b"serialized ASGI request",), {}, meta)
            best = (await r.choose_replicas(replicas, pending))[0][0]
            r.on_request_routed(pending, best.replica_id, None)
            chosen.append(best.replica_id)
        return chosen

    r = router(idle, seed=7)
    chosen = asyncio.run(burst(r, 8))
    # Each goes to the one booked less (ties at random): never more than one apart.
    assert all(abs(chosen[:i].count("a") - chosen[:i].count("b")) <= 1 for i in range(1, 9))
    assert r._cost(Pending((b"x",), {}, None)).tokens == 256
    busy = {k: ReplicaLoad(k, running_tokens=3000, num_running=4, free_blocks=1000, total_blocks=1000,
                           block_size=16) for k in keys}
    r = router(busy, seed=7)
    asyncio.run(burst(r, 1))  # the first request waits for the snapshot
    assert r._cost(Pending((b"x",), {}, None)).tokens == 750  # 6000 tokens over 8 running requests
