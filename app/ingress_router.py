"""The replica choice in Ray's HAProxy mode: HAProxy asks this deployment which engine replica
serves a request, and the app's router (`TokenLoadRouter`) answers.

In HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`) with engine replicas serving HTTP themselves
(`ingress_in_replica`), HAProxy forwards each connection straight to a replica's own HTTP server.
By itself it balances them by least connections, and Serve refuses a custom router on such a
deployment. Ray 2.60's answer, which Ray Serve LLM's direct streaming uses, is an ingress request
router: a deployment that serves `POST /internal/route`; HAProxy's Lua action calls it before it
forwards a request and pins the request to the replica it names (`replica_id`, with the host and
port of that replica's server). Here that deployment asks the engine deployment's handle to
choose (`choose_replica`, no slot reserved: the request itself goes through HAProxy), so the
same router ranks the replicas by predicted token load (or TTFT) as on every other path.

The request's cost: HAProxy sends the body only where `RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`
(Ray's switch; off by default, as reading it delays the request). With a body, the prompt (text
at 4 characters a token, or token ids) and `max_tokens` / `n` are the cost, as the ingress's
handle call would carry them; without one the request is costed as Serve's proxy costs a body it
has not read (the replicas' mean tokens per running request).

The builder attaches it where asked (`ingress_router: true`) and a choice exists (more than one
replica, or autoscaling); otherwise HAProxy balances by least connections. Opt-in: under a 10x
overload on 2 cores with two replicas, requests waited for their route in HAProxy before any
door saw them (429 p99 16.8 s, TTFT p99 17 s, against 0.6 and 1.3 s with least connections);
and before this router raised its own priority, HAProxy timed out on its calls and answered 503.

It runs its handler and its handle's router on its HTTP server's own event loop
(`app.builder.ONE_LOOP_RUNTIME_ENV`): by Serve's defaults a call crossed three event loops and a
thread pool, 1.1 ms of CPU; on one loop 0.47 ms.
"""

# No `from __future__ import annotations`: FastAPI reads the handler's `Request` annotation at runtime.
import logging
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from replicas.serving.priority import serve_at_full_priority
from replicas.serving.startup_gc import freeze_startup_objects

logger = logging.getLogger(__name__)

ROUTE_PATH = "/internal/route"  # what HAProxy's Lua action posts to (Ray's contract)
INGRESS_ROUTER_DEPLOYMENT = "IngressRouter"
UNREAD = b""  # the first argument of a request whose body the router did not get (TokenLoadRouter._cost)

route_api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


def routing_args(body: bytes) -> tuple[Any, ...]:
    """What `choose_replica` gets for a request body: `(prompt, {"max_tokens", "n"})`, the shape
    of the engine's `generate` call the router costs; `(UNREAD,)` for an empty body or one
    without a prompt (not forwarded, cut short, not JSON)."""
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return (UNREAD,)
    if not isinstance(data, dict):
        return (UNREAD,)
    prompt = data.get("prompt")
    if prompt is None and isinstance(data.get("messages"), list):
        prompt = "".join(_text_of(message.get("content")) for message in data["messages"] if isinstance(message, dict))
    if not prompt:
        return (UNREAD,)
    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    return prompt, {"max_tokens": max_tokens, "n": data.get("n", 1)}


def _text_of(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and isinstance(part.get("text"), str))
    return ""


def route_answer(replica_id: str, endpoint: tuple[str, int] | None) -> dict[str, Any]:
    """The answer HAProxy's Lua action reads: the replica's full id and its HTTP server."""
    if endpoint is None:
        raise RuntimeError(f"replica {replica_id} has no HTTP server of its own")
    host, port = endpoint
    return {"host": host, "port": port, "replica_id": replica_id}


class ReplicaChoice:
    """The router's work, apart from HTTP: a request body in, the chosen replica's answer out."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self._replicas = replicas
        self.routed = 0  # requests answered

    async def answer(self, body: bytes) -> dict[str, Any]:
        """Which replica serves a request with this body. Raises `NoReplica` when none can be named."""
        try:
            async with self._replicas.choose_replica(*routing_args(body), _reserve=False) as selection:
                replica = selection._replica  # Ray's own direct-streaming router reads it the same way
                answer = route_answer(replica.replica_id.to_full_id_str(), replica.backend_http_endpoint)
        except (RuntimeError, DeploymentUnavailableError) as exc:
            raise NoReplica(str(exc)) from exc
        self.routed += 1
        return answer


class NoReplica(Exception):
    """No engine replica to name (none running, or one without an HTTP server of its own)."""


@serve.ingress(route_api)
class IngressRouter:
    """`POST /internal/route`: which engine replica serves this request (HAProxy pins it there)."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        # HAProxy waits on every call: at Ray's worker nice 15 beside busy engines it starved
        # (a plain `serve run`), and HAProxy's Lua timed out on answers sent late (503s).
        serve_at_full_priority(logger, "the ingress request router")
        self._choice = ReplicaChoice(replicas)
        freeze_startup_objects(logger, "the ingress request router")

    @route_api.post(ROUTE_PATH)
    async def route(self, request: Request) -> dict[str, Any]:
        try:
            return await self._choice.answer(await request.body())
        except NoReplica as exc:  # HAProxy answers any non-200 with a 503 of its own
            raise HTTPException(status_code=503, detail=str(exc)) from exc

    @route_api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "routed": self._choice.routed}
