"""Where a model's files are: embedded models (built once, cached) and plain paths or hub ids.

Light on purpose (no torch): the ingress resolves the tokenizer's directory with it. Building an
embedded model (random weights) needs torch and happens in `replicas.models.build_embedded`.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_PREFIX = "embedded:"
# Bump when the build recipe (corpus, config, seed handling) changes, so stale caches are ignored.
_RECIPE_VERSION = 2


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

def cache_root() -> Path:
    """``$STALLFREE_CACHE`` if set, else ``~/.cache/stallfree-serve``."""
    env = os.environ.get("STALLFREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "stallfree-serve"


def ensure_embedded(name: str) -> Path:
    """Return the directory of embedded model ``name``, building it once if needed.

    Several replica processes may start at once: a file lock serialises the build and the
    result is renamed into place atomically, so readers never see a half-written directory.
    """
    if name not in EMBEDDED_MODELS:
        known = ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)
        raise ValueError(f"unknown embedded model {name!r}; known: {known}")
    parent = cache_root() / "models"
    final = parent / f"{name}-v{_RECIPE_VERSION}"
    if (final / "config.json").is_file():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if (final / "config.json").is_file():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
            from replicas.models import build_embedded  # torch: only when building
            build_embedded(EMBEDDED_MODELS[name], tmp)
            if final.exists():  # leftover without config.json: not a usable model
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def resolve_model_path(model: str) -> str:
    """Map ``embedded:<name>`` to its built directory; return anything else unchanged."""
    if model.startswith(EMBEDDED_PREFIX):
        return str(ensure_embedded(model[len(EMBEDDED_PREFIX):]))
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
