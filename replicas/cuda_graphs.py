"""CUDA graphs for decode-only passes: the forward pass captured once per batch-size bucket,
replayed with the pass's inputs copied into its static buffers.

A decode-only pass of n rows runs in the smallest bucket B >= n. The B - n padding rows are
harmless by construction: each writes its k/v into the scratch block (reserved from the block
manager, so no request is ever given it) and attends to that block only, and its logits are
dropped. Passes with any prefill, or more decodes than the largest bucket, run eagerly.

Attention in a graph needs shapes that do not change between replays: the FlexAttention
backend's metadata (every row's sequence, block tables at the full table width, the block mask
over the whole cache) has them, so graphs go with that backend. On CPU there is nothing to
capture: the same padded path runs eagerly (what the tests check).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from replicas.attention import PassMeta
from replicas.attention_flex import FlexMeta, build_block_mask, logical_blocks
from replicas.transfer import HostPack, Part

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32)
BUCKET_STEP = 16  # above the small buckets: padding costs at most this many rows


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, 16, 32, then every BUCKET_STEP, up to max_num_seqs
    (itself a bucket, so every decode-only pass has one)."""
    sizes = [b for b in SMALL_BUCKETS if b < max_num_seqs]
    b = SMALL_BUCKETS[-1] + BUCKET_STEP
    while b < max_num_seqs:
        sizes.append(b)
        b += BUCKET_STEP
    return sizes + [max_num_seqs]


def choose_bucket(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows; None when n is beyond the largest (run eagerly)."""
    return next((b for b in buckets if b >= n), None)


def pad_decodes(tokens: np.ndarray, tables: np.ndarray, bucket: int, width: int, scratch_block: int,
                block_size: int, dummy_block: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode-only pass's inputs padded to `bucket` rows.

    tokens (3, n): ids, positions, slots; tables (n, w): each row's blocks (unused entries
    `dummy_block`). Padding rows: token 0 at position 0, written to the scratch block's first
    slot, their table the scratch block alone (so they attend to what they wrote, nothing of a
    request's). Tables come back at the static width `width`.
    """
    n, w = tables.shape
    padded = np.zeros((3, bucket), dtype=np.int64)
    padded[:, :n] = tokens
    padded[2, n:] = scratch_block * block_size
    out = np.full((bucket, width), dummy_block, dtype=np.int64)
    out[:n, :w] = tables
    out[n:, 0] = scratch_block
    return padded, out


@dataclass
class _Static:
    """One bucket's static buffers (replays read them), its graph and its output."""

    tokens: torch.Tensor  # (3, B) ids, positions, slots
    seq: torch.Tensor  # (B,) each row its own sequence
    tables: torch.Tensor  # (B, width)
    logical: torch.Tensor  # (B, num_blocks) int32
    meta: PassMeta
    graph: object | None = None
    logits: torch.Tensor | None = None  # (B, V) the captured pass's output


class DecodeGraphs:
    """The decode-only forward per bucket: captured on CUDA, run eagerly elsewhere."""

    def __init__(self, runner, buckets: list[int], scratch_block: int) -> None:
        self.runner = runner
        self.buckets = buckets
        self.scratch_block = scratch_block
        self.width = runner._table.shape[1]
        self.num_blocks = runner.k_cache.shape[1] // runner.blocks.block_size  # the cache's, scratch included
        self._static = {b: self._buffers(b) for b in buckets}
        self.capture = runner.device.type == "cuda"
        if self.capture:
            pool = None
            for b in reversed(buckets):  # the largest first: the smaller ones reuse its memory
                pool = self._capture(self._static[b], pool)

    def bucket(self, n: int) -> int | None:
        return choose_bucket(n, self.buckets)

    def plan(self, tokens: np.ndarray, tables: np.ndarray, bucket: int, pack: HostPack) -> tuple[Part, Part]:
        """Host side: the padded inputs, added to the pass's upload."""
        bs = self.runner.blocks.block_size
        padded, padded_tables = pad_decodes(tokens, tables, bucket, self.width, self.scratch_block, bs,
                                            self.num_blocks)
        return pack.add(padded), pack.add(padded_tables)

    def run(self, bucket: int, parts: tuple[Part, Part], pack: HostPack) -> torch.Tensor:
        """Device side: copy the inputs into the bucket's buffers, refresh its mask, replay.
        Returns (B, V) logits (the caller keeps the real rows' before the next pass)."""
        s = self._static[bucket]
        s.tokens.copy_(pack.get(parts[0]))
        s.tables.copy_(pack.get(parts[1]))
        self._refresh(s)
        if s.graph is None:
            return self._forward(s)
        s.graph.replay()
        return s.logits

    def _buffers(self, b: int) -> _Static:
        device, bs = self.runner.device, self.runner.blocks.block_size
        tokens = torch.zeros((3, b), dtype=torch.int64, device=device)
        tokens[2] = self.scratch_block * bs  # until the first pass: every row in the scratch block
        tables = torch.full((b, self.width), self.num_blocks, dtype=torch.int64, device=device)
        tables[:, 0] = self.scratch_block
        seq = torch.arange(b, device=device)
        logical = logical_blocks(tables, self.num_blocks)
        mask = build_block_mask(seq, tokens[1], logical, bs, self.num_blocks * bs)
        attend = self.runner.backend.attend_fn
        meta = PassMeta(self.runner.k_cache, self.runner.v_cache, tokens[2], FlexMeta(mask, attend))
        return _Static(tokens, seq, tables, logical, meta)

    def _refresh(self, s: _Static) -> None:
        """The mask of the new tables, written into the buffers the captured pass reads."""
        bs = self.runner.blocks.block_size
        s.logical.copy_(logical_blocks(s.tables, self.num_blocks))
        fresh = build_block_mask(s.seq, s.tokens[1], s.logical, bs, self.num_blocks * bs)
        mask = s.meta.attention.block_mask
        for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"):
            getattr(mask, name).copy_(getattr(fresh, name))

    def _forward(self, s: _Static) -> torch.Tensor:
        return self.runner.model(input_ids=s.tokens[0:1], position_ids=s.tokens[1:2], use_cache=False,
                                 attn_meta=s.meta).logits[0]

    def _capture(self, s: _Static, pool: object | None) -> object:
        """Warm up (compiles, allocations) on a side stream, then capture into the shared pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(s)
        torch.cuda.current_stream().wait_stream(stream)
        s.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(s.graph, pool=pool):
            s.logits = self._forward(s)
        return s.graph.pool()
