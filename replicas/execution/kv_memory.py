"""How much device memory the KV cache gets (`kv_cache_memory_fraction`).

vLLM's rule (`gpu_memory_utilization`): the fraction of the device's total memory, less the
weights and one pass's activations. On a GPU that over-counts what is there: the CUDA context,
other processes, and what this replica holds beside the cache once it serves (the captured decode
graphs' memory pool, inductor's compile and autotune workspace) are not in it, and a cache sized
from the total fails to allocate, or leaves the first capture out of memory. So on CUDA the cache
is also capped by the memory free now (weights already loaded) less the activations, the graph
pool (one pass's activations again: the buckets share one pool, the largest captured first) and
a fixed compile workspace. The smaller of the two wins, and the log says which.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch

from replicas.config import EngineConfig
from replicas.loading.model_support import text_config

COMPILE_WORKSPACE = 1 << 30  # inductor's autotuning and Triton's scratch while graphs compile


def device_memory_bytes(device: torch.device) -> int:
    """The device's total memory: the GPU's, or the machine's RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free on the device now (CUDA); None elsewhere (a CPU's free RAM says nothing
    about what this process may take)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def weight_bytes(model: Any) -> int:
    """The weights this rank holds (a tensor-parallel shard's DTensors count their local part)."""
    return sum(_local(t).numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def activation_bytes(model_config: Any, cfg: EngineConfig, max_model_len: int, elem: int) -> int:
    """What one pass may hold besides weights and KV, over-estimated: the hidden states and MLP
    activations of a full token budget, one prefill chunk's attention scores over the longest
    context, and fp32 logits for every running sequence."""
    text = text_config(model_config)
    tokens = cfg.max_batch_prefill_tokens
    hidden = tokens * (6 * text.hidden_size + 3 * text.intermediate_size) * elem
    scores = tokens * max_model_len * text.num_attention_heads * 4
    logits = (cfg.max_num_seqs + tokens // 8) * text.vocab_size * 4
    return hidden + scores + logits


def kv_memory_bytes(total: int, fraction: float, weights: int, activations: int, free: int | None = None,
                    graphs: bool = False) -> tuple[int, str]:
    """The KV cache's bytes and what set them: "total" (`fraction` of `total` less the weights and
    one pass's activations) or "free" (the `free` memory, weights already loaded, less the
    activations, the graph pool when `graphs` are captured, and the compile workspace)."""
    kv, source = int(total * fraction) - weights - activations, "total"
    if free is not None:
        reserve = activations * (2 if graphs else 1) + COMPILE_WORKSPACE
        if free - reserve < kv:
            kv, source = free - reserve, "free"
    if kv <= 0:
        raise ValueError(f"kv_cache_memory_fraction {fraction:g} of {total >> 20} MiB leaves no KV "
                         f"cache after {weights >> 20} MiB of weights and {activations >> 20} MiB of "
                         "activations" + (f" ({free >> 20} MiB free now)" if free is not None else "") +
                         ": raise it, or lower max_batch_prefill_tokens / max_model_len")
    return kv, source
