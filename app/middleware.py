"""ASGI middleware that refuses oversized or stalled request bodies, and requests over the ingress's
in-flight limit, before anything parses them; and counts responses."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import OpenAIError
from app.memory import trim_when_idle
from app.stream_limit import StreamLimit, watch_loop

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyLimitMiddleware:
    """Answer 413 when a body is larger than `app.state.max_body_bytes`, 408 when the client
    stops sending it for `app.state.body_timeout_s` (between two of its chunks).

    Also stamps the request's arrival (`arrival_time`) before anything else reads it: the queue
    deadline and TTFT count from there.

    A declared Content-Length over the limit is refused at once, unread; otherwise the body
    is read up to the limit (chunked uploads too) and replayed to the app, so a client
    cannot make the server buffer more than the limit, nor hold a request open by stalling.
    """

    def __init__(self, app: ASGIApp, default_limit: int = DEFAULT_MAX_BODY_BYTES,
                 default_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.default_limit = default_limit
        self.default_timeout_s = default_timeout_s

    def _limit(self, scope: Scope) -> int:
        state = getattr(scope.get("app"), "state", None)
        return int(getattr(state, "max_body_bytes", self.default_limit))

    def _timeout_s(self, scope: Scope) -> float:
        state = getattr(scope.get("app"), "state", None)
        return float(getattr(state, "body_timeout_s", self.default_timeout_s))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVED_AT] = time.time()
        limit = self._limit(scope)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await refuse(send, _too_large(limit))
            return
        timeout_s = self._timeout_s(scope)
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                await refuse(send, OpenAIError(408, f"the request body stalled: nothing arrived for "
                                                f"{timeout_s:g} s (body_timeout_s)", code="request_timeout"))
                return
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await refuse(send, _too_large(limit))
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


ARRIVED_AT = "stallfree_arrived_at"


def arrival_time(request: Any) -> float:
    """When `BodyLimitMiddleware` first saw this request (time.time()); now if it did not."""
    return float(request.scope.get("state", {}).get(ARRIVED_AT, time.time()))


RETRY_COUNT_HEADER = "x-stainless-retry-count"  # OpenAI's SDKs: which try of a request this is (0: the first)


def is_client_retry(scope: Scope) -> bool:
    """Whether the client says this request (its ASGI scope: header names lower case) is a retry
    (`RETRY_COUNT_HEADER` above 0): its refusal was counted as demand the first time
    (`autoscale.demand`)."""
    name = RETRY_COUNT_HEADER.encode()
    for key, value in scope.get("headers", ()):
        if key == name:
            try:
                return int(value) > 0
            except ValueError:
                return False
    return False


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then the client's later messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the limit of {limit} bytes (max_body_bytes)",
                       code="request_too_large")


async def refuse(send: Send, err: OpenAIError) -> None:
    """Answer with `err` directly (nothing downstream sees the request)."""
    body = json.dumps(err.body()).encode()
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    if err.status_code == 408:
        headers.append((b"connection", b"close"))
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
QUIET_IN_FLIGHT = 2  # at most this many in flight: quiet enough to give memory back
# On a generation response's start, from the ingress: milliseconds from its in-flight limit seeing
# the request to that start. The proxy's door takes it off the time it waited for the start and
# so learns how long the way to the ingress took (`proxy_door.Pending.hop`), which no clock shared
# between the two processes tells.
INGRESS_MS_HEADER = b"x-stallfree-ingress-ms"


def _stamped(send: Send) -> Send:
    """`send` with the response's start stamped with the milliseconds since now (`INGRESS_MS_HEADER`)."""
    seen = time.perf_counter()

    async def stamped(message: Message) -> None:
        if message["type"] == "http.response.start":
            ms = str(round(1000 * (time.perf_counter() - seen))).encode()
            message = {**message, "headers": [*message.get("headers", ()), (INGRESS_MS_HEADER, ms)]}
        await send(message)

    return stamped


class StreamLimitMiddleware:
    """Refuse a generation request with 429 before its body is read when `limit`
    (`app.stream_limit`) already has its limit of requests in flight; count the admitted ones
    until their response has ended (a stream's last byte, or its client gone). Starts the
    event-loop watcher that drives the limit on the first request it sees, and the trim that gives
    memory back once (almost) nothing is in flight (`app.memory`).

    `limit` None: the ingress's, `app.state.stream_limit` (None there: no limit). `where` names
    the process in the refusal ("ingress", "proxy"). Generation routes are matched by their
    ending, so they are found under any route prefix (the proxy sees the whole path). At the
    ingress, each generation response's start carries its milliseconds there (`INGRESS_MS_HEADER`).
    """

    def __init__(self, app: ASGIApp, limit: StreamLimit | None = None, where: str = "ingress") -> None:
        self.app = app
        self.limit, self.where = limit, where
        self._watch: asyncio.Task[None] | None = None
        self._trim: asyncio.Task[None] | None = None  # held: the loop keeps only weak task references

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit
        if limit is None:
            limit = getattr(getattr(scope.get("app"), "state", None), "stream_limit", None)
        if limit is None or scope["type"] != "http" or not scope.get("path", "").endswith(GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        if self._watch is None or self._watch.done():
            loop = asyncio.get_running_loop()
            self._watch = loop.create_task(watch_loop(limit.observe, time.perf_counter))
            self._trim = loop.create_task(trim_when_idle(lambda: limit.in_flight <= QUIET_IN_FLIGHT))
        if not limit.admits():
            retry = limit.refuse(is_client_retry(scope))
            await refuse(send, OpenAIError(
                429, f"the server is at capacity: {limit.in_flight} requests are in flight at this "
                f"{self.where}, its limit is {limit.limit} (it adapts to what the {self.where} relays "
                f"without falling behind: its event loop lags {1000 * limit.state.lag_s:.0f} ms, target "
                f"{1000 * limit.target_s:.0f} ms); retry after {retry} s", code="rate_limit_exceeded",
                headers={"Retry-After": str(retry),
                         **({INGRESS_MS_HEADER.decode(): "0"} if self.where == "ingress" else {})}))
            return
        limit.enter()
        try:
            await self.app(scope, receive, send if self.where != "ingress" else _stamped(send))
        finally:
            limit.leave()


class StatusCountMiddleware:
    """Count responses by route and status code (`stallfree_http_responses_total`).

    Outermost, so refusals made by other middleware (413) are counted too. The Ray counter is
    made on first use, inside the Serve replica, never at import time.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._counter: Any = None

    def _count(self, path: str, status: int) -> None:
        if self._counter is None:
            try:
                from replicas.serving.metric_backends import RayBackend
                from replicas.serving.metrics import PREFIX
                self._counter = RayBackend().counter(
                    PREFIX + "http_responses_total", "HTTP responses by route and status code.",
                    ("route", "status_code"))
            except Exception:  # no Ray here (unit tests): count nothing
                self._counter = False
        if self._counter:
            self._counter.record(1, {"route": path, "status_code": str(status)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._count(scope.get("path", ""), int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)
