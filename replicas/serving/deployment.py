"""Serve deployment hosting one engine: streaming generation, bounded queue, load and health.

`LLMServer` is a plain class: the app builder wraps it with `serve.deployment`, and tests can
build it without Ray from any engine factory. The batching loop runs on `AsyncEngine`'s own
thread, or in a process of its own (`replica.engine_process`, `ProcessEngine`), so the replica's
event loop only moves token ids in and deltas out.

Handle protocol (what the ingress calls):
- `generate(prompt_token_ids, params, priority, request_id)`, a streaming method. Its first
  item is either a `RequestRejected` (and nothing follows) or an `Acknowledged` sent once the
  request is queued (the caller learns of a refusal before it commits to a 200); then one
  `RequestOutput` per engine iteration (the first says when it left the queue), the last with
  `finished=True`.
- `model_info()`, `load()`, `check_health()`.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol


from replicas.scheduling import admission
from replicas.serving.async_engine import AsyncEngine, EngineDeadError
from replicas.config import ReplicaConfig
from replicas.serving.metric_backends import Backend, RayBackend
from replicas.serving.metrics import EngineMetrics
from replicas.serving.pass_trace import PassTrace
from replicas.serving.engine_process import ChildSpec, ProcessEngine
from replicas.protocol import (Acknowledged, QueueFullError, QueueTimeoutError,
                               ReplicaLoad, ReplicaUnhealthyError, RequestOutput, RequestRejected,
                               SamplingParams, prompt_batch, sample_id)
from replicas.serving.priority import serve_at_full_priority
from replicas.serving.startup_gc import freeze_startup_objects
from replicas.serving.serve_logs import use_serve_log

if TYPE_CHECKING:  # torch's: with replica.engine_process only the engine process loads it
    from replicas.engine import Engine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], "Engine"]
MAX_TRANSIT_CREDIT_S = 60.0  # time before this replica counted toward TTFT, at most (no deadline)


class LoadSink(Protocol):
    """Where a replica's load reports go (`autoscale.reporter.LoadReporter`, injected by the app
    builder so this package never imports the controller's)."""

    @property
    def replica_id(self) -> str | None: ...

    def start(self, get_load: Callable[[], ReplicaLoad], get_iterations: Callable[[], Sequence[Any]],
              get_tbt: Callable[[], tuple[int, Sequence[float]]]) -> None: ...

    def autoscaling_stats(self) -> dict[str, float]: ...

    def stop(self) -> None: ...


def build_engine(config: ReplicaConfig, share: float | None = None) -> Engine:
    """The default engine factory: load the model and build the engine. A replica given part of
    a GPU (num_gpus < 1) sizes its memory from that part (`share`; None: as Ray gave this
    process): replicas sharing a device split it."""
    from replicas.engine import Engine  # here: a replica with an engine process never loads torch

    engine_config = config.engine
    fraction = engine_config.kv_cache_memory_fraction
    share = _gpu_share() if share is None else share
    if fraction is not None and share < 1:
        engine_config = engine_config.replace(kv_cache_memory_fraction=fraction * share)
    return Engine.from_pretrained(config.model, engine_config)


def _gpu_share() -> float:
    """The part of a GPU Ray gave this replica (1 outside Ray or with whole GPUs)."""
    try:
        import ray

        if not ray.is_initialized():
            return 1.0
        gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    except Exception:  # noqa: BLE001 - no Ray context: a replica built in a test
        return 1.0
    return gpus if 0 < gpus < 1 else 1.0


class LLMServer:
    """One engine replica. Wrap with `serve.deployment` to host it on Ray Serve."""

    def __init__(self, config: ReplicaConfig, engine_factory: EngineFactory | None = None,
                 metrics_backend: Backend | None = None,
                 reporter_factory: Callable[[], LoadSink] | None = None) -> None:
        use_serve_log()
        serve_at_full_priority(logger, "the engine replica")
        self.config = config
        factory = engine_factory or functools.partial(build_engine, config, _gpu_share())
        in_serve = _in_serve_replica()
        backend = metrics_backend or (RayBackend() if in_serve else None)
        options = config.options
        self.engine: AsyncEngine | ProcessEngine
        if options.engine_process:  # the factory, pickled, builds the engine in the child
            self.engine = ProcessEngine(ChildSpec(
                factory, options.wedge_timeout_s, config.stream_interval_s,
                metrics_model=config.model if backend is not None else None, tbt_slo_s=config.engine.tbt_slo_s,
                pass_trace_dir=options.pass_trace_dir), backend)
        else:
            engine = factory()
            if backend is not None:
                engine.observers.append(EngineMetrics(backend, config.model, config.engine.tbt_slo_s))
            if options.pass_trace_dir is not None:
                engine.observers.append(PassTrace(options.pass_trace_dir))
            self.engine = AsyncEngine(engine, wedge_timeout_s=options.wedge_timeout_s,
                                      stream_interval_s=config.stream_interval_s)
        # Load reports to the controller at iteration granularity (only inside Serve).
        self.reporter = reporter_factory() if reporter_factory is not None else None
        if in_serve and self.reporter is not None:
            self.reporter.start(self.load, lambda: self.engine.engine.iterations,
                                lambda: self.engine.tbt_snapshot)
        # Prompt tokens of accepted requests that have not produced a token yet, by intake (a
        # `generate` call). Kept here, not read from the loop's snapshot, because the snapshot
        # lags intake by an iteration.
        self._queued: dict[object, int] = {}
        timeout = config.engine.queue_timeout_s
        self._max_transit_credit_s = timeout / 2 if timeout is not None else MAX_TRANSIT_CREDIT_S
        logger.info("replica ready: %s", self.model_info())
        freeze_startup_objects(logger, "the engine replica")

    # ---- generation ------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int] | list[list[int]], params: SamplingParams,
                       priority: int = 0, request_id: str = "", arrived_at: float | None = None,
                       ) -> AsyncIterator[RequestOutput | RequestRejected]:
        """Stream one request (one prompt, or a batch: a list of prompts): first an empty
        acknowledgement, then a delta per iteration, each of one choice (`index`).

        A refusal (bad limits, full queue, the queue deadline) is yielded as an item instead of
        raised, so a 429 storm does not fill the replica's log with tracebacks. `arrived_at` is
        the wall-clock time (time.time()) the request reached the server's door: the wait in
        front of this replica counts toward its queue deadline and TTFT.
        """
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrival = None
        if arrived_at is not None:  # wall clock -> this process's perf_counter clock
            # Capped: across hosts the clocks may disagree, and skew must not expire requests.
            credit = min(max(0.0, time.time() - arrived_at), self._max_transit_credit_s)
            arrival = time.perf_counter() - credit
        arrived = arrival if arrival is not None else time.perf_counter()
        batch = prompt_batch(prompt_token_ids)  # the one place a request's prompts are told apart
        num_prompt_tokens = sum(len(p) for p in batch)
        samples = len(batch) * params.n
        intake = object()  # its entry in `_queued` (the id is the engine's to check)
        try:
            stream = await self._accept(batch, params, priority, request_id, arrival, num_prompt_tokens, intake)
        except RequestRejected as rejected:
            yield rejected
            return
        # The engine has the prompts now: this frame lives as long as the stream, and a prompt's
        # list of ids would be walked by every garbage collection meanwhile (startup_gc.py).
        del prompt_token_ids, batch
        finished = started = False
        unfinished = samples  # choices still generating (their deltas share the stream)
        try:
            yield Acknowledged(request_id=request_id, replica_id=self.replica_id, at=time.time())
            async for out in stream:
                self._queued.pop(intake, None)
                first = not started
                if first:
                    out.left_queue_at = time.time()
                unfinished -= out.finished
                finished, started = unfinished == 0, True
                if out.finish_reason == "queue_timeout":
                    if not first:  # never expected (once choice 0 is scheduled no choice expires,
                        # Scheduler.expire): fail the stream in-band rather than pass for a choice
                        raise self._queue_timeout(num_prompt_tokens, time.perf_counter() - arrived)
                    yield self._queue_timeout(num_prompt_tokens, time.perf_counter() - arrived)
                    return
                yield out
        except EngineDeadError as exc:  # the loop died under it: a server fault, retry elsewhere
            down = _engine_down(f"the engine loop on this replica stopped: {exc}")
            if started:
                raise down from None
            yield down
        finally:
            self._queued.pop(intake, None)
            if not finished:  # cancelled (client gone) or failed: free its KV blocks now
                for i in range(samples):
                    self.engine.abort(sample_id(request_id, i))

    async def _accept(self, prompts: list[list[int]], params: SamplingParams, priority: int, request_id: str,
                      arrival: float | None, num_prompt_tokens: int, intake: object) -> AsyncIterator[RequestOutput]:
        """Check health and queue room; queue the request in the engine, which checks the rest
        (its limits, the params' type, the id not in use) before the stream is returned.

        `params` was validated when it was built (at the ingress). The prompt tokens count as
        queued (`intake`) from before the engine's answer, so requests accepted meanwhile see them.
        """
        if not self.engine.is_healthy():
            raise _engine_down("the engine loop on this replica is not running")
        self._admit(num_prompt_tokens)
        self._queued[intake] = num_prompt_tokens
        try:
            return await self.engine.add_request(prompts, params, request_id, priority, arrival)
        except BaseException as exc:
            self._queued.pop(intake, None)
            if isinstance(exc, EngineDeadError):
                raise _engine_down("the engine loop on this replica is not running") from None
            raise

    def _admit(self, num_prompt_tokens: int) -> None:
        """Refuse with 429 when the queue is non-empty and this prompt would overflow its bound.

        The bound is `admission.queue_bound`: what drains within the queue deadline, at most
        `max_queued_tokens`. An empty queue always admits, so one long prompt is still served.
        """
        queued = max(self.queued_tokens, self.engine.load_snapshot.waiting_tokens)
        bound = self.queue_bound_tokens()
        if not admission.admits(queued, num_prompt_tokens, bound):
            retry = admission.retry_after_s(queued + num_prompt_tokens - bound, self.drain_tps())
            raise QueueFullError(
                f"the replica's queue is full: {queued} prompt tokens are waiting and this request "
                f"adds {num_prompt_tokens}, over the bound of {bound} (max_queued_tokens = "
                f"{self.config.options.max_queued_tokens}, or what drains within engine.queue_timeout_s); "
                f"retry after {retry} s", None, retry)

    def _queue_timeout(self, num_prompt_tokens: int, waited_s: float) -> QueueTimeoutError:
        timeout = self.config.engine.queue_timeout_s
        drain = self.drain_tps()
        retry = admission.retry_after_s(self.queued_tokens + num_prompt_tokens, drain)
        if waited_s < timeout:  # refused early: the queue ahead drains too slowly (Scheduler.expire)
            why = (f"after {waited_s:.1f} s in the queue: at the rate it drains ({drain or 0:.0f} prompt "
                   f"tokens/s) it would not be scheduled within queue_timeout_s ({timeout} s)")
        else:
            why = f"after waiting {timeout} s (queue_timeout_s) without being scheduled"
        return QueueTimeoutError(f"the request was refused {why}: the server is overloaded; "
                                 f"retry after {retry} s", None, retry)

    def drain_tps(self) -> float | None:
        """Waiting prompt tokens prefilled per second lately: the engine's own measure."""
        return self.engine.engine.drain_rate()

    def queue_bound_tokens(self) -> int:
        engine = self.config.engine
        return admission.queue_bound(self.config.options.max_queued_tokens, self.drain_tps(),
                                     engine.queue_timeout_s)

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued.values())

    # ---- reports ---------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        """Limits the ingress needs (context length, KV capacity, vocabulary, policy)."""
        engine = self.engine.engine
        return {
            "model": self.config.model,
            "max_model_len": engine.max_model_len,
            "max_batch_total_tokens": engine.max_batch_total_tokens,
            "max_batch_prefill_tokens": engine.config.max_batch_prefill_tokens,
            "vocab_size": engine.vocab_size,
            "policy": engine.config.policy,
            "block_size": engine.block_size,
            "max_queued_tokens": self.config.options.max_queued_tokens,
            "tbt_slo_ms": self.config.engine.tbt_slo_ms,
        }

    @property
    def replica_id(self) -> str | None:
        return self.reporter.replica_id if self.reporter is not None else None

    def load(self) -> ReplicaLoad:
        """Token load for routing and autoscaling, built once: the engine's last counts, the
        intake, the queue bound and the engine's rates.

        The counts lag intake by up to an iteration, so requests accepted here that have no
        token yet count as waiting when they are more than the scheduler shows.
        """
        model = self.engine.engine.pass_time
        return self.engine.load_snapshot.report(
            intake_tokens=self.queued_tokens, intake_requests=len(self._queued),
            queue_bound_tokens=self.queue_bound_tokens(), drain_tps=self.drain_tps() or 0.0,
            prefill_tps=(model.prefill_tokens_per_s or 0.0) if model is not None else 0.0,
            prefix_sketch=self.engine.sketch_snapshot)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling metrics hook: TBT percentiles and token load of this replica."""
        return self.reporter.autoscaling_stats() if self.reporter is not None else {}

    def check_health(self) -> dict[str, Any]:
        """Serve's health probe: raises when the engine loop died or one step is wedged. Returns
        the runner's status (the ingress's /health shows it; Serve ignores it)."""
        if not self.engine.is_healthy():
            reason = repr(self.engine.error) if self.engine.error else "loop not running or wedged"
            raise RuntimeError(f"engine unhealthy: {reason}")
        peers = self.engine.engine.peers
        if peers is not None:  # a tensor-parallel worker gone: Serve replaces the replica (and group)
            peers.check()
        return self.runner_status()

    def runner_status(self) -> dict[str, Any]:
        """Which forward path runs (a flex path that failed to start says why) and the graphs
        compiled since start: after warm-up there should be none."""
        runner = self.engine.engine.runner
        total, after = runner.compiles
        return {"path": runner.path, "compiles_since_start": total, "compiles_after_warmup": after,
                "fallback_error": runner.fallback_error,
                "tensor_parallel_size": self.engine.engine.config.tensor_parallel_size}

    def shutdown(self) -> None:
        """Stop load reports and the engine loop thread."""
        if self.reporter is not None:
            self.reporter.stop()
        self.engine.shutdown()
        self.engine.engine.close()

    def __del__(self) -> None:  # Serve calls this on graceful replica shutdown
        if getattr(self, "reporter", None) is not None:
            self.reporter.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            engine.engine.close()


def _engine_down(message: str) -> ReplicaUnhealthyError:
    """503 engine_unavailable, retry in a second (the ingress tries another replica first)."""
    return ReplicaUnhealthyError(message, None, 1)


def _in_serve_replica() -> bool:
    try:
        from ray import serve
        serve.get_replica_context()
        return True
    except Exception:  # not inside a Serve replica (tests, scripts)
        return False

