"""One model replica: the continuous-batching engine and the Serve deployment that hosts it.

The package root is lazy: `import replicas.protocol` (the ingress does) must not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "replicas.engine",
    "CompletionOutput": "replicas.engine",
    "EngineConfig": "replicas.config",
    "RequestOutput": "replicas.protocol",
    "ReplicaLoad": "replicas.protocol",
    "SamplingParams": "replicas.protocol",
    "GuidedDecoding": "replicas.protocol",
    "RequestStatus": "replicas.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'replicas' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
