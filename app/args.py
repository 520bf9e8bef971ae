"""Application arguments: one pydantic model, validated when the app is built.

`serve_config.yaml` sets these under `applications[].args`; tests pass a dict to
`app.builder.build_app`. Engine fields mirror `EngineConfig` and are checked by building one,
so a limit is defined (and validated) in exactly one place.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.middleware import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from app.stream_limit import DEFAULT_MIN_LIMIT, DEFAULT_TARGET_MS
from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE
from autoscale.routing import DEFAULT_PREFIX_IMBALANCE
from autoscale.scaling import ScalingConfig
from autoscale.serve_options import RouterName
from replicas.config import DEFAULT_MODEL, Dtype, EngineConfig, Policy, ReplicaConfig

# Defaults are defined once, in the dataclasses they configure.
_ENGINE = EngineConfig()
_REPLICA = ReplicaConfig()
_SCALING = {f.name: f.default for f in dataclasses.fields(ScalingConfig)
            if f.default is not dataclasses.MISSING}


class AppArgs(BaseModel):
    """Everything `serve run serve_config.yaml` can set for one model application."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- model -----------------------------------------------------------------------
    model: str = Field(DEFAULT_MODEL, min_length=1,
                       description="HF model directory, a .gguf file, hub id, or embedded:smollm2 "
                       "(a real model) / embedded:tiny / embedded:mid (random weights)")
    served_model_name: str | None = Field(None, description="name clients send; default: model")
    trust_remote_code: bool = False
    dtype: Dtype = _ENGINE.dtype
    device: str = Field("auto", description="auto: cuda when num_gpus > 0, else cpu")

    # ---- engine budgets (EngineConfig) -----------------------------------------------
    policy: Policy = _ENGINE.policy
    max_batch_prefill_tokens: int = Field(_ENGINE.max_batch_prefill_tokens, description="token budget of one forward pass "
                                          "(the prefill chunk size under stall_free)")
    max_batch_total_tokens: int | None = Field(None, description="KV capacity in tokens; "
                                               "None: from kv_cache_memory_bytes")
    kv_cache_memory_bytes: int = _ENGINE.kv_cache_memory_bytes
    kv_cache_memory_fraction: float | None = Field(None, gt=0, lt=1, description="KV cache as a "
                                                   "fraction of the memory free after the weights "
                                                   "load (GPU memory, or RAM on CPU); replaces "
                                                   "kv_cache_memory_bytes")
    block_size: int = _ENGINE.block_size
    max_num_seqs: int = _ENGINE.max_num_seqs
    max_model_len: int | None = None
    priority_aging_s: float = _ENGINE.priority_aging_s
    seed: int = _ENGINE.seed
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per "
                                      "replica; None: the replica's num_cpus (at least 1)")
    compile_decode_attention: bool = Field(_ENGINE.compile_decode_attention, description="decode "
                                           "attention as one torch.compile'd kernel reading the KV "
                                           "blocks in place (~17% faster passes at 64 decodes on CPU; "
                                           "seconds of compile at start)")
    enable_prefix_caching: bool = Field(_ENGINE.enable_prefix_caching, description="share the KV "
                                        "of full blocks between requests with equal leading tokens "
                                        "(cached tokens cost no prefill and no new KV)")

    # ---- replica behaviour -----------------------------------------------------------
    max_queued_tokens: int = Field(_REPLICA.max_queued_tokens, ge=1, description="prompt tokens a replica may hold "
                                   "waiting; beyond it requests get 429 + Retry-After")
    queue_timeout_s: float | None = Field(10.0, gt=0, description="a request not scheduled this "
                                          "long after it arrived gets 429 (None: no deadline); "
                                          "also bounds what the queues admit (replicas/admission.py)")
    tbt_slo_ms: float | None = Field(None, gt=0, description="time-between-tokens SLO: the autoscaler "
                                     "scales against it and, under stall_free, each pass's prefill "
                                     "budget is chosen from it (max_batch_prefill_tokens is the ceiling)")
    slo_budget: bool = Field(_ENGINE.slo_budget, description="with tbt_slo_ms under stall_free: "
                             "choose each pass's prefill budget from the SLO (false: the fixed budget)")
    slo_admission: bool = Field(_ENGINE.slo_admission, description="with the SLO budget: a waiting "
                                "request starts only while the running streams' decodes and it are "
                                "predicted within the SLO (else it waits, and past queue_timeout_s 429)")
    budget_margin: float = Field(_ENGINE.budget_margin, gt=0, le=1, description="the SLO budget aims "
                                 "each pass at tbt_slo_ms x budget_margin")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="reads tool calls out of free text for tool_choice 'auto': hermes takes "
        "<tool_call>{...}</tool_call> blocks (Hermes / Qwen templates); None: 'auto' is a 400")
    stream_interval_ms: float = Field(1000 * _REPLICA.stream_interval_s, ge=0, le=10_000, description=
                                      "a stream's tokens go out at most this often (the first and "
                                      "the last at once), those between merged into one chunk: fewer, "
                                      "larger items through Serve and SSE with many streams; 0: every pass")
    pass_trace_dir: str | None = Field(None, min_length=1, description="each replica writes one "
                                       "JSON line per forward pass here (passes-<pid>.jsonl): wall "
                                       "and CPU time, predicted time, the SLO target and budget")
    wedge_timeout_s: float = Field(_REPLICA.wedge_timeout_s, gt=0, description="one iteration longer than this "
                                   "fails the health check")

    # ---- routing and autoscaling (autoscale/) --------------------------------------------
    router: RouterName = Field(
        "token_load", description="token_load: least predicted token load with KV headroom; "
        "ttft: least predicted time to first token (prompt backlog / the replica's prefill rate, "
        "KV headroom as a filter); prefix: the replica holding the longest cached prefix of the "
        "prompt unless its token load is over the least loaded's by more than prefix_imbalance "
        "of its KV capacity, else token_load; power_of_two: Serve's default, for comparison")
    prefix_imbalance: float = Field(DEFAULT_PREFIX_IMBALANCE, ge=0, description="router: prefix "
                                    "prefers a cached replica while its token load exceeds the least "
                                    "loaded one's by at most this share of its KV capacity")
    autoscale_by: Literal["tbt_slo", "ongoing_requests"] = Field(
        "tbt_slo", description="with max_replicas: scale against tbt_slo_ms (needs it), or "
        "Serve's default request-count policy")
    scaling_window_s: float = Field(_SCALING["window_s"], gt=0, description="TBT p99 sliding window")
    downscale_margin: float = Field(_SCALING["downscale_margin"], gt=0, le=1, description="scale down only when the "
                                    "remaining replicas keep p99 TBT under SLO * margin")
    upscale_cooldown_s: float = Field(_SCALING["upscale_cooldown_s"], ge=0)
    downscale_cooldown_s: float = Field(_SCALING["downscale_cooldown_s"], ge=0)
    controller_name: str = Field(DEFAULT_CONTROLLER_NAME, min_length=1)
    controller_namespace: str = Field(DEFAULT_NAMESPACE, min_length=1)

    # ---- Serve deployment --------------------------------------------------------------
    num_replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(32.0, gt=0)
    max_ongoing_requests: int = Field(256, ge=1, description="per replica; admission is by "
                                      "tokens in the engine, so keep this well above 5")
    max_queued_requests: int = Field(256, ge=1, description="requests waiting in each caller "
                                     "(ingress) for an engine replica slot; beyond it 429")
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    ingress_replicas: int | None = Field(None, ge=1, description="None: 1 with one engine "
                                         "replica, else 2")
    ingress_num_cpus: float = Field(0.5, ge=0, description="reserved per ingress replica: HTTP, "
                                    "JSON and tokenization must not starve under overload")
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    ingress_lag_target_ms: float | None = Field(DEFAULT_TARGET_MS, gt=0, description="the ingress's "
        "in-flight limit adapts (AIMD) to keep its event-loop lag under this; null: no limit but "
        "ingress_max_ongoing_requests (app/stream_limit.py)")
    ingress_min_requests: int = Field(DEFAULT_MIN_LIMIT, ge=1, description="the adaptive limit "
                                      "never goes below this many requests in flight per ingress")
    ingress_max_queued_requests: int = Field(512, ge=1, description="requests the HTTP proxy "
                                             "holds for a busy ingress; beyond it Serve answers "
                                             "429 + Retry-After itself (plain text)")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger bodies get 413")
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0, description="a request body not received within "
                                  "this gets 408")

    @model_validator(mode="after")
    def _check(self) -> AppArgs:
        self.engine_config()  # EngineConfig's ValueError becomes a ValidationError naming it
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError("min_replicas needs max_replicas (autoscaling) as well")
        if self.max_replicas is not None and (self.min_replicas or 0) > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.max_replicas is not None and self.autoscale_by == "tbt_slo":
            self.scaling_config()  # ScalingConfig's ValueError names the field
        if self.tbt_slo_ms is not None and 2 * self.stream_interval_ms > self.tbt_slo_ms:
            # A chunk goes out at the first pass end at least the interval after the last one, so a
            # client's gap is under the interval plus one pass: under 2 x the interval while passes
            # are shorter than it, the pass itself when longer. The proxy door refuses for gaps over
            # the SLO, so an interval over half of it would close the door on a quiet server.
            raise ValueError(f"stream_interval_ms ({self.stream_interval_ms:g}) must be at most half of "
                             f"tbt_slo_ms ({self.tbt_slo_ms:g}): merged chunks alone would make gaps "
                             "over the SLO")
        if self.resolved_device.startswith("cuda") and self.num_gpus <= 0:
            raise ValueError("device is cuda but num_gpus is 0: give each replica a GPU")
        return self

    @property
    def name(self) -> str:
        """The model name clients use in requests and see in /v1/models: `served_model_name`,
        else the model with any ':' made '-' (`embedded:tiny` -> `embedded-tiny`: clients that
        load a tokenizer by the served name cannot take a colon). The model's own spelling
        stays accepted in requests as an alias."""
        return self.served_model_name or self.model.replace(":", "-")

    @property
    def resolved_ingress_replicas(self) -> int:
        if self.ingress_replicas is not None:
            return self.ingress_replicas
        engines = self.max_replicas if self.max_replicas is not None else self.num_replicas
        return 1 if engines <= 1 else 2

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if self.num_gpus > 0 else "cpu"

    @property
    def resolved_torch_threads(self) -> int:
        """Set deliberately: Ray sets OMP_NUM_THREADS from num_cpus, which may be fractional."""
        return self.torch_threads or max(1, int(self.num_cpus))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            policy=self.policy, max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_total_tokens=self.max_batch_total_tokens,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            priority_aging_s=self.priority_aging_s, dtype=self.dtype, device=self.resolved_device,
            num_threads=self.resolved_torch_threads, trust_remote_code=self.trust_remote_code,
            seed=self.seed, queue_timeout_s=self.queue_timeout_s,
            compile_decode_attention=self.compile_decode_attention, tbt_slo_ms=self.tbt_slo_ms,
            enable_prefix_caching=self.enable_prefix_caching,
            slo_budget=self.slo_budget, slo_admission=self.slo_admission, budget_margin=self.budget_margin)

    def scaling_config(self) -> ScalingConfig:
        """The TBT-SLO autoscaling decision's parameters (autoscale.scaling)."""
        if self.tbt_slo_ms is None:
            raise ValueError("autoscale_by: tbt_slo needs tbt_slo_ms")
        return ScalingConfig(
            tbt_slo_s=self.tbt_slo_ms / 1000, window_s=self.scaling_window_s,
            min_replicas=self.min_replicas if self.min_replicas is not None else 1,
            max_replicas=self.max_replicas or 1, downscale_margin=self.downscale_margin,
            upscale_cooldown_s=self.upscale_cooldown_s, downscale_cooldown_s=self.downscale_cooldown_s,
            queued_tokens_per_replica=self.max_queued_tokens // 2)

    def replica_config(self) -> ReplicaConfig:
        return ReplicaConfig(self.model, self.engine_config(), self.max_queued_tokens,
                             self.wedge_timeout_s, self.kv_cache_memory_fraction,
                             stream_interval_s=self.stream_interval_ms / 1000,
                             pass_trace_dir=self.pass_trace_dir)
