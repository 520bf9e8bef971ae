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
