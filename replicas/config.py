"""Engine and replica configuration: one frozen, validated source of truth for every limit.

Light on purpose (no torch): the app's arguments and the ingress import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

POLICIES = ("static", "dynamic", "stall_free")
Policy = Literal[POLICIES]  # type: ignore[valid-type]
DTYPES = ("auto", "float32", "bfloat16", "float16")
Dtype = Literal[DTYPES]  # type: ignore[valid-type]
DEFAULT_MODEL = "embedded:smollm2"  # a real model (SmolLM2-135M-Instruct), converted once
DEFAULT_WEDGE_TIMEOUT_S = 60.0  # one iteration longer than this fails the replica's health check


@dataclass(frozen=True)
class EngineConfig:
    """Budgets and knobs of one engine replica.

    max_batch_prefill_tokens (MBP): tokens one forward pass may process. Under `stall_free`
        decode tokens count against it too (Sarathi's token budget); under `dynamic` and
        `static` it caps the prompt tokens prefilled in one pass.
    max_batch_total_tokens (MBT): tokens that may live in the KV cache at once, over all
        active requests. None: derived from `kv_cache_memory_bytes` and the model's KV bytes
        per token.
    """

    policy: Policy = "stall_free"
    max_batch_prefill_tokens: int = 512
    max_batch_total_tokens: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    block_size: int = 16
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's own context length
    # Priority aging: a waiting request gains one class of urgency per `priority_aging_s`.
    priority_aging_s: float = 5.0
    dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's choice
    trust_remote_code: bool = False
    seed: int = 0
    # A request still waiting for its first forward pass this long after it arrived is refused
    # (finish reason "queue_timeout"; the replica answers 429). None: it waits as long as it takes.
    queue_timeout_s: float | None = None
    # Admission keeps this fraction of the KV blocks free while requests run, so running decodes
    # rarely preempt.
    kv_watermark: float = 0.01
    # The latest time-between-tokens samples the engine keeps for load reports.
    tbt_sample_window: int = 512
    # The time-between-tokens SLO. Under stall_free, each pass's prefill budget is then chosen from
    # it (replicas/pass_time.py): the largest chunk whose predicted pass time stays under
    # tbt_slo_ms x budget_margin, max_batch_prefill_tokens becoming the ceiling and
    # slo_budget_floor the least a pass prefills. None: the fixed budget, as before.
    tbt_slo_ms: float | None = None
    slo_budget: bool = True  # False: keep the fixed budget (the SLO then serves metrics and scaling)
    # With the SLO budget: a waiting request starts only while the running requests' decodes and
    # it, beside a slo_budget_floor chunk, are predicted within the target (pass_time.SloAdmission).
    # Opt-in: it trades throughput and TTFT for the SLO (measured: docs/results/engine.md).
    slo_admission: bool = False
    budget_margin: float = 0.8
    slo_budget_floor: int = 16
    # Decode attention as one torch.compile'd kernel that reads each context's KV blocks in place
    # (no gathered copy). Costs a compile (seconds) at start and for new shape classes.
    compile_decode_attention: bool = False
    # Share the KV of full blocks between requests whose tokens start the same way (a system
    # prompt, a conversation's history): cached tokens cost no prefill and no new KV.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        _positive("max_batch_prefill_tokens", self.max_batch_prefill_tokens)
        if self.max_batch_total_tokens is not None:
            _positive("max_batch_total_tokens", self.max_batch_total_tokens)
            if self.max_batch_total_tokens < self.block_size:
                raise ValueError("max_batch_total_tokens must hold at least one KV block "
                                 f"({self.block_size} tokens), got {self.max_batch_total_tokens}")
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.priority_aging_s <= 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
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

    @property
    def slo_pass_target_s(self) -> float | None:
        """The pass time the SLO budget aims at: tbt_slo_ms x budget_margin (None without an SLO)."""
        return None if self.tbt_slo_ms is None else self.tbt_slo_ms / 1000 * self.budget_margin

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ReplicaConfig:
    """What one replica needs besides the engine: model, engine budgets (the TBT SLO among
    them: `engine.tbt_slo_ms`), queue cap."""

    model: str = DEFAULT_MODEL
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    max_queued_tokens: int = 32_768  # prompt tokens waiting for their first token, at most
    wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S
    # KV cache = this fraction of the memory free once the weights are loaded (device memory
    # on a GPU, available RAM on CPU); replaces engine.kv_cache_memory_bytes when set.
    kv_cache_memory_fraction: float | None = None
    # A stream's deltas go to its caller at most this often (first and last at once), the tokens
    # between merged: fewer, larger items on every hop (Serve's streams, SSE) for many streams.
    # 0: one delta per pass (vLLM's and SGLang's stream_interval count tokens instead).
    stream_interval_s: float = 0.0
    # A directory where the replica writes one JSON line per forward pass (replicas/pass_trace.py):
    # wall and CPU time, prediction, SLO target and budget. None: no trace.
    pass_trace_dir: str | None = None

    def __post_init__(self) -> None:
        _positive("max_queued_tokens", self.max_queued_tokens)
        if not 0 <= self.stream_interval_s <= 10:
            raise ValueError(f"stream_interval_s must be in [0, 10], got {self.stream_interval_s!r}")
        if not self.wedge_timeout_s > 0:
            raise ValueError(f"wedge_timeout_s must be > 0, got {self.wedge_timeout_s}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {fraction}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
