"""The KV cache gets what the device can give it: a fraction of the total less the weights and a
pass's activations, and on a GPU no more than is free now less what serving holds beside it."""

from __future__ import annotations

import pytest
import torch

from replicas.execution.attention import resolve_block_size
from replicas.execution.kv_memory import kv_memory_bytes

pytestmark = pytest.mark.unit


def test_on_a_gpu_the_kv_cache_also_fits_the_memory_free_now() -> None:
    """What is free after the weights caps the cache: less a pass's activations, the graph pool
    (another pass's worth when decode graphs are captured) and the compile workspace."""
    from replicas.execution.kv_memory import COMPILE_WORKSPACE

    gib = 1 << 30
    assert kv_memory_bytes(80 * gib, 0.9, 2 * gib, gib) == (69 * gib, "total")  # no free figure (CPU)
    assert kv_memory_bytes(80 * gib, 0.9, 2 * gib, gib, free=78 * gib) == (69 * gib, "total")
    # another process holds 20 GiB: the fraction of the total would not fit
    kv, source = kv_memory_bytes(80 * gib, 0.9, 2 * gib, gib, free=58 * gib, graphs=True)
    assert source == "free" and kv == 58 * gib - 2 * gib - COMPILE_WORKSPACE
    assert kv_memory_bytes(80 * gib, 0.9, 2 * gib, gib, free=58 * gib)[0] == 58 * gib - gib - COMPILE_WORKSPACE
    with pytest.raises(ValueError, match="free now"):
        kv_memory_bytes(80 * gib, 0.9, 2 * gib, gib, free=2 * gib)


def test_the_block_size_defaults_to_one_flex_tile_on_cuda() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_block_size(None, "auto", cuda) == 64 and resolve_block_size(None, "flex", cuda) == 64
    assert resolve_block_size(None, "sdpa", cuda) == 16 and resolve_block_size(None, "auto", cpu) == 16
    assert resolve_block_size(None, "flex", cpu) == 16  # CPU flex: the tests' rehearsal of the paths
    assert resolve_block_size(32, "flex", cuda) == 32  # a size given is kept
