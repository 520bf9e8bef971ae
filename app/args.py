"""Application arguments: one pydantic model, validated when the app is built.

`serve_config.yaml` sets these under `applications[].args`; tests pass a dict to
`app.builder.build_app`. The engine's and the replica's settings are the records of
replicas/config.py, nested as they are (`engine:`, `replica:`): every setting is defined, defaulted
and validated in exactly one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.proxy_door import ProxyDoorConfig
from app.middleware import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from app.stream_limit import DEFAULT_MIN_LIMIT, DEFAULT_TARGET_MS
from autoscale.controller import DEFAULT_CONTROLLER_NAME, DEFAULT_NAMESPACE
from autoscale.haproxy_weights import DEFAULT_INTERVAL_MS as DEFAULT_WEIGHT_INTERVAL_MS
from autoscale.routing import DEFAULT_PREFIX_IMBALANCE
from autoscale.scaling import ScalingConfig, queued_tokens_threshold
from autoscale.serve_options import RouterName
from replicas.config import DEFAULT_MODEL, EngineConfig, ReplicaConfig, ReplicaOptions

# Defaults are defined once, in the records they configure.
GPU_REPLICA_CPUS = 4.0


class AppArgs(BaseModel):
    """Everything `serve run serve_config.yaml` can set for one model application."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- model -----------------------------------------------------------------------
    model: str = Field(DEFAULT_MODEL, min_length=1,
                       description="HF model directory, a .gguf file, hub id, or embedded:smollm2 "
                       "(a real model) / embedded:tiny / embedded:mid (random weights)")
    served_model_name: str | None = Field(None, description="name clients send; default: model")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="reads tool calls out of free text for tool_choice 'auto': hermes takes "
        "<tool_call>{...}</tool_call> blocks (Hermes / Qwen templates); None: 'auto' is a 400")

    # ---- the engine and the replica around it (replicas/config.py) --------------------------
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the engine's budgets "
                                 "and knobs (EngineConfig)")
    replica: ReplicaOptions = Field(default_factory=ReplicaOptions, description="the replica's "
                                    "queue cap, stream interval, health and trace (ReplicaOptions)")
    proxy_door: ProxyDoorConfig = Field(default_factory=ProxyDoorConfig, description="the 429 door "
                                        "in Serve's HTTP proxy (app/proxy_door.py)")

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
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="how many engine "
                                   "replicas, between which bounds, scaled by what (ScalingConfig)")
    controller_name: str = Field(DEFAULT_CONTROLLER_NAME, min_length=1, description="the named Ray "
                                 "actor that collects load reports, routes and scales (autoscale/)")
    controller_namespace: str = Field(DEFAULT_NAMESPACE, min_length=1, description="its Ray namespace")

    # ---- Serve deployment --------------------------------------------------------------
    num_replicas: int = Field(1, ge=1, description="engine replicas, when not autoscaling "
                              "(scaling.max_replicas unset)")
    max_ongoing_requests: int = Field(256, ge=1, description="per replica; admission is by "
                                      "tokens in the engine, so keep this well above 5")
    max_queued_requests: int = Field(256, ge=1, description="requests waiting in each caller "
                                     "(ingress) for an engine replica slot; beyond it 429")
    num_cpus: float | None = Field(None, ge=0, description="CPUs reserved per engine replica "
                                   f"(its torch threads follow); null: 1, or {GPU_REPLICA_CPUS} with "
                                   "num_gpus > 0: a GPU replica's host work (scheduling, sampling, "
                                   "detokenizing, copies) must keep up with the device")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per engine replica; under 1, replicas "
                            "share a device and each sizes its memory from its share")
    ingress_in_replica: bool = Field(False, description="the engine replicas serve the OpenAI API "
        "themselves (no ingress deployment): one Ray hop per request and per streamed event instead "
        "of two; the proxy routes by the replicas' token load alone (no prefix or prompt-size "
        "ranking: it routes before reading the body), and a request whose replica dies is not "
        "resent (app/replica_ingress.py)")
    ingress_router: bool = Field(False, description="with ingress_in_replica behind Ray's HAProxy and "
        "more than one replica: HAProxy asks the app's router which replica serves each request "
        "(app/ingress_router.py); false: HAProxy balances the replicas by least connections. Opt-in: "
        "under a 10x overload on 2 cores requests waited seconds for their route, before any door")
    haproxy_weight_interval_ms: int | None = Field(DEFAULT_WEIGHT_INTERVAL_MS, ge=10, description="with "
        "ingress_in_replica behind Ray's HAProxy, more than one replica and no ingress_router: one engine "
        "replica per node sets HAProxy's server weights from the replicas' token load this often, so that "
        "its least connections prefers the least token load, and equal weights while a replica's door "
        "refuses (autoscale/haproxy_weights.py; router token_load or ttft, both by token load there); "
        "null: plain least connections. Below saturation it cut TTFT p99 20-57%; at 10x overload it "
        "served as many as plain least connections (docs/results/routing.md)")
    ingress_replicas: int | None = Field(None, ge=1, description="HTTP ingress replicas; null: 1 "
                                         "with one engine replica, else 2")
    ingress_num_cpus: float = Field(0.5, ge=0, description="reserved per ingress replica: HTTP, "
                                    "JSON and tokenization must not starve under overload")
    ingress_max_ongoing_requests: int = Field(1024, ge=1, description="requests one ingress "
                                              "replica holds at once, at most")
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
        self.replica_config()  # checks the settings that depend on each other (the stream interval)
        if self.scaling.autoscaling and self.scaling.by == "tbt_slo" and self.engine.tbt_slo_ms is None:
            raise ValueError("scaling.by tbt_slo needs engine.tbt_slo_ms")
        if self.engine.device.startswith("cuda") and self.num_gpus <= 0:
            raise ValueError("engine.device is cuda but num_gpus is 0: give each replica a GPU")
        if self.ingress_router and not self.ingress_in_replica:
            raise ValueError("ingress_router is HAProxy's way to the engine replicas serving HTTP themselves "
                             "(ingress_in_replica: true); the ingress deployment routes with the app's router "
                             "already")
        if self.ingress_in_replica and self.router == "prefix":
            raise ValueError("router prefix needs the prompt, which Serve's proxy does not read before it "
                             "routes to an engine replica serving HTTP itself (ingress_in_replica): use "
                             "token_load or ttft there")
        if self.engine.tensor_parallel_size > 1 and self.num_gpus not in (0, 1):
            raise ValueError(f"engine.tensor_parallel_size {self.engine.tensor_parallel_size} takes whole GPUs, one "
                             f"per rank: num_gpus must be 1 (or 0 on CPU), got {self.num_gpus}")
        return self

    def several_replicas(self) -> bool:
        """Whether there can be more than one engine replica to choose from."""
        return self.scaling.autoscaling or self.num_replicas > 1

    def asks_router(self) -> bool:
        """Whether HAProxy asks the app's router which engine replica serves (`ingress_router`):
        only where there is more than one to choose from."""
        return self.ingress_router and self.several_replicas()

    def haproxy_weights(self) -> bool:
        """Whether the engine replicas steer HAProxy's least connections by token load
        (`haproxy_weight_interval_ms`), where HAProxy chooses among several replicas itself."""
        return (self.ingress_in_replica and self.haproxy_weight_interval_ms is not None
                and not self.ingress_router and self.router != "power_of_two" and self.several_replicas())

    def replica_bundles(self) -> list[dict[str, float]]:
        """What one engine replica takes of a node: its placement group's bundles, or its actor's."""
        group = self.placement_group()
        if group is not None:
            return group["placement_group_bundles"]
        return [{"CPU": self.resolved_num_cpus, "GPU": self.num_gpus}]

    def placement_group(self) -> dict[str, Any] | None:
        """A tensor-parallel replica's resources, one bundle per rank: the replica (rank 0) with
        its CPUs on the first, a worker on each of the others (a GPU each, on one node: STRICT_PACK;
        a CPU each on CPU hosts). None with tensor_parallel_size 1."""
        tp = self.engine.tensor_parallel_size
        if tp == 1:
            return None
        if self.num_gpus > 0:
            bundles = [{"CPU": self.resolved_num_cpus, "GPU": 1}] + [{"GPU": 1}] * (tp - 1)
            return {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
        bundles = [{"CPU": self.resolved_num_cpus}] * tp  # a rank computes as much as rank 0
        return {"placement_group_bundles": bundles, "placement_group_strategy": "PACK"}

    @property
    def name(self) -> str:
        """The model name clients use in requests and see in /v1/models: `served_model_name`,
        else the model with any ':' made '-' (`embedded:tiny` -> `embedded-tiny`: clients that
        load a tokenizer by the served name cannot take a colon). The model's own spelling
        stays accepted in requests as an alias."""
        return self.served_model_name or self.model.replace(":", "-")

    @property
    def resolved_num_cpus(self) -> float:
        if self.num_cpus is not None:
            return self.num_cpus
        return GPU_REPLICA_CPUS if self.num_gpus > 0 else 1.0

    @property
    def resolved_ingress_replicas(self) -> int:
        if self.ingress_replicas is not None:
            return self.ingress_replicas
        engines = self.scaling.upper if self.scaling.autoscaling else self.num_replicas
        return 1 if engines <= 1 else 2

    def scaling_config(self) -> ScalingConfig:
        """`scaling` with its queue rule resolved: null is half the replica's queue cap."""
        queued = self.scaling.queued_tokens_per_replica or queued_tokens_threshold(self.replica.max_queued_tokens)
        return dataclasses.replace(self.scaling, queued_tokens_per_replica=queued)

    def replica_config(self) -> ReplicaConfig:
        """What each engine replica is built from. Its torch threads follow its num_cpus unless
        engine.num_threads says otherwise: set deliberately, because Ray sets OMP_NUM_THREADS from
        num_cpus, which may be fractional."""
        engine = self.engine
        if engine.num_threads is None:
            engine = engine.replace(num_threads=max(1, int(self.resolved_num_cpus)))
        return ReplicaConfig(model=self.model, engine=engine, options=self.replica)
