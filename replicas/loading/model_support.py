"""What the engine can serve and the sizes it reads from a model's config: no torch, so the
ingress, the GGUF converter and the loader share it."""

from __future__ import annotations

from typing import Any

PretrainedConfig = Any  # transformers' config classes; only their attributes are read

# Model types whose attention is verified to run through transformers' AttentionInterface
# (so the engine's packed attention replaces it) and that take explicit position_ids.
VERIFIED_MODEL_TYPES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "opt", "olmo2", "phi3", "gemma"}
)


def _max_length_or_none(config: PretrainedConfig) -> int | None:
    # Different families name it differently (GPT-2: n_positions, MPT: max_sequence_length).
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(value := getattr(config, attr, None), int) and value > 0:
            return value
    return None


def model_max_length(config: PretrainedConfig) -> int:
    """Longest sequence the model's position scheme supports."""
    if (value := _max_length_or_none(config)) is None:
        raise ValueError(f"{config.model_type}: config gives no maximum sequence length")
    return value


def _sliding_window_in_effect(config: PretrainedConfig) -> bool:
    # Qwen2/Qwen3 keep a sliding_window value even when use_sliding_window is False; HF then
    # ignores it, and so may we.
    if getattr(config, "use_sliding_window", None) is False:
        return False
    window = getattr(config, "sliding_window", None)
    if window is None:
        return False
    if (max_len := _max_length_or_none(config)) is not None and window >= max_len:
        return False  # the window can never cut anything off
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # per-layer schedule decides, e.g. Qwen2 max_window_layers
        return "sliding_attention" in layer_types
    return True


def check_supported(config: PretrainedConfig) -> None:
    """Raise ValueError if this engine cannot serve ``config``'s model correctly.

    Every reason found is listed (a Gemma2 config has both a sliding window and soft-capping),
    feature reasons before the allow-list so the message says what actually breaks.
    """
    reasons: list[str] = []
    if any(getattr(config, a, None) is not None for a in ("text_config", "vision_config")):
        reasons.append("multimodal config (text_config/vision_config); use a text-only causal LM")
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder model; only decoder-only causal LMs are served")
    if _sliding_window_in_effect(config):
        reasons.append(f"sliding-window attention (sliding_window={config.sliding_window}) is "
                       "not implemented by the engine's full causal attention")
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, attr, None) is not None:
            reasons.append(f"logit soft-capping ({attr}={getattr(config, attr)})")
    mt = getattr(config, "model_type", None) or type(config).__name__
    attn_config = getattr(config, "attn_config", None)  # MPT keeps its alibi flag in here
    mpt_alibi = (attn_config.get("alibi") if isinstance(attn_config, dict)
                 else getattr(attn_config, "alibi", False))
    if mt == "bloom" or getattr(config, "alibi", False) or mpt_alibi:
        reasons.append("ALiBi position biases are not applied by the engine's attention")
    for attr in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(config, attr, False):
            reasons.append(f"GPT-2 option {attr}=True changes attention numerics")
    if mt not in VERIFIED_MODEL_TYPES:
        verified = ", ".join(sorted(VERIFIED_MODEL_TYPES))
        reasons.append("not on the verified list of model types whose attention runs through "
                       f"transformers' attention interface ({verified})")
    if reasons:
        raise ValueError(f"model type {mt!r} is not supported: " + "; ".join(reasons))


def text_config(config):  # noqa: ANN001, ANN201
    """The decoder's own config (a multimodal config holds it inside)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(config) -> tuple[int, int, int]:  # noqa: ANN001
    """(layers, kv_heads, head_dim) of a decoder config."""
    text = text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


# How a tensor-parallel plan shards an attention projection: these split the heads over the
# ranks (each rank's attention sees heads / tp); the "gather" styles hand every rank all heads.
HEAD_SPLITTING_STYLES = frozenset({"colwise"})
_KV_PROJECTIONS = ("self_attn.k_proj", "self_attn.qkv_proj", "attention.query_key_value",
                   "self_attn.query_key_value")


def tensor_parallel_plan(config) -> dict[str, str]:  # noqa: ANN001
    """The model's own tensor-parallel plan (transformers' `base_model_tp_plan`), or {}."""
    return dict(getattr(text_config(config), "base_model_tp_plan", None) or {})


def heads_per_rank(config, tp: int) -> tuple[int, int]:  # noqa: ANN001
    """(query heads, KV heads) one rank's attention sees under `tp`-way tensor parallelism: the
    plan splits them (Llama's colwise q/k/v) or gathers them whole on every rank (OLMo2, Phi-3)."""
    text = text_config(config)
    heads = text.num_attention_heads
    _, kv_heads, _ = kv_shape(config)
    if tp == 1:
        return heads, kv_heads
    styles = {k: v for k, v in tensor_parallel_plan(config).items() if k.endswith(_KV_PROJECTIONS)}
    if styles and all(v in HEAD_SPLITTING_STYLES for v in styles.values()):
        return heads // tp, kv_heads // tp
    return heads, kv_heads


def check_tensor_parallel(config, tp: int) -> None:  # noqa: ANN001
    """Raise ValueError, naming the number that fails, if `tp`-way tensor parallelism cannot
    shard this model: no plan, or heads, KV heads, vocabulary or MLP width not divisible by tp
    (transformers would only fail mid-forward for some of these)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp == 1:
        return
    mt = getattr(config, "model_type", None) or type(config).__name__
    if not tensor_parallel_plan(config):
        raise ValueError(f"tensor_parallel_size={tp}: model type {mt!r} ships no tensor-parallel plan "
                         "(transformers' base_model_tp_plan); serve it with tensor_parallel_size 1")
    text = text_config(config)
    _, kv_heads, _ = kv_shape(config)
    if kv_heads < tp:
        raise ValueError(f"tensor_parallel_size={tp} is above the model's {kv_heads} KV heads "
                         "(num_key_value_heads): each rank needs a KV head of its own")
    sizes = {"attention heads (num_attention_heads)": text.num_attention_heads,
             "KV heads (num_key_value_heads)": kv_heads,
             "vocabulary (vocab_size)": getattr(text, "vocab_size", None),
             "MLP width (intermediate_size)": getattr(text, "intermediate_size", None)}
    for what, n in sizes.items():
        if isinstance(n, int) and n % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {n} {what}")
