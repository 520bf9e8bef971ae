"""Engine and replica configuration: one frozen, validated source of truth for every limit.

Each setting is defined once, here, with its default and its description: the app's arguments
(app/args.py) nest these records as they are, `serve_config.yaml` sets them under `engine:` and
`replica:`, and docs/settings.md is generated from the descriptions (a test keeps it current).
Light on purpose (no torch): the app's arguments and the ingress import it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

POLICIES = ("static", "dynamic", "stall_free")
# block_size null: one KV tile of the flex kernels on CUDA (16-slot tiles leave their loads small),
# else the finer unit the prefix cache shares by (replicas.execution.attention.resolve_block_size)
FLEX_BLOCK_SIZE = 64
DEFAULT_BLOCK_SIZE = 16
Policy = Literal[POLICIES]  # type: ignore[valid-type]
DTYPES = ("auto", "float32", "bfloat16", "float16")
AttentionBackend = Literal["auto", "sdpa", "flex"]
OVERLAP_MODES = ("auto", "on", "off")
Overlap = Literal[OVERLAP_MODES]  # type: ignore[valid-type]
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
DEFAULT_MODEL = "embedded:smollm2"  # a real model (SmolLM2-135M-Instruct), converted once
# A stream's deltas are merged over this interval by default, and over at most half the TBT SLO:
# a client's gap is then under twice the interval while passes are shorter than it.
DEFAULT_STREAM_INTERVAL_MS = 50.0
DEFAULT_WEDGE_TIMEOUT_S = 60.0  # the replica's option, and AsyncEngine's default
# Records validated field by field (pydantic), unknown keys refused, frozen once built.
STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=STRICT)
class EngineConfig:
    """Budgets and knobs of one engine replica (`engine:` in serve_config.yaml)."""

    policy: Policy = Field("stall_free", description=
        "batching policy: stall_free (decodes first, then prompt chunks up to the token budget: "
        "Sarathi-Serve), dynamic (TGI-style: prefill waiting prompts whole, pausing decodes), "
        "static (a batch runs to completion before the next starts)")
    max_batch_prefill_tokens: int = Field(512, description=
        "tokens one forward pass may process (MBP). Under stall_free decode tokens count against it "
        "too (the chunk size); under dynamic and static it caps the prompt tokens of one pass")
    max_batch_total_tokens: int | None = Field(None, description=
        "tokens that may live in the KV cache at once over all active requests (MBT); "
        "null: derived from the KV memory and the model's KV bytes per token")
    kv_cache_memory_bytes: int = Field(256 * 1024 * 1024, description=
        "memory of the KV cache, unless kv_cache_memory_fraction is set")
    kv_cache_memory_fraction: float | None = Field(None, description=
        "the share of the device's total memory (GPU memory, or RAM on CPU) this replica uses for "
        "its weights, activations and KV cache together (vLLM's gpu_memory_utilization), taken of "
        "the replica's share of the device when several share one (num_gpus < 1); the KV cache "
        "gets what the weights and a pass's activations leave. Replaces kv_cache_memory_bytes")
    block_size: int | None = Field(None, description=
        "tokens per KV block (the paging unit, and the prefix cache's unit of sharing); null: 64 "
        "on the flex backend on CUDA (a block is one KV tile of its kernels), 16 elsewhere")
    max_num_seqs: int = Field(128, description="requests running at once, at most")
    max_model_len: int | None = Field(None, description=
        "longest prompt + output a request may have; null: the model's own context length")
    priority_aging_s: float = Field(5.0, description=
        "a waiting request gains one class of urgency per this many seconds (no starvation)")
    dtype: Dtype = Field("auto", description="weights and KV dtype; auto: the model's own")
    device: str = Field("auto", description=
        "torch device; auto: cuda when a GPU is visible (under Serve: num_gpus > 0), else cpu")
    num_threads: int | None = Field(None, description=
        "torch intra-op threads; null: the replica's num_cpus under Serve, torch's choice otherwise")
    trust_remote_code: bool = Field(False, description="let transformers run the model's own code")
    seed: int = Field(0, description="seed of the sampler for requests without their own")
    queue_timeout_s: float | None = Field(None, description=
        "a request still waiting for its first forward pass this long after it arrived is refused "
        "(429, code queue_timeout), or as soon as the rate the queue drains predicts it will be; it "
        "also bounds what the queues admit (a quarter of what drains within it); null: it waits")
    kv_watermark: float = Field(0.01, description=
        "admission keeps this fraction of the KV blocks free while requests run, so running "
        "decodes rarely preempt")
    tbt_sample_window: int = Field(512, description=
        "the latest time-between-tokens samples the engine keeps for load reports")
    tbt_slo_ms: float | None = Field(None, description=
        "time-between-tokens SLO (a p99): the autoscaler scales against it, the proxy door "
        "guards it, and under stall_free each pass's prefill budget is chosen from it "
        "(max_batch_prefill_tokens the ceiling); null: the fixed budget")
    slo_budget: bool = Field(True, description=
        "with tbt_slo_ms under stall_free: choose each pass's prefill budget from the SLO "
        "(false: the fixed budget; the SLO then serves metrics, the door and scaling)")
    slo_admission: bool = Field(False, description=
        "with the SLO budget: a waiting request starts only while the running streams' decodes "
        "and it are predicted within the SLO (else it waits, and with queue_timeout_s the queue "
        "holds no one behind it: they get 429 at once)")
    budget_margin: float = Field(0.8, description=
        "the SLO budget aims each pass at tbt_slo_ms x budget_margin")
    slo_budget_floor: int = Field(16, description=
        "with the SLO budget: the fewest prompt tokens a pass prefills while prompts wait")
    compile_decode_attention: bool = Field(False, description=
        "decode attention as one torch.compile'd kernel reading the KV blocks in place (no "
        "gathered copy); costs a compile (seconds) at start")
    attention_backend: AttentionBackend = Field("auto", description=
        "paged attention kernel: sdpa (torch SDPA over gathered KV blocks, grouped decodes), flex "
        "(torch FlexAttention over the paged cache: one call for the decodes, one a prefill chunk, "
        "each reading only its sequence's blocks; compiled on CUDA, where block_size must be a "
        "power of two >= 16); auto: flex on CUDA, sdpa elsewhere. If flex fails to start, the "
        "replica logs a WARNING and runs sdpa (/health says which runs)")
    cuda_graphs: bool | None = Field(None, description=
        "decode-only passes run the whole forward compiled per batch-size bucket (powers of two "
        "up to max_num_seqs) and, on CUDA, captured in a graph; mixed passes run eagerly. Needs "
        "the flex backend; null: on with flex on CUDA, but off with tensor_parallel_size > 1, where "
        "true has every rank compile and capture its own step in step with the others (a capture of "
        "nccl collectives not yet run on a device here)")
    cuda_graph_sizes: tuple[int, ...] | None = Field(None, description=
        "batch sizes of the decode step compiled (and captured on CUDA) with cuda_graphs: a "
        "decode-only pass runs in the smallest one that holds it, padded; past the largest it "
        "runs eagerly. Each is one compile at start (seconds on a GPU). null: powers of two up to "
        "max_num_seqs, and max_num_seqs")
    compile_backend: str | None = Field(None, description=
        "torch.compile backend of the flex path (its attention calls and the decode step), all "
        "compiled at start; null: inductor on CUDA, nothing compiled elsewhere ('eager' or "
        "'aot_eager' trace without generating code: tests)")
    overlap: Overlap = Field("auto", description=
        "overlapped loop: the engine launches each forward pass before it processes the previous "
        "pass's outputs (stop checks, detokenizing, streaming), so the device never waits for the "
        "host; a decode's sampled token reaches its next pass on the device. Passes of requests "
        "with logits processors (penalties, logit_bias, min_tokens), a grammar, or prompt "
        "logprobs still to score wait for the pass before them. auto: on with CUDA, off on CPU (where the forward runs on the host's "
        "own thread, so nothing overlaps); on / off")
    tensor_parallel_size: int = Field(1, description=
        "devices one replica's model is sharded over, by the model's own tensor-parallel plan "
        "(transformers' base_model_tp_plan): the replica is rank 0, and tensor_parallel_size - 1 "
        "workers (Ray actors in the replica's placement group; processes outside Ray) hold the "
        "other shards. Each rank needs a device of its own (GPUs: one each, nccl; CPU: gloo)")
    enable_prefix_caching: bool = Field(True, description=
        "share the KV of full blocks between requests whose tokens start the same way (a system "
        "prompt, a conversation's history): cached tokens cost no prefill and no new KV")

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        _positive("max_batch_prefill_tokens", self.max_batch_prefill_tokens)
        if self.max_batch_total_tokens is not None:
            _positive("max_batch_total_tokens", self.max_batch_total_tokens)
            if self.max_batch_total_tokens < (self.block_size or DEFAULT_BLOCK_SIZE):
                raise ValueError("max_batch_total_tokens must hold at least one KV block "
                                 f"({self.block_size or DEFAULT_BLOCK_SIZE} tokens), got {self.max_batch_total_tokens}")
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {fraction}")
        if self.block_size is not None:
            _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes or not all(0 < b <= self.max_num_seqs for b in self.cuda_graph_sizes):
                raise ValueError(f"cuda_graph_sizes must be batch sizes in 1..max_num_seqs "
                                 f"({self.max_num_seqs}), got {self.cuda_graph_sizes!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.priority_aging_s <= 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0 or None, got {self.queue_timeout_s!r}")
        if self.tbt_slo_ms is not None and not self.tbt_slo_ms > 0:
            raise ValueError(f"tbt_slo_ms must be > 0, got {self.tbt_slo_ms!r}")
        if not 0 < self.budget_margin <= 1:
            raise ValueError(f"budget_margin must be in (0, 1], got {self.budget_margin!r}")
        _positive("slo_budget_floor", self.slo_budget_floor)
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark!r}")
        _positive("tbt_sample_window", self.tbt_sample_window)
        _positive("tensor_parallel_size", self.tensor_parallel_size)

    @property
    def tbt_slo_s(self) -> float | None:
        """tbt_slo_ms in seconds, the unit every consumer works in (None without an SLO)."""
        return None if self.tbt_slo_ms is None else self.tbt_slo_ms / 1000

    @property
    def slo_pass_target_s(self) -> float | None:
        """The pass time the SLO budget aims at: tbt_slo_ms x budget_margin (None without an SLO)."""
        return None if self.tbt_slo_s is None else self.tbt_slo_s * self.budget_margin

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, config=STRICT)
class ReplicaOptions:
    """What one replica does besides running its engine (`replica:` in serve_config.yaml)."""

    max_queued_tokens: int = Field(32_768, description=
        "prompt tokens a replica may hold waiting for their first token; beyond it requests get "
        "429 + Retry-After")
    stream_interval_ms: float | None = Field(None, description=
        "a stream's tokens go out about this often (the first and the last at once; at the pass "
        "nearest the interval), those between merged into one chunk: fewer, larger items "
        f"through Serve and SSE with many streams; 0: every pass; null: {DEFAULT_STREAM_INTERVAL_MS:g} ms, at most half of "
        "tbt_slo_ms. Set explicitly, it must be at most half of tbt_slo_ms")
    wedge_timeout_s: float = Field(DEFAULT_WEDGE_TIMEOUT_S, description=
        "one engine iteration longer than this fails the replica's health check")
    pass_trace_dir: str | None = Field(None, description=
        "each replica writes one JSON line per forward pass here (passes-<pid>.jsonl): wall and "
        "CPU time, predicted time, the SLO target and budget; null: no trace")
    engine_process: bool = Field(False, description=
        "the engine loop runs in a process of its own beside the replica's (as vLLM's EngineCore): "
        "the replica's HTTP work, detokenizing and metrics no longer share a GIL with the passes; "
        "false: a thread of the replica's process")

    def __post_init__(self) -> None:
        _positive("max_queued_tokens", self.max_queued_tokens)
        interval = self.stream_interval_ms
        if interval is not None and not 0 <= interval <= 10_000:
            raise ValueError(f"stream_interval_ms must be in [0, 10000], got {interval!r}")
        if not self.wedge_timeout_s > 0:
            raise ValueError(f"wedge_timeout_s must be > 0, got {self.wedge_timeout_s}")
        if self.pass_trace_dir is not None and not self.pass_trace_dir:
            raise ValueError("pass_trace_dir must be a directory or null, got ''")


@dataclass(frozen=True, config=STRICT)
class ReplicaConfig:
    """Everything one replica is built from: the model, its engine, the replica's own options."""

    model: str = DEFAULT_MODEL
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    options: ReplicaOptions = dataclasses.field(default_factory=ReplicaOptions)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a model directory, a .gguf file, a hub id or embedded:*")
        slo, interval = self.engine.tbt_slo_ms, self.options.stream_interval_ms
        if slo is not None and interval is not None and 2 * interval > slo:
            # A chunk goes out at the pass end nearest the interval after the last one
            # (`outputs.merged_due`), so a client's gap is under the interval plus half a pass:
            # under 1.5 x the interval while passes are shorter than it. The proxy door refuses
            # for gaps over the SLO, so an interval over half of it would close the door on a
            # quiet server.
            raise ValueError(f"stream_interval_ms ({interval:g}) must be at most half of tbt_slo_ms "
                             f"({slo:g}): merged chunks alone would make gaps over the SLO")
        if self.options.engine_process and self.engine.tensor_parallel_size > 1:
            # In Serve a group's workers are Ray actors on the replica's placement group: the
            # engine process is no Ray worker, and would start them as local processes instead.
            raise ValueError("replica.engine_process runs one device's engine: with "
                             "engine.tensor_parallel_size > 1 leave it false")

    @property
    def stream_interval_s(self) -> float:
        """The interval streams are merged over: the option, or the default bounded by the SLO."""
        interval = self.options.stream_interval_ms
        if interval is None:
            interval = DEFAULT_STREAM_INTERVAL_MS
            if self.engine.tbt_slo_ms is not None:
                interval = min(interval, self.engine.tbt_slo_ms / 2)
        return interval / 1000


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
