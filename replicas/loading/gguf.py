"""GGUF files as a model source: checked, dequantized once, saved as a plain HF model directory.

The engine runs Hugging Face modules on plain float weights, so a GGUF file (llama.cpp's format,
quantized) is converted once: transformers dequantizes it (`from_pretrained(gguf_file=...)`, which
needs the `gguf` and `accelerate` packages) and the float tensors are saved with the tokenizer,
its chat template and the generation config. From then on the model loads through the same
`from_pretrained(dir, local_files_only=True)` path as any model directory.

What cannot be served correctly is refused before any tensor is dequantized: an architecture
transformers cannot map, a tensor type `gguf` cannot dequantize, or a model the engine's
attention does not support (`models.check_supported`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

# Tensor types stored unquantized: no dequantization step is needed for them.
_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def _field_str(reader, key: str) -> str | None:  # noqa: ANN001 (gguf.GGUFReader)
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def inspect_gguf(path: str | Path) -> tuple[str, dict[str, int]]:
    """The file's architecture and a count of its tensor types; ValueError if transformers
    cannot load it (unknown architecture, a tensor type with no dequantizer)."""
    try:
        import gguf
        from gguf.quants import _type_traits
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise ValueError("GGUF files need the `gguf` package: pip install gguf accelerate") from e
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))  # memory-mapped: reads the header, not the weights
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _field_str(reader, "general.architecture") or "<none>"
    # "general" and "tokenizer" are metadata sections of transformers' mapping, not models.
    loadable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if arch not in loadable:
        raise ValueError(f"{path}: GGUF architecture {arch!r} cannot be loaded by transformers "
                         f"(it loads: {', '.join(loadable)})")
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    dequantizable = _PLAIN_TYPES | {t.name for t in _type_traits}
    if bad := sorted(set(types) - dequantizable):
        raise ValueError(f"{path}: GGUF tensor type(s) {', '.join(bad)} cannot be dequantized "
                         "by the installed gguf package")
    return arch, types


def convert_gguf(path: str | Path, out_dir: Path) -> None:
    """Dequantize the GGUF file at `path` into an HF model directory at `out_dir` (float32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from replicas.loading.model_support import check_supported, model_max_length

    path = Path(path)
    inspect_gguf(path)
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    config = AutoConfig.from_pretrained(**where)  # metadata only
    check_supported(config)  # before the weights: refusing should be cheap
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    # save_pretrained refuses a model with its GGUF quantizer attached; the tensors are plain
    # float32 now, so the quantizer and its config entry are dropped and they save as they are.
    model.hf_quantizer = None
    model.config.dtype = torch.float32
    gen = model.generation_config
    if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
        gen.eos_token_id = tokenizer.eos_token_id
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gen.eos_token_id
    # GGUF tokenizers carry no length limit; the model's context is the one that holds.
    tokenizer.model_max_length = model_max_length(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _drop_quantization_entry(out_dir / "config.json")
    (out_dir / "source.json").write_text(json.dumps({"gguf_file": str(path.resolve())}) + "\n")


def _drop_quantization_entry(config_json: Path) -> None:
    # The GGUF quantization_config the saved config still carries would make from_pretrained look
    # for a quantizer again; the directory holds plain tensors.
    cfg = json.loads(config_json.read_text())
    if cfg.pop("quantization_config", "absent") != "absent":
        config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
