"""Shared fixtures: Ray and Serve start once per test session; the OpenAI app deploys once.

Use `ray_serve` for a running Ray + Serve (HTTP on a free 127.0.0.1 port) and `serve_app` for
the default application (embedded tiny model) with its base URL and a handle to the engine
replicas. Both live for the whole session; nothing is started for tests that need neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Small budgets keep the session fast on 2 cores; they are still real limits the tests hit.
TEST_APP_ARGS: dict[str, Any] = {
    "model": "embedded:tiny",
    "max_batch_prefill_tokens": 256,
    "max_batch_total_tokens": 1536,  # below the 2048 context: the KV limit is reachable
    "max_num_seqs": 64,
    "max_queued_tokens": 16_384,
    "tbt_slo_ms": 5_000,  # metrics count tokens within it; no autoscaling (no max_replicas)
    "num_cpus": 1,
    "ingress_num_cpus": 0.1,
    "max_body_bytes": 64 * 1024,
}
RAY_NUM_CPUS = 4


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayServe:
    """A running Ray + Serve instance; applications are added with `serve.run`."""

    http_port: int
    metrics_port: int  # Ray's Prometheus export port (ray_-prefixed metrics of every process)

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.http_port}{route_prefix}"


@dataclass
class ServeApp:
    """The deployed default app: its base URL, args, and a handle to the engine replicas."""

    base_url: str
    args: Any  # app.args.AppArgs
    llm: Any  # ray.serve.handle.DeploymentHandle to LLMServer

    def load(self) -> dict[str, Any]:
        """The replica's load report (call from sync code)."""
        return self.llm.load.remote().result()

    async def aload(self) -> dict[str, Any]:
        """The replica's load report (call from async code)."""
        return await self.llm.load.remote()

    async def wait_idle(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Poll until nothing runs or waits and every KV block is free; returns the last report."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = await self.aload()
            if is_idle(load) or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.05)


def is_idle(load: dict[str, Any]) -> bool:
    return (load["num_running"] == 0 and load["num_waiting"] == 0
            and load["free_blocks"] == load["total_blocks"])


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[RayServe]:
    """Ray (local, RAY_NUM_CPUS logical CPUs) and Serve with HTTP on a free local port."""
    import ray
    from ray import serve

    # address="local": always a fresh instance, never a cluster some `ray start` left running.
    metrics_port = free_port()
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False,
             configure_logging=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield RayServe(port, metrics_port)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_serve: RayServe) -> ServeApp:
    """The OpenAI app (TEST_APP_ARGS) deployed once as Serve app "default" at route "/"."""
    from ray import serve

    from app.args import AppArgs
    from app.builder import LLM_DEPLOYMENT, build_app

    args = AppArgs.model_validate(TEST_APP_ARGS)
    serve.run(build_app(args), name="default", route_prefix="/")
    llm = serve.get_deployment_handle(LLM_DEPLOYMENT, app_name="default")
    return ServeApp(ray_serve.url(), args, llm)



@pytest.fixture(scope="session")
def extra_app(ray_serve: RayServe) -> Callable[[str, dict[str, Any]], contextlib.AbstractContextManager[str]]:
    """`with extra_app(name, args) as url:` deploys another app on the session's Serve at
    route `/<name>` and deletes it afterwards."""
    from ray import serve

    from app.builder import build_app

    @contextlib.contextmanager
    def deploy(name: str, args: dict[str, Any]) -> Iterator[str]:
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        try:
            yield ray_serve.url(f"/{name}")
        finally:
            serve.delete(name)

    return deploy
