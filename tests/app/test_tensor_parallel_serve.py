"""A tensor-parallel replica under Serve (tensor_parallel_size 2 on CPU: the replica and one
worker actor, each on a bundle of the replica's placement group): it streams; a worker killed
mid-stream ends the stream with an in-band `engine_unavailable` error event and `[DONE]` (never
a hang), and Serve replaces the replica and its group."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.serve

APP = "tp"
TP_APP_ARGS = {"model": "embedded:tiny", "served_model_name": "tiny-tp", "num_replicas": 1, "num_cpus": 0.5,
               "ingress_num_cpus": 0.1, "engine": {"tensor_parallel_size": 2, "max_batch_total_tokens": 4096}}


@pytest.fixture(scope="module")
def tp_url(extra_app) -> Iterator[str]:  # noqa: ANN001 - tests/conftest.py
    with extra_app(APP, TP_APP_ARGS) as url:
        yield url


def worker_pids() -> list[int]:
    """The processes of this app's tensor-parallel worker actors (no other app runs one)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"ray::_RayWorker" in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def healthy(client: httpx.Client) -> dict | None:
    try:
        health = client.get("/health").json()
    except (httpx.HTTPError, ValueError):
        return None
    return health if health.get("status") == "ok" else None


def test_a_tp2_replica_streams_and_survives_a_worker_killed_mid_stream(tp_url: str, wait_until) -> None:  # noqa: ANN001
    with httpx.Client(base_url=tp_url, timeout=120) as client:
        health = wait_until(lambda: healthy(client), timeout_s=120, what="the TP=2 replica healthy")
        assert health["runner"]["tensor_parallel_size"] == 2
        [first] = wait_until(worker_pids, what="the worker actor running")
        body = {"prompt": [7] * 16, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        events, killed_at = [], None
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:
                    os.kill(first, signal.SIGKILL)
                    killed_at = time.monotonic()
        ended_after_s = time.monotonic() - killed_at
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
        print(f"stream ended {ended_after_s:.2f} s after the kill, {len(events)} events")
        wait_until(lambda: healthy(client) and (pids := worker_pids()) and first not in pids,
                   timeout_s=120, interval_s=0.5, what="Serve replacing the replica and its worker")
        print(f"healthy again {time.monotonic() - killed_at:.1f} s after the kill")
        done = client.post("/v1/completions", json={"prompt": [9] * 8, "max_tokens": 4, "ignore_eos": True})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
