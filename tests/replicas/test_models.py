"""Tests for replicas.loading.models: the embedded model build, loading and the support checks."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, BertConfig, BloomConfig,
                          FalconConfig, Gemma2Config, GemmaConfig, GPT2Config, GPTNeoXConfig,
                          LlamaConfig, LlavaConfig, MistralConfig, MixtralConfig, Olmo2Config,
                          OPTConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen3Config,
                          T5Config)

from replicas.loading import models
from replicas.loading.models import (DEFAULT_MODEL, check_supported, load_model, model_max_length,
                             resolve_model_path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Point the model cache at a temp dir so tests never write into the user's home."""
    root = tmp_path_factory.mktemp("stallfree-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STALLFREE_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def tiny_path(cache_dir: Path) -> Path:
    return Path(resolve_model_path("embedded:tiny"))


@pytest.mark.unit
def test_default_is_the_real_embedded_model() -> None:
    assert DEFAULT_MODEL == "embedded:smollm2"


@pytest.mark.engine
def test_tiny_builds_into_cache_and_loads_back(cache_dir: Path, tiny_path: Path) -> None:
    assert tiny_path == cache_dir / "models" / "tiny-v2"
    assert (tiny_path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tiny_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size) == ("llama", 64, 176)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 16 and cfg.max_position_embeddings == 2048
    assert len(tok) == 2048 <= cfg.vocab_size
    ids = torch.tensor([tok.encode("hello world")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.engine
def test_build_is_deterministic(tiny_path: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path))
    other = Path(resolve_model_path("embedded:tiny"))
    assert other != tiny_path
    for name in ("model.safetensors", "tokenizer.json"):
        assert (other / name).read_bytes() == (tiny_path / name).read_bytes(), name


@pytest.mark.engine
@pytest.mark.parametrize("text", [
    "héllo wörld 你好 🙂",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "a , b . c ! don 't",
    "Ünïcödé: Ελληνικά, русский, العربية, 日本語, 👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n",
])
def test_tokenizer_round_trips_exactly(tiny_path: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    ids = tok.encode(text)
    assert ids and max(ids) < len(tok)
    assert tok.decode(ids) == text


@pytest.mark.engine
def test_special_tokens_are_single_ids(tiny_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special)) == 1, special
    # Byte-level BPE: no tokenizer-added BOS, so prompts are exactly their text.
    assert tok.encode("x") == tok.convert_tokens_to_ids(["x"])


@pytest.mark.engine
def test_chat_template_renders_chatml(tiny_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == rendered.removesuffix("<|im_start|>assistant\n")


@pytest.mark.engine
def test_config_ids_match_tokenizer(tiny_path: Path) -> None:
    model, tok = load_model(str(tiny_path))
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == eos
    cfg = model.config
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == eos
    assert model.generation_config.eos_token_id == [eos, tok.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.engine
def test_second_resolve_reuses_directory(tiny_path: Path) -> None:
    config = tiny_path / "config.json"
    before = config.stat().st_mtime_ns
    assert Path(resolve_model_path("embedded:tiny")) == tiny_path
    assert config.stat().st_mtime_ns == before


@pytest.mark.engine
def test_concurrent_builds_share_one_directory(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path))
    results: list[str] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(resolve_model_path("embedded:tiny"))
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    entries = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert entries == [".tiny-v2.lock", "tiny-v2"]  # no leftover temp dirs


@pytest.mark.unit
def test_resolve_passes_other_names_through_and_rejects_unknown_embedded() -> None:
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model_path("/some/local/dir") == "/some/local/dir"
    assert resolve_model_path("tiny") == "tiny"  # only the embedded: prefix is special
    with pytest.raises(ValueError, match="embedded:tiny.*embedded:mid"):
        resolve_model_path("embedded:huge")


@pytest.mark.engine
def test_load_model_eval_no_grad_float32(cache_dir: Path) -> None:
    model, tok = load_model("embedded:tiny")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert tok.pad_token_id is not None
    model16, _ = load_model("embedded:tiny", dtype="bfloat16")
    assert next(model16.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model("embedded:tiny", dtype="int8")


@pytest.mark.engine
def test_load_model_sets_pad_to_eos(tiny_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "nopad"
    shutil.copytree(tiny_path, copy)
    cfg_file = copy / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    del tok_cfg["pad_token"]
    cfg_file.write_text(json.dumps(tok_cfg))
    assert AutoTokenizer.from_pretrained(copy, local_files_only=True).pad_token is None
    _, tok = load_model(str(copy))
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"


@pytest.mark.unit
def test_load_model_refuses_before_reading_weights(tmp_path: Path) -> None:
    # Only a config, no weights: the refusal must come from check_supported, not a missing file.
    Gemma2Config().save_pretrained(tmp_path)
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="soft-capping"):
        load_model(str(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize(("config", "reason"), [
    (Gemma2Config(), r"'gemma2'.*sliding-window.*attn_logit_softcapping=50.0"),
    (MistralConfig(sliding_window=16), r"'mistral'.*sliding-window"),
    (T5Config(), r"'t5'.*encoder-decoder"),
    (BloomConfig(), r"'bloom'.*ALiBi"),
    (GPT2Config(scale_attn_by_inverse_layer_idx=True), r"'gpt2'.*scale_attn_by_inverse_layer_idx"),
    (GPT2Config(reorder_and_upcast_attn=True), r"'gpt2'.*reorder_and_upcast_attn"),
    (LlavaConfig(), r"multimodal"),
    (BertConfig(), r"'bert'.*verified list"),
    (FalconConfig(alibi=True), r"'falcon'.*ALiBi"),
    (MixtralConfig(sliding_window=None), r"'mixtral'.*verified list"),
])
def test_check_supported_refuses(config, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_supported(config)


@pytest.mark.unit
@pytest.mark.parametrize("config", [
    LlamaConfig(),
    GPT2Config(),
    Qwen2Config(),  # carries sliding_window=4096 but use_sliding_window=False
    MistralConfig(sliding_window=None),
    MistralConfig(sliding_window=4096, max_position_embeddings=4096),  # window never binds
    Qwen3Config(), Phi3Config(), GemmaConfig(), GPTNeoXConfig(), OPTConfig(), Olmo2Config(),
])
def test_check_supported_accepts(config) -> None:
    check_supported(config)


@pytest.mark.unit
def test_model_max_length() -> None:
    assert model_max_length(LlamaConfig(max_position_embeddings=1234)) == 1234
    assert model_max_length(GPT2Config(n_positions=777)) == 777
    with pytest.raises(ValueError, match="maximum sequence length"):
        model_max_length(PretrainedConfig())


@pytest.mark.engine
def test_embedded_specs() -> None:
    tiny, mid = models.EMBEDDED_MODELS["tiny"], models.EMBEDDED_MODELS["mid"]
    assert (tiny.hidden_size, tiny.vocab_size, tiny.seed) == (64, 2048, 0)
    assert (mid.hidden_size, mid.intermediate_size, mid.num_hidden_layers) == (512, 1408, 8)
    assert (mid.num_attention_heads, mid.num_key_value_heads, mid.vocab_size) == (8, 4, 32000)
    assert mid.max_position_embeddings == 4096
    assert os.fspath(models.cache_root())  # resolvable without touching the filesystem


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      segment_ids=None, **kwargs):
    """Block-diagonal causal attention over packed sequences, as the engine does it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    t = query.shape[2]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (segment_ids[:, None] == segment_ids)
    _packed_attention.calls += 1
    return sdpa_attention_forward(module, query, key, value, mask[None, None], scaling=scaling,
                                  dropout=dropout, is_causal=False)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", sorted(models.VERIFIED_MODEL_TYPES))
def test_verified_types_route_attention_through_interface(model_type: str) -> None:
    """The allow-list's premise: a replaced attention function serves packed sequences exactly."""
    from transformers import AttentionInterface, AutoConfig

    AttentionInterface.register("test_models_packed", _packed_attention)
    shape = {"gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
             "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=128, word_embed_proj_dim=64)}.get(
        model_type, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=128))
    if model_type not in ("gpt2", "opt", "gpt_neox"):  # GQA families: defaults exceed 4 heads
        shape.setdefault("num_key_value_heads", 2)
    config = AutoConfig.for_model(model_type, vocab_size=256, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0, **shape)
    check_supported(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    a, b = torch.randint(1, 256, (1, 7)), torch.randint(1, 256, (1, 5))
    with torch.no_grad():
        ref_a, ref_b = model(a).logits, model(b).logits
        model.set_attn_implementation("test_models_packed")
        _packed_attention.calls = 0
        out = model(torch.cat([a, b], 1), use_cache=False,
                    position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None],
                    segment_ids=torch.tensor([0] * 7 + [1] * 5)).logits
    assert _packed_attention.calls == 2  # one call per layer: nothing bypassed the interface
    torch.testing.assert_close(out[:, :7], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 7:], ref_b, atol=1e-5, rtol=1e-5)
