"""The engine replica as its own HTTP ingress (`ingress_in_replica: true`): one Ray hop per request
and per streamed event instead of two.

By default a request crosses two Serve deployments: Serve's proxy hands it to an `OpenAIIngress`
replica (FastAPI: validation, tokenization, admission, SSE), which calls an engine replica
(`LLMServer`) through a handle and relays each delta back. Each hop costs Python on both sides per
request and per streamed item (docs/results/http_path.md). Here each engine replica runs the
ingress's FastAPI app itself, calling its own `LLMServer` in process through `LocalHandle` (the
few handle methods the ingress uses), so the proxy routes straight to an engine replica and the
deltas go from the engine to the HTTP response on one event loop, as Ray Serve LLM's direct
streaming and vLLM's API server (engine and HTTP in one process) do.

What is the same: the OpenAI routes and shapes, the proxy's door, the ingress's in-flight limit,
demand counting, the replica's own admission, disconnects freeing KV, /health and /metrics. The
token gate decides on this replica's own queue (`ReplicaIngress._admission_gate`), not on the
fleet's as the controller shows it: the request is served here or refused. What differs: the proxy chooses the replica without the
request's prompt (it routes before reading the body), so by the replicas' reported token load
alone, no prefix or prompt-size ranking: Serve's proxy with the app's router
(`TokenLoadRouter`), Ray's HAProxy by least connections, on weights these replicas set from the
same loads where `haproxy_weight_interval_ms` asks (`autoscale.haproxy_weights`); and a request whose replica dies is not retried on another one (there is
no ingress in between to resend it): it fails with a server error, which clients retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from app import proxy_door
from app.admission import AdmissionGate, controller_fetch
from app.http_path import proxy_kind
from app.ingress import OpenAIIngress
from autoscale.demand import Demand
from autoscale.haproxy_weights import WeightPusher, admin_socket, node_admin_socket_path
from autoscale.keys import current_replica_key, deployment_key_of
from autoscale.reporter import LoadReporter
from replicas.serving.deployment import LLMServer

logger = logging.getLogger(__name__)

# The class Serve's `@serve.ingress(api)` built (routes on the shared FastAPI app): subclassed below.
_IngressClass = OpenAIIngress.func_or_class


class LocalStream:
    """A call of `LLMServer.generate` in this process, as the ingress reads a handle's streaming
    response: an async iterator with `cancel()` (which closes the generator: its `finally` aborts
    the request and frees its KV blocks)."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._gen = gen
        self._closing: asyncio.Task | None = None

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._gen.aclose())


class _LocalMethod:
    def __init__(self, fn: Callable[..., Any], stream: bool) -> None:
        self._fn, self._stream = fn, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return LocalStream(self._fn(*args, **kwargs))
        return self._call(*args, **kwargs)

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class LocalHandle:
    """The part of a `DeploymentHandle` to `LLMServer` that the ingress uses, calling an
    `LLMServer` in this process: `generate` (streaming), `model_info`, `check_health`."""

    def __init__(self, server: LLMServer, app_name: str | None, deployment_name: str, stream: bool = False) -> None:
        self.server, self.app_name, self.deployment_name, self._stream = server, app_name, deployment_name, stream

    def options(self, stream: bool = False, **_: Any) -> LocalHandle:
        return LocalHandle(self.server, self.app_name, self.deployment_name, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        if name not in ("generate", "model_info", "check_health"):
            raise AttributeError(name)
        return _LocalMethod(getattr(self.server, name), self._stream and name == "generate")


class ReplicaIngress(_IngressClass):
    """An engine replica that serves the OpenAI API itself: `LLMServer` plus the ingress's app."""

    start_attempts = 1  # no other replica to resend to from here: a dead engine fails the request

    async def __init__(self, config: Any, args: Any, reporter_factory: Callable[[], Any] | None = None) -> None:
        from ray import serve

        # The model loads off the event loop: Serve's own calls to the replica go on meanwhile.
        self.server = await asyncio.to_thread(LLMServer, config, reporter_factory=reporter_factory)
        try:
            context = serve.get_replica_context()
            app_name, deployment = context.app_name, context.deployment
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            app_name, deployment = None, "LLMServer"
        await super().__init__(LocalHandle(self.server, app_name, deployment), args)
        # Its demand counters ride on no controller read (`_admission_gate`): they go with the
        # replica's load reports, through the node relays (one flush a node, not a call a replica),
        # and so do those of the door in this replica's own HTTP server (HAProxy mode). A replica
        # with no reporter tells the controller nothing, its demand included.
        self._demand_of = (deployment_key_of(app_name, deployment), self._demand_source())
        if isinstance(self.server.reporter, LoadReporter):
            self.server.reporter.demand = self._demand_due
        # Behind HAProxy, its least connections steered by the replicas' token load.
        self.weights: WeightPusher | None = None
        self._weights_task: asyncio.Task[None] | None = None
        if args.haproxy_weights() and proxy_kind() == "haproxy":
            path = node_admin_socket_path()
            self.weights = WeightPusher(
                controller_fetch(args.controller_name, args.controller_namespace, app_name, deployment),
                admin_socket(path), interval_s=args.haproxy_weight_interval_ms / 1000, me=current_replica_key())
            self._weights_task = asyncio.get_running_loop().create_task(self.weights.run())
            logger.info("HAProxy weights from the replicas' token load every %d ms, through %s",
                        args.haproxy_weight_interval_ms, path)

    def _admission_gate(self, llm: Any, args: Any) -> AdmissionGate:
        """No fleet view: every request that reaches this replica is served here (the proxy
        chose the replica before the body was read, and nothing sends it on), so the door is this
        replica's own queue bound, which `LLMServer` applies in process, exactly, before the engine
        sees the request (`LLMServer._admit`). A view of the fleet's queues would admit a request
        to this full queue because others have room, and cost a controller read every refresh
        (up to 20 a second) on every replica: 20,000 reads a second for 1,000 busy replicas."""
        return AdmissionGate(None)

    def _demand_due(self, now: float) -> list[Demand]:
        """The demand counters due to ride with the load report going now (`LoadReporter.demand`):
        the ingress's, and those of the doors serving HTTP in this process, which leave theirs to it."""
        key, source = self._demand_of
        counts = self._demand_counts(now)
        due = [] if counts is None else [(key, source, counts)]
        for door in proxy_door.doors_here():
            door.carried = True
            if (entry := door.demand_due(now)) is not None:
                due.append(entry)
        return due

    def _http_path_state(self) -> dict[str, Any]:
        return {"weights": self.weights.state() if self.weights is not None else None}

    # Serve's hooks on the deployment class (the engine's health and autoscaling metrics), and
    # the engine replica's load report, as `LLMServer` answers them.
    def load(self) -> Any:
        return self.server.load()

    def check_health(self) -> dict[str, Any]:
        return self.server.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.server.record_autoscaling_stats()

    async def __del__(self) -> None:  # Serve awaits it on graceful shutdown (the ASGI app's too)
        task = getattr(self, "_weights_task", None)
        if task is not None:
            task.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
        await super().__del__()
