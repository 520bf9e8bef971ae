"""The engine's own gauges (KV usage, running and waiting requests), read from `/metrics`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from loadtests.harness import metrics_text

GAUGE_SETTLE_S = 25.0  # re-read busy engine gauges this long (Ray exports every ~10 s)
ENGINE_GAUGES = ("ray_stallfree_kv_cache_usage_perc", "ray_stallfree_num_requests_running",
                 "ray_stallfree_num_requests_waiting", "ray_stallfree_token_load")


def engine_gauges(text: str) -> dict[str, float]:
    """The engine gauges of LLMServer replicas: KV usage as the max over replicas, others summed."""
    out: dict[str, float] = {}
    for name, labels, value in metrics_text.samples(text, ENGINE_GAUGES):
        if labels.get("deployment", "LLMServer") != "LLMServer":
            continue
        name = name.removeprefix("ray_stallfree_")
        merge = max if name == "kv_cache_usage_perc" else (lambda a, b: a + b)
        out[name] = merge(out[name], value) if name in out else value
    return out


async def engine_state(url: str) -> dict[str, Any]:
    """The engine's gauges from a Prometheus endpoint (the app's own `/metrics` unless told
    another), or why they are unmeasured.

    Ray exports a replica's metrics about every 10 s, so a reading that still shows running or
    waiting requests is read again every 2 s for up to GAUGE_SETTLE_S: a stale export clears,
    a stuck request does not."""
    deadline = time.monotonic() + GAUGE_SETTLE_S
    readings: list[dict[str, float]] = []
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            try:
                gauges = engine_gauges((await c.get(url)).text)
            except httpx.HTTPError as exc:
                return {"measured": False, "why": f"{url}: {type(exc).__name__}", "url": url}
            readings.append(gauges)
            busy = gauges.get("num_requests_running", 0) or gauges.get("num_requests_waiting", 0)
            if not gauges or not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(2.0)
    if not gauges:
        return {"measured": False, "why": f"{url} has no stallfree gauges", "url": url}
    return {"measured": True, "url": url, "readings": len(readings), **gauges}
