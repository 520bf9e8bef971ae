"""The engine loop: schedule -> run -> postprocess, once per forward pass."""

from __future__ import annotations

import dataclasses
import logging
import itertools
import math
import time
from operator import attrgetter
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from replicas.config import EngineConfig
from replicas.scheduling.drain import DrainMeter
from replicas.execution.guided import Grammars
from replicas.execution.attention import resolve_block_size
from replicas.scheduling.kv_cache import BlockManager
from replicas.execution.kv_memory import (activation_bytes, device_memory_bytes, free_memory_bytes, kv_memory_bytes,
                                weight_bytes)
from replicas.execution.logits_processors import LogitsProcessors
from replicas.execution.model_runner import ModelRunner
from replicas.loading.model_support import heads_per_rank, kv_shape, model_max_length
from replicas.loading.models import load_config, load_model
from replicas.execution.parallel import Peers
from replicas.execution.parallel_workers import start_group
from replicas.execution.overlap import InFlight, needs_history
from replicas.outputs import Delta, OutputProcessor, merged_due
from replicas.scheduling.pass_time import PassShape, PassTimeModel, seed_shapes, slo_control
from replicas.protocol import InvalidRequestError, Limits, RequestOutput, SamplingParams, check_priority, sample_id
from replicas.request import Request, RequestStatus
from replicas.execution.sampler import Sampler
from replicas.scheduling.batch import QueueCounts, SchedulerOutput
from replicas.scheduling.scheduler import Scheduler, watermark_blocks

log = logging.getLogger(__name__)
_OUTPUT = attrgetter("output_token_ids")  # a request's tokens generated so far


@dataclass(kw_only=True)
class CompletionOutput:
    """A finished request, as `Engine.generate` returns it (built by keyword)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    token_times: list[float]  # perf_counter when each generated token was produced
    arrival_time: float
    num_preemptions: int = 0
    # With params.logprobs: per output token, (logprob, ((id, logprob) of the top alternatives)).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # With params.prompt_logprobs: the same for prompt tokens 1, 2, ... (token 0 has none).
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted


@dataclass
class IterationStats:
    """One forward pass: what ran and how long it took (for metrics and calibration)."""

    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    context_tokens: int  # KV tokens attended over all sequences
    num_preempted: int = 0
    num_stalled: int = 0  # running requests that were decoding but got no token this pass
    queue_held: bool = False  # SLO admission held the waiting head back (the streams are full)
    # The SLO budget (EngineConfig.tbt_slo_ms): the pass's prefill budget and predicted time;
    # budget None when the fixed one applied (no SLO, no decodes, or the model untrusted).
    prefill_budget: int | None = None
    predicted_s: float | None = None
    budget_fallback: bool = False  # the pass-time model was untrusted: the fixed budget applied
    # The pass-time target the budget aimed at: tbt_slo_ms x budget_margin, lowered by the model's
    # recent overruns (pass_time.calibrated_target) and the KV cap; None with the budget.
    pass_target_s: float | None = None
    # CPU seconds the process used during the pass (all its threads): well under `duration` with
    # one torch thread means the pass waited for a core (other processes on the machine).
    cpu_s: float | None = None


@dataclass
class PassSamples:
    """The latency samples of one pass, gathered by postprocess for the observers (not kept):
    first-token times and queue times of requests that got their first token, the gaps of
    those that got a later one, and the requests that finished."""

    ttft: list[float] = dataclasses.field(default_factory=list)
    queue: list[float] = dataclasses.field(default_factory=list)
    gaps: list[float] = dataclasses.field(default_factory=list)
    finished: list[Request] = dataclasses.field(default_factory=list)


class EngineObserver(Protocol):
    def on_iteration(self, stats: IterationStats, batch: SchedulerOutput, engine: Engine) -> None:
        """After postprocess: batch.seqs' requests carry their new tokens and finish state, and
        `engine.last_pass` holds the pass's latency samples."""

    def on_abort(self, request: Request) -> None:
        """A request left between iterations without finishing its generation: aborted
        (client gone, shutdown) or past the queue deadline (`request.finish_reason` says)."""


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 config: EngineConfig | None = None, peers: Peers | None = None) -> None:
        """`peers`: with config.tensor_parallel_size > 1, the group whose rank 0 this is (`model`
        is rank 0's shard; `from_pretrained` starts the group and loads every shard)."""
        self.config = config = config or EngineConfig()
        self.peers = peers
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.tokenizer = model, tokenizer
        model_len = model_max_length(model.config)
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        device = next(model.parameters()).device
        self.block_size = resolve_block_size(config.block_size, config.attention_backend, device)
        num_blocks = self._num_blocks(model)
        self.blocks = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        # With a TBT SLO: the pass-time model, fitted online, and under stall_free the SLO budget
        # (each pass's prefill tokens) and admission built on it, handed to the scheduler.
        self.pass_time, self.slo_budget, self.slo_admission = slo_control(
            config, self.blocks, watermark_blocks(self.blocks.num_blocks, config.kv_watermark), log)
        self.scheduler = Scheduler(config, self.blocks, prefill_budget=self.slo_budget,
                                   may_admit=self.slo_admission)
        self.limits = Limits(self.max_model_len, self.blocks.capacity_tokens,
                             config.max_batch_prefill_tokens, config.policy, self.vocab_size)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.logits_processors = LogitsProcessors(self.vocab_size, self.eos_token_ids)
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, self.grammars)  # stop checks, text, deltas
        sampler = Sampler(next(model.parameters()).device, self.vocab_size, self.logits_processors, self.grammars)
        self.runner = ModelRunner(model, self.blocks, self.max_model_len, config.compile_decode_attention,
                                  config.attention_backend, config.cuda_graphs, config.max_num_seqs,
                                  config.compile_backend, config.cuda_graph_sizes, sampler,
                                  config.tensor_parallel_size, peers)
        # Overlapped loop (`config.overlap`): the pass launched but not processed yet.
        self.overlap = resolve_overlap(config.overlap, self.runner.device)
        if self.overlap:
            self.runner.use_overlap()
        self._in_flight: InFlight | None = None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.iterations: deque[IterationStats] = deque(maxlen=100_000)
        self.pass_started: float | None = None  # perf_counter when the pass in progress began
        self.recent_tbt: deque[float] = deque(maxlen=config.tbt_sample_window)
        self.last_pass = PassSamples()
        self.num_tbt_samples = 0
        # A running request's delta goes out about this often (its first and last at once; at
        # the landing nearest it is due: `merged_due`), the tokens between detokenized and sent
        # together (the async engine's stream interval; 0: every pass).
        self.stream_interval_s = 0.0
        self._landed_at = -math.inf  # perf_counter when the last pass's tokens landed
        # The rate its waiting prompt tokens drain, from its own passes (`drain_rate`).
        self.drain = DrainMeter(self.iterations, config.max_batch_prefill_tokens)
        # The scheduler's counts, refreshed after every change (`_changed`): the replica's load
        # report and the metrics read them.
        self.last_load: QueueCounts = self.scheduler.counts()
        # Called after every iteration with (stats, batch, engine): metrics, load reports.
        self.observers: list[EngineObserver] = []
        if self.pass_time is not None:
            self.profile_passes()  # the model is fitted before the first request: no guessing

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig | None = None) -> Engine:
        """Load an HF causal LM (directory, .gguf file, hub id, or "embedded:<name>") and build an engine."""
        config = config or EngineConfig()
        load = {"model": model, "dtype": config.dtype, "device": config.device,
                "trust_remote_code": config.trust_remote_code, "tensor_parallel_size": config.tensor_parallel_size}
        if config.tensor_parallel_size == 1:
            return cls(*load_model(**load), config)
        load_config(model, config.trust_remote_code, config.tensor_parallel_size)  # refused before any start
        peers = start_group(config.tensor_parallel_size, config.device, config.num_threads)
        try:
            peers.load(load)  # the workers load their shards as rank 0 loads its own
            return cls(*load_model(**load), config, peers)
        except BaseException:
            peers.stop()
            raise

    def close(self) -> None:
        """Stop what the engine started beyond this process: a tensor-parallel group's workers."""
        if self.peers is not None:
            self.peers.stop()

    def _num_blocks(self, model: PreTrainedModel) -> int:
        cfg, block_size = self.config, self.block_size
        if cfg.max_batch_total_tokens is not None:
            if cfg.max_batch_total_tokens < block_size:  # checked again: a null block_size is resolved now
                raise ValueError(f"max_batch_total_tokens must hold at least one KV block ({block_size} "
                                 f"tokens), got {cfg.max_batch_total_tokens}")
            return cfg.max_batch_total_tokens // block_size
        layers, _, head_dim = kv_shape(model.config)
        _, kv_heads = heads_per_rank(model.config, cfg.tensor_parallel_size)  # this rank's share
        elem = next(model.parameters()).element_size()
        bytes_per_token = 2 * layers * kv_heads * head_dim * elem
        memory = cfg.kv_cache_memory_bytes
        if cfg.kv_cache_memory_fraction is not None:
            device = next(model.parameters()).device
            graphs = device.type == "cuda" and cfg.cuda_graphs is not False
            memory, source = kv_memory_bytes(device_memory_bytes(device), cfg.kv_cache_memory_fraction,
                                             weight_bytes(model),
                                             activation_bytes(model.config, cfg, self.max_model_len, elem),
                                             free_memory_bytes(device), graphs)
            log.info("KV cache: %d MiB (%s)", memory >> 20,
                     f"{cfg.kv_cache_memory_fraction:.2f} of the device's memory less weights and activations"
                     if source == "total" else "the memory free after the weights, less activations, graph "
                     "pool and compile workspace: less than the fraction allows")
        blocks = memory // (bytes_per_token * block_size)
        # More blocks than every sequence slot at full length could ever use is waste.
        most = -(-cfg.max_num_seqs * self.max_model_len // block_size)
        return max(1, min(blocks, most))

    @property
    def max_batch_total_tokens(self) -> int:
        return self.blocks.capacity_tokens

    # ---- intake ----------------------------------------------------------------------

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     arrival_time: float | None = None) -> Request:
        """Check a request against every limit and build it; raises InvalidRequestError.

        A text prompt is tokenized here, so call it from the thread that owns the tokenizer
        (the async engine takes token ids only). Nothing is queued: see `enqueue`.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):  # the one check of its type (it may come over Ray)
            raise InvalidRequestError("params must be a SamplingParams", "params")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        else:
            ids = list(prompt)
            self.limits.check_prompt_ids(ids)
        self.limits.check_token_ids(params)
        check_priority(priority)
        max_tokens = self.limits.max_tokens(len(ids), params.max_tokens)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(request_id, ids, params, priority,
                       arrival_time if arrival_time is not None else time.perf_counter(),
                       guide=self._guide(params))

    def make_requests(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                      request_id: str | None = None, priority: int = 0,
                      arrival_time: float | None = None, first_index: int = 0) -> list[Request]:
        """The `params.n` samples of one prompt, choices `first_index` on of request `request_id`
        (ids `protocol.sample_id`): `make_request` for the first, then the others forked from
        it, seeds `seed + j`, each waiting for the first one's prefill (`Request.forked_from`)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        first = self.make_request(prompt, params, sample_id(request_id, first_index), priority, arrival_time)
        first.index = first_index
        reqs = [first]
        for j in range(1, first.params.n):
            sp = first.params
            if sp.seed is not None:
                sp = dataclasses.replace(sp, seed=(sp.seed + j) % 2**63)
            reqs.append(Request(sample_id(request_id, first_index + j), first.prompt_token_ids, sp, priority,
                                first.arrival_time, index=first_index + j, forked_from=first, guide=self._guide(sp)))
        return reqs

    def _guide(self, params: SamplingParams) -> Any:
        """A fresh grammar state for a request under structured output (each sample its own)."""
        return self.grammars.matcher(params.guided) if params.guided is not None else None

    def enqueue(self, req: Request) -> None:
        """Queue a request built by `make_request`: no checks again but the id's uniqueness, the
        one check of it (the async engine answers its caller before any delta streams)."""
        # A finished request keeps its blocks (keyed by its id) until its last pass lands.
        if req.request_id in self.requests or self.blocks.block_table(req.request_id):
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use", "request_id")
        self.requests[req.request_id] = req
        params = req.params
        self.outputs.add(req)
        stops = frozenset(params.stop_token_ids)
        req.stop_ids = stops if params.ignore_eos else stops | self.eos_token_ids
        req.max_output = min(params.max_tokens, self.max_model_len - req.num_prompt_tokens)
        self.scheduler.add(req)
        self._changed()

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> Request:
        """Check and queue a request; nothing is admitted if this raises."""
        req = self.make_request(prompt, params, request_id, priority, arrival_time)
        self.enqueue(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | Delta | None:
        """Stop a request now and free its KV blocks (call from the loop's thread)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._changed()
        for observer in self.observers:
            observer.on_abort(req)
        return self._emit(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput | Delta]:
        """One iteration: schedule, run one forward pass, postprocess (a delta left to the caller is
        a `Delta`: `OutputProcessor.deltas_by_caller`). Overlapped
        (`config.overlap`): schedule and launch pass N+1, then postprocess pass N while the
        device runs it; the outputs returned are pass N's."""
        outputs = self._expire()
        if self.overlap:
            return outputs + self._step_overlapped()
        batch = self._schedule()
        if batch.is_empty:
            return outputs
        return outputs + self._land(self._launch(batch))

    def _step_overlapped(self) -> list[RequestOutput | Delta]:
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and any(needs_history(r) for r in self.scheduler.running):
            outputs = self.sync()  # its sampling reads the whole output on the host: no lag
        batch = self._schedule()
        launched = self._launch(batch) if not batch.is_empty else None
        last, self._in_flight = self._in_flight, launched
        return outputs + (self._land(last) if last is not None else [])

    def sync(self) -> list[RequestOutput | Delta]:
        """Process the pass in flight, if any (the overlapped loop): after it, the host's
        request state is the device's."""
        last, self._in_flight = self._in_flight, None
        return self._land(last) if last is not None else []

    def _schedule(self) -> SchedulerOutput:
        if self.slo_budget is not None:
            self.slo_budget.reset()
        return self.scheduler.schedule()

    def _launch(self, batch: SchedulerOutput) -> InFlight:
        """Hand the pass to the device; from here the scheduler counts its tokens in flight."""
        shape = PassShape.of(batch)
        predicted = self.pass_time.predict(shape) if self.pass_time is not None else None
        cpu_start = time.process_time()
        self.pass_started = start = time.perf_counter()
        handle = self.runner.launch(batch)
        self.scheduler.launched(batch)
        return InFlight(batch, handle, shape, predicted, start, cpu_start)

    def _land(self, p: InFlight) -> list[RequestOutput | Delta]:
        """The pass's tokens back on the host: advance its requests, check stops, emit deltas."""
        try:
            token_ids = self.runner.collect(p.handle)  # the tokens of batch.seqs that sample, in order
        except BaseException:
            self.pass_started = None
            self.scheduler.abandon(p.batch)
            raise
        now, cpu_s = time.perf_counter(), time.process_time() - p.cpu_start
        if self._in_flight is None:  # overlapped, the next pass is in progress already
            self.pass_started = None
        # Overlapped, the host's wall time between returns is not the pass's: the device's is.
        start = now - self.runner.pass_seconds(p.handle) if self.overlap else p.host_start
        stats = self._record(p.batch, start, now, p.shape, p.predicted, cpu_s)
        outputs = self._postprocess(p.batch, token_ids, now)
        self._changed()
        for observer in self.observers:
            observer.on_iteration(stats, p.batch, self)
        return outputs

    def drain_rate(self) -> float | None:
        """Waiting prompt tokens it prefilled per second lately (`admission.drain_rate`; None:
        nothing to go by), judged up to the pass in progress. Safe from any thread."""
        return self.drain.rate(running_since=self.pass_started)

    def _changed(self) -> None:
        """After every change of its requests: the load snapshot and whether prompts wait."""
        self.last_load = self.scheduler.counts()
        sched = self.scheduler
        self.drain.note_backlog(bool(sched.waiting) or not all(map(_OUTPUT, sched.running)))  # one prefilling

    def _expire(self) -> list[RequestOutput | Delta]:
        """Requests past the queue deadline, or predicted to start past it (at the rate its
        queue drains), leave before the pass is scheduled."""
        drain = self.drain_rate() if self.scheduler.waiting else None
        expired = self.scheduler.expire(self.scheduler.clock(), drain)
        if not expired:
            return []
        self._changed()
        outputs = []
        for req in expired:
            for observer in self.observers:
                observer.on_abort(req)
            outputs.append(self._emit(req))
        return outputs

    def _postprocess(self, batch: SchedulerOutput, token_ids: list[int], now: float) -> list[RequestOutput | Delta]:
        """Advance the pass's requests by their tokens, check stops, emit the deltas; the
        pass's latency samples go to `last_pass` (observers) and `recent_tbt` (load reports)."""
        outputs = []
        samples = self.last_pass = PassSamples()
        gaps = samples.gaps
        finish, check_stop, emit = self.scheduler.finish, self.outputs.check_stop, self.outputs.emit
        requests = self.requests
        due = merged_due(now, self._landed_at, self.stream_interval_s)  # sent by then: due again
        self._landed_at = now
        for req in self.scheduler.landed(batch, token_ids, now):
            times = req.token_times  # its last entry is `now` (none: a prompt only scored)
            if len(times) > 1:
                gaps.append(now - times[-2])
            elif times:
                samples.ttft.append(now - req.arrival_time)
                if req.first_scheduled_time is not None:
                    samples.queue.append(req.first_scheduled_time - req.arrival_time)
            out = req.output_token_ids
            if req.plain_stops and out and len(out) < req.max_output and out[-1] not in req.stop_ids:
                status = None  # nothing but a stop token or max_tokens could end it: neither did
            else:
                status = check_stop(req)
            if status is not None:
                finish(req, status)
                samples.finished.append(req)
                outputs.append(emit(req))
                del requests[req.request_id]
            elif req.sent_at <= due or not req.num_sent_tokens:
                req.sent_at = now
                outputs.append(emit(req))
        self.recent_tbt.extend(gaps)
        self.num_tbt_samples += len(gaps)
        return outputs

    def _emit(self, req: Request) -> RequestOutput | Delta:
        """The request's delta (`OutputProcessor.emit`); a finished request leaves the engine."""
        out = self.outputs.emit(req)
        if out.finished:
            del self.requests[req.request_id]
        return out

    def _record(self, batch: SchedulerOutput, start: float, end: float, shape: PassShape,
                predicted: float | None, cpu_s: float) -> IterationStats:
        stats = IterationStats(
            start, end - start, shape.prefill_tokens, shape.decode_tokens, shape.sequences,
            shape.context_tokens, len(batch.preempted),
            num_stalled=batch.num_stalled, queue_held=batch.head_held, predicted_s=predicted, cpu_s=cpu_s)
        if self.slo_budget is not None:
            stats.prefill_budget, stats.budget_fallback = self.slo_budget.last, self.slo_budget.fallback
            stats.pass_target_s = self.slo_budget.last_target_s
        self.iterations.append(stats)
        if self.pass_time is not None:
            self.pass_time.observe(shape, stats.duration, predicted)
        return stats

    def profile_passes(self) -> None:
        """Seed the pass-time model with a handful of passes of different shapes (prefills of
        a few sizes up to the ceiling, then decodes), as vLLM profiles memory at start. SLO
        admission lets them all in: it acts once the model is seeded (`freeze_seed`)."""
        g = torch.Generator().manual_seed(0)
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        longest = max(1, min(self.max_model_len, self.blocks.capacity_tokens) - 8)
        self.generate([[10] * 4], greedy)  # warm-up, not recorded
        self.pass_time.window.clear()
        for n, k in seed_shapes(self.config.max_batch_prefill_tokens):
            n = max(1, min(n, longest // k))
            prompts = [torch.randint(10, self.vocab_size, (n,), generator=g).tolist() for _ in range(k)]
            self.generate(prompts, greedy)
        self.pass_time.freeze_seed()
        self.blocks.query_tokens = self.blocks.hit_tokens = 0  # the profile's lookups are not traffic
        self.iterations.clear()
        self.drain.reset()
        self.recent_tbt.clear()
        self.num_tbt_samples = 0

    # ---- offline API -----------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """Run prompts to completion; outputs in the order of the prompts (with `n` > 1, each
        prompt's n samples in a row)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} sampling params")
        reqs = [r for p, sp in zip(prompts, plist) for r in self.make_requests(p, sp)]  # all checked first
        for req in reqs:
            self.enqueue(req)
        texts = {r.request_id: [] for r in reqs}
        while any(not r.is_finished for r in reqs):
            for out in self.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.delta_text)
        self.sync()  # overlapped: the pass of tokens they drop, so their blocks are free
        return [CompletionOutput(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=list(r.output_token_ids),
            text="".join(texts[r.request_id]), finish_reason=r.finish_reason, token_times=list(r.token_times),
            arrival_time=r.arrival_time, num_preemptions=r.num_preemptions,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            prompt_logprobs=list(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None,
            num_cached_tokens=r.num_cached_tokens) for r in reqs]


def resolve_overlap(mode: str, device: torch.device) -> bool:
    """`EngineConfig.overlap`: auto is on with CUDA only. On CPU the forward runs on the loop's
    own thread, so the host's work cannot hide behind it; measured, the lag only adds a pass."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
