"""When an engine replica's process dies mid-stream, its clients get an in-band
`engine_unavailable` error event and `[DONE]` (never a silent cut), the other replica's streams
complete, requests sent during recovery succeed (retried on the live replica if they had not
started), and Serve brings the replica count back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.serve

APP = "death"
NUM_STREAMS = 6
DEATH_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-death", "num_replicas": 2,
                  "num_cpus": 0.5, "ingress_num_cpus": 0.1, "engine": {"max_batch_total_tokens": 4096}}


@pytest.fixture(scope="module")
def death_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app(APP, DEATH_APP_ARGS) as url:
        yield url


def running_replicas() -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments["LLMServer"].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


async def replica_loads() -> dict[str, Any]:
    """This app's engine replicas as the controller sees them now (key: the replica actor's name)."""
    from autoscale.controller import get_or_create_controller

    snap = await get_or_create_controller().snapshot.remote(None, with_tbt=False)
    return {k: v for k, v in snap.replicas.items() if f"{APP}#LLMServer#" in k}


async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
    body = {"prompt": [7] * 16, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = []
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


async def test_killing_a_replica_mid_stream(death_url: str, await_until) -> None:  # noqa: ANN001
    import ray

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=death_url, timeout=120, limits=limits) as client:
        async def both_reporting() -> bool:
            return len(await replica_loads()) == 2

        await await_until(both_reporting, interval_s=0.1, what="both replicas reporting")
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(stream(client, ev)) for ev in started]
        for ev in started:
            await asyncio.wait_for(ev.wait(), 60)

        async def all_running() -> dict[str, Any] | None:
            """The loads once the reports show every stream running (each lasts 1500 tokens)."""
            loads = await replica_loads()
            return loads if sum(v.num_running for v in loads.values()) == NUM_STREAMS else None

        loads = await await_until(all_running, what=f"{NUM_STREAMS} streams reported running")
        # Kill (SIGKILL) the process of a replica that is streaming now.
        victim_key, victim_load = max(loads.items(), key=lambda kv: kv[1].num_running)
        on_victim = victim_load.num_running
        victim = ray.get_actor(victim_key, namespace="serve")
        pid = await victim.__ray_call__.remote(lambda self: os.getpid())
        os.kill(pid, signal.SIGKILL)
        # Requests sent during recovery succeed.
        during = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": [9] * 8, "max_tokens": 4, "ignore_eos": True}) for _ in range(8)))
        assert [r.status_code for r in during] == [200] * 8, [r.text for r in during]
        results = await asyncio.gather(*streams)
    failed = 0
    for events in results:
        assert events[-1] == "[DONE]"  # every stream ends properly, cut or not
        errors = [json.loads(e)["error"] for e in events[:-1] if e.startswith('{"error"')]
        if errors:
            failed += 1
            assert errors[0]["code"] == "engine_unavailable" and errors[0]["type"] == "server_error"
            assert "retry" in errors[0]["message"]
        else:
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length"
    assert failed == on_victim  # exactly the victim's streams (the other replica's completed, above)
    await await_until(lambda: running_replicas() == 2, timeout_s=120, interval_s=0.5,
                      what="Serve replacing the replica")
