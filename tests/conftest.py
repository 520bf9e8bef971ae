"""Shared fixtures: Ray and Serve start once per test session; the OpenAI app deploys once.

Use `ray_serve` for a running Ray + Serve (HTTP on a free 127.0.0.1 port) and `serve_app` for
the default application (embedded tiny model) with its base URL and a handle to the engine
replicas. Both live for the whole session; nothing is started for tests that need neither.

Tests never sleep against a limit or time themselves: they wait for a condition with the
`wait_until` / `await_until` fixtures (up to WAIT_S, then the test fails naming the condition),
or inject a clock where the code takes one. `ray_serve.scrape()` reads Ray's metrics export.

Tiers: every test carries exactly one tier marker, the most it needs, in this order (registered,
with their descriptions, in pyproject.toml; docs/testing.md has their counts and times):

    unit        pure logic: no Ray, no model files, no process of its own  (`make test-fast`)
    engine      an embedded test model (embedded:tiny / :mid) or its tokenizer, in this process
    serve       the session's Ray + Serve (`ray_serve`, `serve_app`, `extra_app`, `client` ...)
    process     starts processes of its own: a server on its own Ray, the CLI, an interpreter
    real_model  SmolLM2 (embedded:smollm2): its weights or even only its tokenizer (a cold cache
                converts the whole model first)

A new test file sets `pytestmark = pytest.mark.<tier>` below its imports; a file whose tests
need different things marks each test instead (`@pytest.mark.<tier>`), never both. Collection
stops with an error naming any test without exactly one tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Small budgets keep the session fast on 2 cores; they are still real limits the tests hit.
TEST_APP_ARGS: dict[str, Any] = {
    "model": "embedded:tiny",
    "engine": {
        "max_batch_prefill_tokens": 256,
        "max_batch_total_tokens": 1536,  # below the 2048 context: the KV limit is reachable
        "max_num_seqs": 64,
        # No queue deadline (the default), so the queue bound is max_queued_tokens. With one, the
        # bound follows the measured drain rate, and a CPU-starved pass reads as a stalled queue
        # (bound 0: only an empty queue admits). Deadlines are tested on apps of their own.
        "tbt_slo_ms": 5_000,  # metrics count tokens within it; no autoscaling (no max_replicas)
    },
    "replica": {"max_queued_tokens": 16_384},
    "num_cpus": 1,
    "ingress_num_cpus": 0.1,
    "max_body_bytes": 64 * 1024,
}
RAY_NUM_CPUS = 4
# How long a poll may wait for its condition. Generous on purpose: CI is a busy 2-core machine,
# and a poll returns as soon as the condition holds, so this only bounds a hang.
WAIT_S = 60.0

T = TypeVar("T")


def tiers(config: pytest.Config) -> list[str]:
    """The tier markers: those pyproject.toml registers with a description starting "tier:"."""
    lines = (line.split(":", 2) for line in config.getini("markers"))
    return [parts[0].strip() for parts in lines if len(parts) == 3 and parts[1].strip() == "tier"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run a collection in which a test has no tier marker, or more than one; then
    move the modules that use the session's Ray + Serve (`ray_serve`) to the end, in their
    order. That instance lives until the session ends and, idle with its app, takes ~20% of a
    core (Serve's controller, the replicas' reports, Ray's agent): started last, it runs beside
    its own tests only, not beside the model and process tests."""
    check_tiers(config, items)
    on_serve = {item.path for item in items if "ray_serve" in getattr(item, "fixturenames", ())}
    items[:] = sorted(items, key=lambda item: item.path in on_serve)  # stable: order kept within


def check_tiers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test has exactly one tier marker (a usage error names those that do not)."""
    names = tiers(config)
    wrong: dict[tuple[str, str], list[str]] = {}  # (file, tiers found) -> tests
    for item in items:
        found = sorted({m.name for m in item.iter_markers() if m.name in names})
        if len(found) != 1:
            file, _, test = item.nodeid.partition("::")
            wrong.setdefault((file, " + ".join(found) or "no tier"), []).append(test)
    if wrong:
        lines = [f"  {file}: {what} on {len(tests)} test(s), e.g. {tests[0]}"
                 for (file, what), tests in sorted(wrong.items())]
        raise pytest.UsageError(
            f"every test needs exactly one tier marker ({', '.join(names)}):\n" + "\n".join(lines)
            + "\nset `pytestmark = pytest.mark.<tier>` in the file, or mark each test of a mixed file;"
              " tests/conftest.py's docstring says which tier is which")


def poll(cond: Callable[[], T], timeout_s: float = WAIT_S, interval_s: float = 0.05,
         what: str = "the condition") -> T:
    """Call `cond()` until it returns something truthy and return that; fail the test after
    `timeout_s`. Tests get it as the `wait_until` fixture."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout_s:.0f} s (last: {value!r})")
        time.sleep(interval_s)
    return value


async def apoll(cond: Callable[[], T | Awaitable[T]], timeout_s: float = WAIT_S,
                interval_s: float = 0.05, what: str = "the condition") -> T:
    """`poll` for async tests: `cond()` may return an awaitable. The `await_until` fixture."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout_s:.0f} s (last: {value!r})")
        await asyncio.sleep(interval_s)


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., Any]:
    """`wait_until(cond, what=...)`: see `poll` (test modules cannot import this conftest)."""
    return poll


@pytest.fixture(scope="session")
def await_until() -> Callable[..., Any]:
    """`await await_until(cond, what=...)`: see `apoll`."""
    return apoll


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Metrics:
    """One scrape of a Prometheus text exposition: {(name, labels): value}."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for line in text.splitlines():
            m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$', line)
            if not m or line.startswith("#"):
                continue
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            samples[(m.group(1), labels)] = float(m.group(3))
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """The sum over every series of `name` that carries `labels` (among others)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)


@dataclass
class RayServe:
    """A running Ray + Serve instance; applications are added with `serve.run`."""

    http_port: int
    metrics_port: int  # Ray's Prometheus export port (ray_-prefixed metrics of every process)

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.http_port}{route_prefix}"

    def scrape(self) -> Metrics:
        """Every process's metrics as Ray exports them now (each process reports every ~1 s)."""
        import httpx

        return Metrics.parse(httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=60).text)


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
            # Not waited for: an idle replica's graceful shutdown takes Serve's wait loop (2 s) and
            # more, and no test looks at an app after it; one that needs the CPUs it held waits
            # for them when it deploys.
            serve.delete(name, _blocking=False)

    return deploy
