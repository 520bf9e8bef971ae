"""Building a replica spec from named profiles: GPU, model, policy and budgets in one call."""

from __future__ import annotations

from loadtests.sim.costmodel import CostModel, kv_capacity_tokens, load_profiles
from loadtests.sim.replica import ReplicaSpec
from replicas.config import EngineConfig

# vLLM's default max_num_seqs; the engine's own default (128) is sized for a CPU.
GPU_MAX_NUM_SEQS = 256


def replica_spec(gpu: str, model: str, policy: str, mbp: int, *, tp: int | None = None,
                 max_num_seqs: int = GPU_MAX_NUM_SEQS, block_size: int = 16,
                 kv_tokens: int | None = None, cost: CostModel | None = None,
                 max_model_len: int | None = None, prefix_caching: bool = False) -> ReplicaSpec:
    """A replica of `model` on `gpu` (profiles.json) running `policy` with MBP `mbp`.

    KV capacity defaults to what the GPU's memory holds after the weights (`kv_capacity_tokens`).
    Prefix caching is off unless asked: only workloads with real token ids share prefixes.
    """
    prof = load_profiles()
    kv = kv_tokens if kv_tokens is not None else kv_capacity_tokens(gpu, model, tp, prof)
    blocks = kv // block_size
    engine = EngineConfig(policy=policy, max_batch_prefill_tokens=mbp,
                          max_batch_total_tokens=blocks * block_size, block_size=block_size,
                          max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching,
                          tensor_parallel_size=tp or prof["models"][model]["tp"])
    return ReplicaSpec(engine, blocks, cost or CostModel.from_profile(gpu, model, tp, prof),
                       max_model_len or prof["models"][model]["max_model_len"])
