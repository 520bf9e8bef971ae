"""On real Serve replicas (a fake token server that reports load like the engine does): a replica
busy with a long prompt gets no new requests while another is free; with an artificially low
TBT SLO under load the deployment scales up within seconds and back down once load stops; and a
stream in progress on the replica scaled away still completes."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from autoscale.controller import kill_controller
from autoscale.scaling import ScalingConfig
from autoscale.serve_options import deployment_options


def fake_token_server(controller_name: str, namespace: str) -> Any:
    """A Serve deployment class whose `generate` streams like the engine and reports its load.

    `params`: `max_tokens`, `tbt_s` (real sleep per token), `hold_s` (time the prompt waits
    before its first token, counted as waiting tokens), `extra_waiting` (more waiting tokens to
    report meanwhile: load this router never saw, as if another ingress had sent it),
    `fake_tbt_s` (TBT to report instead of the measured one, so a stream looks fast).
    Built inside a function so Ray pickles it by value (the test module is not importable there).
    """
    import random as _random

    from ray import serve

    from autoscale.controller import current_replica_key
    from autoscale.reporter import LoadReporter

    class FakeTokenServer:
        def __init__(self) -> None:
            self.key = current_replica_key()
            self.waiting: dict[str, int] = {}
            self.running: dict[str, int] = {}
            self.tbt: list[float] = []
            self.reporter = LoadReporter(controller_name=controller_name, namespace=namespace)
            self.reporter.start(self.load)

        def load(self) -> dict[str, Any]:
            return {"running_tokens": sum(self.running.values()), "waiting_tokens": sum(self.waiting.values()),
                    "num_running": len(self.running), "num_waiting": len(self.waiting),
                    "free_blocks": 10_000, "total_blocks": 10_000, "block_size": 16,
                    "recent_tbt_s": self.tbt[-64:], "num_tbt_samples": len(self.tbt)}

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
                for i in range(params["max_tokens"]):
                    await asyncio.sleep(params.get("tbt_s", 0.02))
                    now = time.monotonic()
                    fake = params.get("fake_tbt_s")
                    self.tbt.append(fake * (1 + 0.01 * _random.random()) if fake else now - last)
                    last = now
                    self.running[rid] += 1
                    yield i
            finally:
                self.waiting.pop(rid, None)
                self.running.pop(rid, None)

    return serve.deployment(FakeTokenServer)


def running_replicas(app: str, deployment: str = "FakeTokenServer") -> int:
    from ray import serve

    states = serve.status().applications[app].deployments[deployment].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


async def stream(handle: Any, prompt_len: int, **params: Any) -> tuple[str, int]:
    """Run one request to the end: (replica key that served it, tokens received)."""
    gen = handle.options(stream=True).generate.remote(list(range(prompt_len)), params)
    replica = None
    count = 0
    async for item in gen:
        if replica is None:
            replica = item
        else:
            count += 1
    return replica, count


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
    """The fake server on 2 fixed replicas behind the token-load router."""
    from ray import serve

    tag = uuid.uuid4().hex[:8]
    app, ctl, ns = f"app_{tag}", f"ctl_{tag}", "stallfree_test"
    dep = fake_token_server(ctl, ns).options(
        num_replicas=2, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
        **deployment_options("token_load", controller_name=ctl, namespace=ns))
    yield serve.run(dep.bind(), name=app, route_prefix=None)
    serve.delete(app)
    kill_controller(ctl, ns)


async def short_burst(handle: Any, n: int = 10) -> list[str]:
    results = await asyncio.gather(*(stream(handle, 10, max_tokens=2, tbt_s=0.01) for _ in range(n)))
    assert all(count == 2 for _, count in results)
    return [replica for replica, _ in results]


async def test_new_requests_avoid_the_replica_busy_with_a_long_prompt(two_replicas):
    long_req = asyncio.create_task(stream(two_replicas, 5000, max_tokens=1, hold_s=3.0))
    await asyncio.sleep(0.5)
    served = await short_burst(two_replicas)
    busy, _ = await long_req
    assert busy not in served and len(set(served)) == 1, (busy, served)


async def test_load_only_the_controller_knows_steers_requests(two_replicas):
    """A 1-token request that the replica reports as 50k waiting tokens (as if another ingress
    had routed a long prompt there): only the controller snapshot reveals it; this router's
    own ledger alone would split the burst across both replicas."""
    hidden = asyncio.create_task(stream(two_replicas, 1, max_tokens=1, hold_s=3.0, extra_waiting=50_000))
    await asyncio.sleep(0.5)  # reported (100 ms) and read by the router (50 ms)
    served = await short_burst(two_replicas)
    busy, _ = await hidden
    assert busy not in served and len(set(served)) == 1, (busy, served)


async def test_scales_up_on_slo_breach_and_down_without_cutting_streams(names):
    from ray import serve

    app, ctl, ns = names
    scaling = ScalingConfig(tbt_slo_s=0.005, window_s=2.0, min_replicas=1, max_replicas=2,
                            upscale_cooldown_s=0.5, downscale_cooldown_s=1.0, downscale_stable_s=1.0,
                            min_samples=5, queued_tokens_per_replica=None)
    dep = fake_token_server(ctl, ns).options(
        max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
        **deployment_options("token_load", scaling, graceful_shutdown_timeout_s=60.0,
                             initial_replicas=1, controller_name=ctl, namespace=ns))
    handle = serve.run(dep.bind(), name=app, route_prefix=None)
    assert running_replicas(app) == 1

    # Load: real TBT ~20 ms against a 5 ms SLO. Keep streams going until a second replica runs.
    start = time.monotonic()
    load = [asyncio.create_task(stream(handle, 50, max_tokens=50, tbt_s=0.02)) for _ in range(4)]
    while running_replicas(app) < 2:
        assert time.monotonic() - start < 30, "did not scale up"
        if all(t.done() for t in load):
            load = [asyncio.create_task(stream(handle, 50, max_tokens=50, tbt_s=0.02)) for _ in range(4)]
        await asyncio.sleep(0.2)
    scale_up_s = time.monotonic() - start
    await asyncio.gather(*load)

    # Load stops. One long, fast-looking stream per replica (the second goes to the replica the
    # first left free); the policy then removes a replica while both are mid-stream.
    first = asyncio.create_task(stream(handle, 200, max_tokens=90, tbt_s=0.1, fake_tbt_s=0.001))
    await asyncio.sleep(0.5)
    second = asyncio.create_task(stream(handle, 200, max_tokens=90, tbt_s=0.1, fake_tbt_s=0.001))
    start = time.monotonic()
    while running_replicas(app) > 1:
        assert time.monotonic() - start < 30, "did not scale down"
        await asyncio.sleep(0.2)
    scale_down_s = time.monotonic() - start
    assert not (first.done() and second.done()), "scale-down came only after the streams ended"
    (r1, n1), (r2, n2) = await asyncio.gather(first, second)
    assert r1 != r2 and n1 == n2 == 90  # the stream on the removed replica was not cut
    print(f"scale up after {scale_up_s:.1f} s, down after {scale_down_s:.1f} s")
    assert scale_up_s < 20
