"""The Triton block sizes inductor picks for the flex kernels, recorded while engines warm up.

Inductor lowers each flex_attention call to a Triton template (`flex_attention` for prefill
chunks and mixed passes, `flex_decoding` for one-row decode entries) and appends a choice per
config it keeps (`TritonTemplate.maybe_append_choice`, torch 2.11-2.13). Wrapping that method
records each choice's tile sizes, split and warps: the probe's JSON and log then show what the
kernels really run (BLOCK_N of one 16-slot page, SPLIT_KV 1 at B=64...). Torch's internals move:
where the method is missing, the record says so and nothing else changes. Nothing is recorded on
CPU (dynamo's eager backend lowers nothing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
KEYS = ("BLOCK_M", "BLOCK_N", "SPLIT_KV", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "num_warps",
        "num_stages", "FORCE_USE_FLEX_ATTENTION", "GQA_SHARED_HEADS")


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


@contextlib.contextmanager
def flex_choices() -> Iterator[dict[str, Any]]:
    """Yields {"available": bool, "choices": [{"template", "query_shape", BLOCK_M, BLOCK_N, ...}]},
    filled while the block runs (each distinct choice once)."""
    record: dict[str, Any] = {"available": False, "choices": []}
    try:
        from torch._inductor.select_algorithm import TritonTemplate
    except ImportError as exc:
        record["why"] = f"torch._inductor.select_algorithm: {exc}"
        yield record
        return
    original = getattr(TritonTemplate, "maybe_append_choice", None)
    if original is None:
        record["why"] = "TritonTemplate.maybe_append_choice is gone"
        yield record
        return
    seen: set[tuple] = set()

    def recording(self, choices, **kwargs):  # noqa: ANN001, ANN202 (torch's signature)
        if str(getattr(self, "name", "")).startswith("flex"):
            row = {"template": self.name, "query_shape": _plain(list(kwargs.get("call_sizes") or []))}
            row |= {k: _plain(kwargs[k]) for k in KEYS if k in kwargs}
            key = tuple(sorted(row.items(), key=lambda kv: kv[0]))
            if key not in seen:
                seen.add(key)
                record["choices"].append(row)
                log.info("inductor flex choice: %s", row)
        return original(self, choices, **kwargs)

    record["available"] = True
    TritonTemplate.maybe_append_choice = recording
    try:
        yield record
    finally:
        TritonTemplate.maybe_append_choice = original
