"""Decode-only passes as gpt-fast runs them: the whole forward (embedding, norms, rotary, MLPs,
attention, head) compiled at static shapes per batch-size bucket, so inductor fuses the
elementwise work, and captured once per bucket in a CUDA graph that each pass replays.

A decode-only pass of n rows runs in the smallest bucket B >= n (buckets are powers of two:
a decode step reads the weights once whatever its rows, so padding is nearly free). The B - n
padding rows are harmless by construction: each writes its k/v into the scratch block
(reserved from the block manager, so no request is ever given it), reads that block only
(through the page map's padding row), and its logits are dropped.

Everything a replay reads lives in persistent buffers written before it: the tokens, the runner
rows, the page counts and the page lists. The lists' buffer is as wide as the longest context
allows, but a pass writes only the columns its longest live context needs (bucketed), and the
kernel reads only the counted ones. Capture and replay both run under inference mode (a change
of grad mode is a recompile). On CPU nothing is captured: the compiled step (or the plain
forward) runs directly, which is what the tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

from replicas.execution.attention import PassMeta
from replicas.execution.attention_flex import FlexMeta, bucket_width, decode_block_mask, decode_lists
from replicas.execution.compiling import CompileCounter, own_copy
from replicas.execution.flex_buckets import bucket_sizes, choose_bucket
from replicas.execution.transfer import HostPack, Part

__all__ = ["DecodeGraphs", "bucket_sizes", "choose_bucket"]


def _decode_forward(runner, ids, pos, slots, rows, kv_num, kv_idx):
    """One decode step over static buffers -> (B, V) logits: the block mask from the page lists,
    then the model's forward with the paged attention."""
    bs = runner.blocks.block_size
    lists = {"kv_num": kv_num, "kv_idx": kv_idx}
    mask = decode_block_mask(lists, runner.page_map.table, rows, pos, bs, runner.k_cache.shape[1])
    meta = PassMeta(runner.k_layers, runner.v_layers, slots, FlexMeta(mask, [], flex_attention, bs))
    return runner.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                        attn_meta=meta).logits[0]


@dataclass
class Buffers:
    """What every bucket's replay reads (bucket B reads the first B rows of each)."""

    ids: torch.Tensor  # (Bmax,) int64
    pos: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor  # (Bmax,) runner rows (page map rows)
    kv_num: torch.Tensor  # (Bmax,) int32 pages of each entry
    kv_idx: torch.Tensor  # (Bmax, Wmax) int32 its pages


class DecodeGraphs:
    """The decode-only forward per bucket: compiled (when a compile backend is given) and, on
    CUDA, captured; run directly elsewhere."""

    def __init__(self, runner, buckets: list[int], scratch_block: int, compiler: CompileCounter | None,
                 capture: bool) -> None:
        self.runner = runner
        self.buckets = buckets
        self.scratch_block = scratch_block
        bs = runner.blocks.block_size
        self.max_width = bucket_width(-(-runner.max_model_len // bs))
        device, bmax = runner.device, buckets[-1]
        self.buffers = Buffers(*(torch.zeros(bmax, dtype=torch.int64, device=device) for _ in range(4)),
                               torch.ones(bmax, dtype=torch.int32, device=device),
                               torch.full((bmax, self.max_width), scratch_block, dtype=torch.int32, device=device))
        self.buffers.slots.fill_(scratch_block * bs)  # until the first pass: every row in the scratch block
        self.buffers.rows.fill_(runner.page_map.pad_row)
        runner.page_map.table[runner.page_map.pad_row, scratch_block] = 0  # padding rows read the scratch page
        self.compiler = compiler
        # A step of its own per bucket: torch.compile keeps at most `recompile_limit` (8) graphs
        # per code object, and a shared one would fail the ninth bucket (fullgraph) or run it
        # eagerly. Static shapes: flex decoding needs a static batch.
        self.steps = {b: self._compiled_step(compiler) for b in buckets}
        self.capture = capture
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}  # bucket -> (graph, its logits)

    def warm_up(self) -> None:
        """Run (so compile) every bucket."""
        for b in reversed(self.buckets):
            self._forward(b)

    def capture_all(self) -> None:
        """Capture every bucket on CUDA: the largest first, so the smaller ones reuse its memory
        pool."""
        pool = None
        if self.capture:
            for b in reversed(self.buckets):
                pool = self._capture(b, pool)

    def bucket(self, n: int) -> int | None:
        return choose_bucket(n, self.buckets)

    def plan(self, tokens: np.ndarray, rows, lens, bucket: int, pack: HostPack) -> tuple[Part, Part, Part]:
        """Host side: the pass padded to `bucket` rows, added to the pass's upload. tokens (3, n):
        ids, positions, slots; rows/lens: each decode's runner row and context length."""
        runner, n = self.runner, tokens.shape[1]
        bs = runner.blocks.block_size
        padded = np.zeros((4, bucket), dtype=np.int64)  # ids, positions, slots, rows
        padded[:3, :n] = tokens
        padded[2, n:] = self.scratch_block * bs
        padded[3, :n] = rows
        padded[3, n:] = runner.page_map.pad_row
        lists = decode_lists(runner._table, rows, lens, bs, full_blocks=False)  # every page partial
        width = lists["kv_idx"].shape[1]
        kv_num = np.ones(bucket, dtype=np.int32)
        kv_num[:n] = lists["kv_num"]
        kv_idx = np.full((bucket, width), self.scratch_block, dtype=np.int32)
        kv_idx[:n] = lists["kv_idx"]
        return pack.add(padded), pack.add(kv_num), pack.add(kv_idx)

    def run(self, bucket: int, parts: tuple[Part, Part, Part], pack: HostPack) -> torch.Tensor:
        """Device side: copy the inputs into the buffers, replay. Returns (B, V) logits (the
        caller keeps the real rows' before the next pass)."""
        buf = self.buffers
        tokens, kv_num, kv_idx = (pack.get(p) for p in parts)
        for i, dst in enumerate((buf.ids, buf.pos, buf.slots, buf.rows)):
            dst[:bucket].copy_(tokens[i])
        buf.kv_num[:bucket].copy_(kv_num)
        buf.kv_idx[:bucket, :kv_idx.shape[1]].copy_(kv_idx)
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)
        graph[0].replay()
        return graph[1]

    @staticmethod
    def _compiled_step(compiler: CompileCounter | None):  # noqa: ANN205
        step = own_copy(_decode_forward)
        if compiler is not None:
            step = torch.compile(step, backend=compiler, fullgraph=True, dynamic=False)
        return step

    def _forward(self, b: int) -> torch.Tensor:
        buf = self.buffers
        return self.steps[b](self.runner, buf.ids[:b], buf.pos[:b], buf.slots[:b], buf.rows[:b], buf.kv_num[:b],
                         buf.kv_idx[:b])

    def _capture(self, b: int, pool: object | None) -> object:
        """Warm up (compiles, allocations) on a side stream, then capture into the shared pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(b)
        self.graphs[b] = (graph, logits)
        return graph.pool()

