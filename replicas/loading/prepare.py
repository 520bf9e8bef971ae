"""Building a model directory once per machine: the embedded test models (random weights, a
trained tokenizer) and GGUF files (dequantized). It needs torch, so only a process that loads
the model imports it: the replica, in process (`models.load_model`); the ingress and the tools,
which need the tokenizer alone, run `python -m replicas.loading.prepare MODEL` in a process of their own
(`model_files.resolve_model_path`). A file lock makes concurrent builds share one directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from replicas.loading import embedded, gguf
from replicas.loading.model_files import EMBEDDED_MODELS, build_once, planned_build


def prepare(model: str) -> str:
    """The loadable path of `model`, built into the cache first when it is an embedded model or
    a GGUF file not built yet; anything else unchanged."""
    build = planned_build(model)
    if build is None:
        return model
    if build.kind == "embedded":
        spec = EMBEDDED_MODELS[build.source]
        return str(build_once(build.dir, lambda out: embedded.build_embedded(spec, out)))
    return str(build_once(build.dir, lambda out: gguf.convert_gguf(Path(build.source), out)))


if __name__ == "__main__":
    print(prepare(sys.argv[1]))
