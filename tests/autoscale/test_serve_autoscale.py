"""On real Serve replicas (a fake token server that reports load like the engine does): a replica
busy with a long prompt gets no new requests while another is free; with an artificially low
TBT SLO under load the deployment scales up, and back down once load stops; and a stream in
progress on the replica scaled away still completes.

Nothing here races the clock: held requests wait until cancelled, streams that must outlive
the scale-down wait for a file the test creates, and every wait polls with a generous deadline.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from autoscale.controller import kill_controller
from autoscale.scaling import ScalingConfig
from autoscale.serve_options import deployment_options

pytestmark = pytest.mark.serve


def fake_token_server(controller_name: str, namespace: str) -> Any:
    """A Serve deployment class whose `generate` streams like the engine and reports its load.

    `params`: `max_tokens`, `tbt_s` (real sleep per token), `hold_s` (time the prompt waits
    before its first token, counted as waiting tokens), `extra_waiting` (more waiting tokens to
    report meanwhile: load this router never saw, as if another ingress had sent it),
    `fake_tbt_s` (TBT to report instead of the measured one, so a stream looks fast),
    `until_path` (stop before `max_tokens` once this file exists, then yield `{"sent": n}`).
    Built inside a function so Ray pickles it by value (the test module is not importable there).
    """
    import random as _random

    from ray import serve

    from autoscale.keys import current_replica_key
    from autoscale.reporter import LoadReporter
    from replicas.protocol import ReplicaLoad

    class FakeTokenServer:
        def __init__(self) -> None:
            self.key = current_replica_key()
            self.waiting: dict[str, int] = {}
            self.running: dict[str, int] = {}
            self.tbt: list[float] = []
            self.reporter = LoadReporter(controller_name=controller_name, namespace=namespace)
            self.reporter.start(self.load, get_tbt=lambda: (len(self.tbt), self.tbt[-64:]))

        def load(self) -> ReplicaLoad:
            return ReplicaLoad(running_tokens=sum(self.running.values()),
                               waiting_tokens=sum(self.waiting.values()), num_running=len(self.running),
                               num_waiting=len(self.waiting), free_blocks=10_000, total_blocks=10_000)

        def record_autoscaling_stats(self) -> dict[str, float]:
            return self.reporter.autoscaling_stats()

        async def generate(self, prompt_token_ids: list[int], params: dict[str, Any]):
            rid = uuid.uuid4().hex
            self.waiting[rid] = len(prompt_token_ids) + params.get("extra_waiting", 0)
            try:
                yield self.key
                await asyncio.sleep(params.get("hold_s", 0.0))
                self.waiting.pop(rid)
                self.running[rid] = len(prompt_token_ids)
                last = time.monotonic()
                until, sent = params.get("until_path"), 0
                for i in range(params["max_tokens"]):
                    if until is not None and os.path.exists(until):
                        break
                    await asyncio.sleep(params.get("tbt_s", 0.02))
                    now = time.monotonic()
                    fake = params.get("fake_tbt_s")
                    self.tbt.append(fake * (1 + 0.01 * _random.random()) if fake else now - last)
                    last = now
                    self.running[rid] += 1
                    sent += 1
                    yield i
                if until is not None:
                    yield {"sent": sent}
            finally:
                self.waiting.pop(rid, None)
                self.running.pop(rid, None)

    return serve.deployment(FakeTokenServer)


def running_replicas(app: str, deployment: str = "FakeTokenServer") -> int:
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


async def open_stream(handle: Any, prompt_len: int, **params: Any) -> tuple[str, Any]:
    """Start one request: (replica key that serves it, the stream past that first item)."""
    gen = handle.options(stream=True).generate.remote(list(range(prompt_len)), params)
    return await anext(gen), gen


async def count(gen: AsyncIterator[Any]) -> int:
    """Tokens received to the end of a stream; with `until_path`, checked against what the
    replica says it sent (a stream cut short would miss its last item)."""
    items = [item async for item in gen]
    if items and isinstance(items[-1], dict):
        *items, summary = items
        assert summary == {"sent": len(items)}, (summary, len(items))
        return len(items)
    return len(items)


async def stream(handle: Any, prompt_len: int, **params: Any) -> tuple[str, int]:
    """Run one request to the end: (replica key that served it, tokens received)."""
    replica, gen = await open_stream(handle, prompt_len, **params)
    return replica, await count(gen)


def controller_of(ctl: str, ns: str) -> Any:
    """The test's own controller, made before any replica reports: its replicas go stale only
    after a minute, so a slow report on a busy machine never hides one from the router."""
    from autoscale.controller import get_or_create_controller

    return get_or_create_controller(ctl, ns, stale_after_s=60.0)


async def waiting_tokens(controller: Any) -> dict[str, int]:
    """Each replica's waiting tokens as the controller has them now."""
    snap = await controller.snapshot.remote(with_tbt=False)
    return {key: load.waiting_tokens for key, load in snap.replicas.items()}


@pytest.fixture
def names(ray_serve):
    from ray import serve

    tag = uuid.uuid4().hex[:8]
    ns = "stallfree_test"
    yield f"app_{tag}", f"ctl_{tag}", ns
    serve.delete(f"app_{tag}")
    kill_controller(f"ctl_{tag}", ns)


@pytest.fixture(scope="module")
def two_replicas(ray_serve):
    """The fake server on 2 fixed replicas behind the token-load router, which here refreshes
    the controller's view before every routing decision and waits for it as long as it takes
    (by default it waits 0.1 s at most, which a busy machine can overrun): the burst tests
    rank on what the controller knows, not on how fast the machine is. Yields the handle, the
    controller and its (name, namespace)."""
    from ray import serve

    tag = uuid.uuid4().hex[:8]
    app, ctl, ns = f"app_{tag}", f"ctl_{tag}", "stallfree_test"
    controller = controller_of(ctl, ns)
    dep = fake_token_server(ctl, ns).options(
        num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
        **deployment_options("token_load", controller_name=ctl, namespace=ns, refresh_interval_s=0.0,
                             stale_after_s=0.0, stale_wait_s=60.0, snapshot_timeout_s=60.0,
                             max_snapshot_age_s=60.0))
    handle = serve.run(dep.bind(), name=app, route_prefix=None)
    yield handle, controller, (ctl, ns)
    serve.delete(app)
    kill_controller(ctl, ns)


async def short_burst(handle: Any, n: int = 10) -> list[str]:
    results = await asyncio.gather(*(stream(handle, 10, max_tokens=2, tbt_s=0.01) for _ in range(n)))
    assert [count for _, count in results] == [2] * n
    return [replica for replica, _ in results]


async def both_replicas_serve(handle: Any, await_until: Any) -> None:
    """Wait until this handle's router sends a burst to both replicas (it learns of a replica
    some time after Serve reports it running)."""
    async def split() -> bool:
        return len(set(await short_burst(handle, 4))) == 2

    await await_until(split, interval_s=0.2, what="a burst split over both replicas")


async def burst_beside_a_held_request(two_replicas: Any, await_until: Any, prompt_len: int,
                                      waiting: int, **params: Any) -> tuple[str, list[str]]:
    """Hold one request (until cancelled) that its replica reports as `waiting` tokens; once the
    controller shows that, send a burst of short requests. Returns (the busy replica, the replica
    each burst request went to), after the held request is cancelled and its load is gone."""
    handle, controller, _ = two_replicas
    await both_replicas_serve(handle, await_until)
    busy, held = await open_stream(handle, prompt_len, max_tokens=1, hold_s=3600.0, **params)
    try:
        async def reported() -> bool:
            return (await waiting_tokens(controller)).get(busy) == waiting

        await await_until(reported, what="the held request reported")
        served = await short_burst(handle)
    finally:
        held.cancel()

    async def gone() -> bool:
        return set((await waiting_tokens(controller)).values()) == {0}

    await await_until(gone, what="the held request cancelled")
    return busy, served


async def test_new_requests_avoid_the_replica_busy_with_a_long_prompt(two_replicas, await_until):
    busy, served = await burst_beside_a_held_request(two_replicas, await_until, 5000, 5000)
    assert len(served) == 10 and len(set(served)) == 1 and busy not in served, (busy, served)


async def test_load_only_the_controller_knows_steers_requests(two_replicas, await_until):
    """A 1-token request that the replica reports as 50k waiting tokens (as if another ingress
    had routed a long prompt there): only the controller snapshot reveals it; this router's
    own ledger alone would split the burst across both replicas."""
    busy, served = await burst_beside_a_held_request(two_replicas, await_until, 1, 50_001,
                                                     extra_waiting=50_000)
    assert len(served) == 10 and len(set(served)) == 1 and busy not in served, (busy, served)
    # The replicas' reports reach their node's relay as datagrams on its socket between the
    # heartbeat's actor calls (autoscale/datagrams.py). Only a load that changes is reported
    # between heartbeats: an idle replica's reports are all calls, so bursts keep loads moving.
    import ray

    from autoscale.relay import relay_name

    ctl, ns = two_replicas[2]
    relay = ray.get_actor(relay_name(ctl, ray.get_runtime_context().get_node_id()), namespace=ns)

    async def datagrams_came() -> bool:
        await short_burst(two_replicas[0])
        counts = await relay.datagrams.remote()
        assert counts["path"] and counts["bad"] == 0, counts
        return counts["received"] > 0

    await await_until(datagrams_came, interval_s=0.1, what="reports by datagram at the node relay")


async def test_scales_up_on_slo_breach_and_down_without_cutting_streams(names, await_until, tmp_path: Path):
    from ray import serve

    app, ctl, ns = names
    controller_of(ctl, ns)
    scaling = ScalingConfig(window_s=2.0, min_replicas=1, max_replicas=2,
                            upscale_cooldown_s=0.5, downscale_cooldown_s=1.0, downscale_stable_s=1.0,
                            min_samples=5, queued_tokens_per_replica=None)
    dep = fake_token_server(ctl, ns).options(
        max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
        **deployment_options("token_load", scaling, 0.005, graceful_shutdown_timeout_s=60.0,
                             initial_replicas=1, controller_name=ctl, namespace=ns))
    handle = serve.run(dep.bind(), name=app, route_prefix=None)
    assert running_replicas(app) == 1

    # Load: real TBT >= 20 ms against a 5 ms SLO, in batches until a second replica runs and
    # serves. (Not necessarily within one batch: the replica that served the last batch still
    # reports its load for a report period after, so the next batch may all go to the other.)
    served_by: set[str] = set()

    async def scaled_up() -> bool:
        results = await asyncio.gather(*(stream(handle, 50, max_tokens=50, tbt_s=0.02) for _ in range(4)))
        assert [n for _, n in results] == [50] * 4
        if running_replicas(app) < 2:
            served_by.clear()
            return False
        served_by.update(r for r, _ in results)
        return len(served_by) == 2

    await await_until(scaled_up, interval_s=0.0, what="scale-up to 2 replicas")

    # Load stops. One fast-looking stream per replica (the router's ledger sends the second to
    # the replica the first left free), each running until the test opens the gate; the policy
    # removes a replica while both are mid-stream.
    gate = tmp_path / "streams_may_end"
    params = {"max_tokens": 100_000, "tbt_s": 0.1, "fake_tbt_s": 0.001, "until_path": str(gate)}
    try:
        r1, first = await open_stream(handle, 200, **params)
        r2, second = await open_stream(handle, 200, **params)
        assert r1 != r2
        counts = [asyncio.ensure_future(count(first)), asyncio.ensure_future(count(second))]
        await await_until(lambda: running_replicas(app) == 1, interval_s=0.2, what="scale-down to 1")
        assert not any(c.done() for c in counts)  # held by the gate: the scale-down came mid-stream
    finally:
        gate.touch()
    await asyncio.gather(*counts)  # each ends with the replica's own count: the removed one was not cut
