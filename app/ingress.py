"""FastAPI ingress deployment: OpenAI routes, tokenization at the edge, SSE streaming.

The ingress tokenizes once (chat template included), builds the typed `SamplingParams` (its
ranges checked once, here) and sends both to a replica, which checks what only it knows (context
length, KV capacity, its queue) once, before queueing; its refusals come back as 4xx. Each
generation is a streaming handle call whose first item is the replica's acknowledgement,
so refusals (400, 429) are answered before a 200 and SSE headers are sent.
"""

# No `from __future__ import annotations` here: FastAPI must see the real types of the
# route parameters of a Serve ingress class. Serve pickles the class when it is decorated,
# so every module-level name its methods use is defined above it.
import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from pydantic import BaseModel
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app import prometheus, proxy_door
from app.admission import AdmissionGate, controller_fetch
from app.args import AppArgs
from app.errors import RETRY_AFTER_OVERLOAD_S, OpenAIError, from_exception, install_handlers, replica_gone
from app.http_path import proxy_kind
from app.proxy_door import CALLBACK_ENV, IMPORT_PATH, PASSED_HEADER
from app.middleware import (BodyLimitMiddleware, StatusCountMiddleware, StreamLimitMiddleware, arrival_time,
                            is_client_retry)
from app.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                         CompletionResponse, GenerationRequest, ModelCard, ModelList)
from app.stream_limit import StreamLimit, limit_observer
from app.streaming import (DONE, Gathered, StreamMeta, chat_events, chat_response, collect,
                           completion_events, completion_response, sse)
from autoscale.keys import deployment_key_of
from autoscale.demand import DemandCounter, DemandCounts
from replicas.loading.model_files import load_tokenizer
from replicas.protocol import ReplicaUnhealthyError, RequestRejected
from replicas.serving.priority import serve_at_full_priority
from replicas.serving.startup_gc import freeze_startup_objects, gc_state
from replicas.serving.serve_logs import use_serve_log

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
START_ATTEMPTS = 3  # a request no replica has started is sent again when its replica died
RETRY_BACKOFF_S = 0.2
ACK_SLACK_S = 1.0  # beyond the queue deadline, time allowed to reach a replica

api = FastAPI(title="stallfree-serve", description="OpenAI-compatible LLM serving on Ray Serve")
install_handlers(api)
api.add_middleware(BodyLimitMiddleware)
api.add_middleware(StreamLimitMiddleware)  # outside the body limit: refuses before reading a body
api.add_middleware(StatusCountMiddleware)  # added last: outermost


async def _chain(first: Any, rest: DeploymentResponseGenerator) -> AsyncIterator[Any]:
    """The replica's stream with its first output (already awaited) put back in front."""
    yield first
    async for item in rest:
        yield item


def _cancel(gen: DeploymentResponseGenerator) -> None:
    """Cancel a handle call, best effort. Serve's `cancel()` re-raises the call's own failure
    (a BackPressureError, a dead replica's error) when its router runs on another loop."""
    try:
        gen.cancel()
    except Exception as exc:  # the call already failed or ended: nothing left to cancel
        logger.debug("cancel of a finished handle call: %r", exc)


def _json(body: BaseModel) -> Response:
    """A whole response, written once: returned as a model, FastAPI would dump it and validate
    the dump against `response_model` again before writing it (the route keeps `response_model`
    for its OpenAPI schema)."""
    return Response(body.model_dump_json(), media_type="application/json")


def _replica_name() -> str:
    """This ingress replica's id under Serve; a fresh name outside it."""
    try:
        return str(serve.get_replica_context().replica_id)
    except Exception:  # noqa: BLE001 - not in a Serve replica (tests)
        return uuid.uuid4().hex[:8]


def _retryable(exc: BaseException) -> bool:
    """The replica died, or its engine loop did, before this request started: try another."""
    return isinstance(exc, ReplicaUnhealthyError) or (isinstance(exc, Exception) and replica_gone(exc))


async def _guarded(gen: DeploymentResponseGenerator, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Forward SSE events; a failure becomes an error event, a disconnect cancels the replica."""
    finished = False
    try:
        try:
            async for event in events:
                yield event
            finished = True
        except Exception as exc:  # headers are sent: report in-band, as vLLM does
            yield sse(from_exception(exc).body())
        yield DONE
    finally:
        if not finished:
            _cancel(gen)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(api)
class OpenAIIngress:
    """HTTP face of one model application; `llm` is the handle to the engine replicas."""

    start_attempts = START_ATTEMPTS  # sends of a request whose replica died before it started

    def __init__(self, llm: DeploymentHandle, args: AppArgs) -> None:
        use_serve_log()
        self._niceness = serve_at_full_priority(logger, "the ingress")
        self._warned_door = False
        self.args = args
        self.llm = llm
        self.stream_llm = llm.options(stream=True)
        self.tokenizer = load_tokenizer(args.model, args.engine.trust_remote_code)
        self._info: dict[str, Any] | None = None
        # One thread: long prompts never block the event loop, and the tokenizer (not safe to
        # call from several threads at once) is only ever used from this one.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        proxy_door.publish(dataclasses.replace(
            args.proxy_door.settings(args.engine.tbt_slo_ms), controller_name=args.controller_name,
            controller_namespace=args.controller_namespace,
            deployment=deployment_key_of(getattr(llm, "app_name", None), getattr(llm, "deployment_name", "LLMServer"))))
        api.state.max_body_bytes = args.max_body_bytes
        api.state.body_timeout_s = args.body_timeout_s
        api.state.stream_limit = None
        if args.ingress_lag_target_ms is not None:
            limit = StreamLimit(args.ingress_max_ongoing_requests, target_s=args.ingress_lag_target_ms / 1000,
                                min_limit=min(args.ingress_min_requests, args.ingress_max_ongoing_requests),
                                clock=time.perf_counter)
            limit.on_step = limit_observer(limit, "ingress", logger)
            api.state.stream_limit = limit
        # Every request this ingress answers, served or refused (429), for the autoscaler's demand;
        # the in-flight limit's refusals go unsized (no body read).
        self.demand = DemandCounter()
        self.gate = self._admission_gate(llm, args)
        freeze_startup_objects(logger, "the ingress")

    def _admission_gate(self, llm: Any, args: AppArgs) -> AdmissionGate:
        """The token door over the engine replicas' queues, as the controller's routing view shows
        them (refreshed every 50 ms while requests come); the demand counters ride on its reads."""
        return AdmissionGate(controller_fetch(
            args.controller_name, args.controller_namespace, getattr(llm, "app_name", None),
            getattr(llm, "deployment_name", "LLMServer"),
            demand=(self._demand_source(), self._demand_counts)))

    def _demand_source(self) -> str:
        return f"ingress:{_replica_name()}"

    def _demand_counts(self, now: float) -> DemandCounts | None:
        limit = api.state.stream_limit
        return self.demand.to_send(now, unsized=limit.num_refused_demand if limit is not None else 0)

    # ---- routes ------------------------------------------------------------------------

    @api.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """200 when a replica's engine loop is alive, 503 otherwise. Its body also says whether
        the request came through the proxy door and the ingress's niceness: what a server started
        without them lacks under overload (README, 'On a Ray cluster'); and its garbage collector's
        state (replicas/serving/startup_gc.py)."""
        try:
            runner = await asyncio.wait_for(self.llm.check_health.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            return OpenAIError(503, f"unhealthy: {exc}", code="unhealthy").response()
        passed = request.headers.get(PASSED_HEADER.decode())
        door = json.loads(passed) if passed else None
        if door is None and self.args.proxy_door.enabled and not self._warned_door:
            self._warned_door = True
            logger.warning("requests reach this ingress without the proxy door: Serve was started "
                           "without %s=%s (serve_config.yaml's controller_options set it for a Serve "
                           "instance it starts; a running one keeps its own): overload is refused "
                           "late, by the ingress (README, 'On a Ray cluster')", CALLBACK_ENV, IMPORT_PATH)
        return JSONResponse({"status": "ok", "proxy_door": door, "niceness": self._niceness, "gc": gc_state(),
                             "runner": runner,
                             "http_path": {"proxy": proxy_kind(), "door": door and door.get("runs_in", "proxy"),
                                           **self._http_path_state()}})

    def _http_path_state(self) -> dict[str, Any]:
        """More of /health's `http_path`, from a subclass that serves HTTP another way."""
        return {}

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """This application's Prometheus series (replicas and ingress), from every node's Ray
        export, so a client needs no Ray metrics port (app/prometheus.py)."""
        app_name = getattr(self.llm, "app_name", None) or serve.get_replica_context().app_name
        return Response(await prometheus.scrape(app_name), media_type=prometheus.CONTENT_TYPE)

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        """The one served model, with its context length."""
        info = await self.model_info()
        card = ModelCard(id=self.args.name, created=int(time.time()), root=self.args.model,
                         max_model_len=info["max_model_len"])
        return ModelList(data=[card])

    @api.post("/v1/completions", response_model=CompletionResponse)
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        """Text completion of one prompt or a batch of them (text or token ids), `n` choices
        each; SSE when `stream` is true; with `echo`, each prompt's text (and, with `logprobs`,
        its tokens' logprobs) first."""
        arrived_at = arrival_time(request)
        self._check_model(body)
        prompts = body.prompts
        ids = [await self._tokenizing(self.tokenizer.encode, p, add_special_tokens=False)
               if isinstance(p, str) else list(p) for p in prompts]
        meta = self._meta("cmpl", body)
        gen, outputs = await self._start(meta.request_id, ids, body, body.max_tokens, arrived_at,
                                         is_client_retry(request.scope))
        echoes = None  # each prompt's text, in front of its completions
        if body.echo:  # token ids are decoded once the replica has accepted them (in its vocabulary)
            echoes = [p if isinstance(p, str) else await self._tokenizing(
                self.tokenizer.decode, i, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for p, i in zip(prompts, ids)]
        if body.stream:
            return self._sse(gen, completion_events(meta, outputs, echoes))
        return _json(completion_response(meta, await self._collect(gen, outputs, meta.n), echoes))

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        """Chat completion through the tokenizer's chat template; SSE when `stream` is true."""
        arrived_at = arrival_time(request)
        self._check_model(body)
        plan = body.tool_plan(self.args.tool_call_parser)  # InvalidRequestError -> 400
        ids = await self._tokenizing(self._render_chat, body)
        meta = self._meta("chatcmpl", body)
        gen, outputs = await self._start(meta.request_id, [ids], body, body.requested_max_tokens, arrived_at,
                                         is_client_retry(request.scope))
        if body.stream:
            return self._sse(gen, chat_events(meta, outputs, plan))
        return _json(chat_response(meta, await self._collect(gen, outputs, meta.n), plan))

    # ---- helpers -----------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """The model's limits, asked once: /v1/models shows its context length, which every
        replica derives from the same model and config (KV capacity may differ by replica, so
        nothing at the edge is derived from it)."""
        if self._info is None:
            self._info = await self.llm.model_info.remote()
        return self._info

    async def _tokenizing(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a tokenizer call (encode, decode, the chat template) on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    def _check_model(self, body: GenerationRequest) -> None:
        if body.model is not None and body.model not in (self.args.name, self.args.model):
            raise OpenAIError(404, f"The model `{body.model}` does not exist; this server serves "
                              f"`{self.args.name}`.", param="model", code="model_not_found")

    def _meta(self, prefix: str, body: GenerationRequest) -> StreamMeta:
        return StreamMeta(f"{prefix}-{uuid.uuid4().hex}", self.args.name, int(time.time()),
                          body.include_usage, body.continuous_usage, body.n)

    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        """Messages -> chat template text -> token ids (runs on the tokenizer thread)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                              param="messages", code="no_chat_template")
        messages = [m.for_template() for m in body.messages]
        try:  # templates that know tools (Hermes, Qwen, Llama 3.1, ...) render them
            text = self.tokenizer.apply_chat_template(messages, tools=body.template_tools(), tokenize=False,
                                                      add_generation_prompt=True)
        except (TemplateError, ValueError) as exc:  # the template refused these messages
            # (e.g. its raise_exception() on an unsupported role order): the client's to fix.
            # Anything else is a server fault and reaches the 500 handler with its traceback.
            raise OpenAIError(400, f"messages do not fit the chat template: {exc}",
                              param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _start(self, request_id: str, prompts: list[list[int]], body: GenerationRequest,
                     max_tokens: int | None, arrived_at: float,
                     retry: bool = False) -> tuple[DeploymentResponseGenerator, AsyncIterator[Any]]:
        """Admit at the door, send to a replica, and wait for its first output (or refusal).
        `prompts`: each prompt's token ids; a batch goes to one replica in one call (vLLM's
        engine takes it whole too), one prompt as its ids alone (`protocol.prompt_batch`).
        `retry`: the client says it is retrying this request (its demand was counted before).

        Nothing is committed to the client (no 200, no SSE headers) until the request has its
        first token, so a refusal found late (the queue deadline) is still a plain 429, and a
        request whose replica died before starting it is sent again, to another replica.
        """
        # max_tokens None (chat's default): the replica fills in what its context and KV leave.
        params = body.sampling_params(max_tokens)  # InvalidRequestError -> 400 naming the field
        num_prompt_tokens = sum(len(p) for p in prompts)
        demand = num_prompt_tokens + len(prompts) * (max_tokens or 0)  # what the autoscaler counts
        try:
            started = await self._send(request_id, prompts, params, body.priority, arrived_at, num_prompt_tokens)
        except OpenAIError as exc:
            # Refused here or downstream (429), or no replica could start it (503): demand the
            # fleet did not serve (and what a client's retry of it was counted against).
            if exc.status_code in (429, 503):
                self.demand.refused(demand, retry)
            raise
        self.demand.served(demand, retry)
        return started

    async def _send(self, request_id: str, prompts: list[list[int]], params: Any, priority: int,
                    arrived_at: float, num_prompt_tokens: int) -> tuple[DeploymentResponseGenerator, AsyncIterator[Any]]:
        """`_start` past the request's checks: admission, the replica call, its first output."""
        ids = prompts[0] if len(prompts) == 1 else prompts
        await self._admit(num_prompt_tokens)
        ticket = self.gate.admit(num_prompt_tokens)
        left_at = None  # when the first output left the replica's queue (its clock)
        try:
            attempts = self.start_attempts
            for attempt in range(1, attempts + 1):
                # A fresh id per attempt: a replica that is only unreachable may still hold the first.
                rid = request_id if attempt == 1 else f"{request_id}-retry{attempt - 1}"
                gen = self.stream_llm.generate.remote(ids, params, priority, rid, arrived_at)
                try:
                    first = await self._first_output(gen, ticket, arrived_at)
                except BaseException as exc:
                    _cancel(gen)
                    if attempt < attempts and _retryable(exc):
                        logger.warning("request %s: replica unavailable before it started (%s); "
                                       "retrying (%d/%d)", request_id, type(exc).__name__, attempt,
                                       attempts - 1)
                        self.gate.requeued(ticket)
                        await asyncio.sleep(RETRY_BACKOFF_S * attempt)
                        continue
                    if isinstance(exc, Exception):
                        raise from_exception(exc) from None
                    raise
                left_at = first.left_queue_at
                return gen, _chain(first, gen)
            raise AssertionError("unreachable")  # the last attempt returns or raises
        finally:
            self.gate.settle(ticket, left_at)

    async def _admit(self, num_prompt_tokens: int) -> None:
        """The door: 429 now, before any queue, when the replicas' queues have no room."""
        decision = await self.gate.decide(num_prompt_tokens)
        if not decision.admitted:
            retry = decision.retry_after_s or 1
            raise OpenAIError(
                429, f"the server is at capacity: {decision.queued_tokens} prompt tokens wait and "
                f"this request adds {num_prompt_tokens}, over the bound of {decision.bound_tokens} "
                f"the replicas' queues take; retry after {retry} s", code="rate_limit_exceeded",
                headers={"Retry-After": str(retry)})

    async def _first_output(self, gen: DeploymentResponseGenerator, ticket: int, arrived_at: float) -> Any:
        """The replica's first output after its acknowledgement; a refusal is raised.

        The acknowledgement itself is waited for until the queue deadline (plus a little):
        a request stuck in Serve's handle queue is answered like one stuck in a replica's.
        """
        timeout = self.args.engine.queue_timeout_s
        try:
            if timeout is None:
                ack = await gen.__anext__()
            else:
                left = timeout + ACK_SLACK_S - (time.time() - arrived_at)
                ack = await asyncio.wait_for(gen.__anext__(), max(left, ACK_SLACK_S))
        except (asyncio.TimeoutError, TimeoutError):
            raise OpenAIError(429, f"the request waited {timeout} s (engine.queue_timeout_s) without reaching "
                              "a model replica: the server is overloaded; retry later",
                              code="queue_timeout", headers={"Retry-After": str(RETRY_AFTER_OVERLOAD_S)}) from None
        if isinstance(ack, RequestRejected):
            raise ack
        self.gate.acknowledged(ticket, ack.replica_id, ack.at)
        first = await gen.__anext__()  # the first token, or a late refusal
        if isinstance(first, RequestRejected):
            raise first
        return first

    async def _collect(self, gen: DeploymentResponseGenerator, outputs: AsyncIterator[Any],
                       n: int) -> Gathered:
        """The whole generation (non-streaming); cancels the replica call if we stop early."""
        done = False
        try:
            result = await collect(outputs, n)
            done = True
            return result
        except Exception as exc:
            raise from_exception(exc) from None
        finally:
            if not done:  # the client left (cancelled) or the replica failed: abort it
                _cancel(gen)

    def _sse(self, gen: DeploymentResponseGenerator, events: AsyncIterator[bytes]) -> StreamingResponse:
        return StreamingResponse(_guarded(gen, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

