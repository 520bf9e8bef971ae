"""The SDPA backend (the CPU default): decodes of similar context length attended in one batched
SDPA call over their gathered contexts (a long request does not pad every short one to its
length), each prefill chunk in its own SDPA call with a causal offset mask. Optionally the
decode groups run a torch.compile'd kernel that reads the paged cache in place."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as shape_config  # torch.compile's symbolic shapes

from replicas.execution.attention import PassLayout
from replicas.execution.compiling import own_copy
from replicas.execution.transfer import HostPack, Part

# Decodes share one attention call while padding them to the group's longest context costs at
# most PAD_SLACK x their real context (+ PAD_MIN tokens): CPU attention pays per padded token.
PAD_SLACK = 1.5
PAD_MIN = 256


@dataclass
class HostGroup:
    """Decodes of similar context length attended in one batched call (rows are contiguous)."""

    start: int  # first row in the packed batch
    blocks: np.ndarray  # (B, nblk) KV blocks of each decode's context (padded with its own)
    lens: np.ndarray  # (B,) context lengths


def decode_groups(lens: np.ndarray, rows: np.ndarray, table: np.ndarray, bs: int) -> list[HostGroup]:
    """Decodes (sorted by context length `lens`, `rows` their block-table rows; arrays or
    lists) in groups whose padding stays small."""
    lens, rows = np.asarray(lens, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    n = len(lens)
    if n and n * int(lens[-1]) <= PAD_SLACK * int(lens.sum()) + PAD_MIN:  # the usual case: one group
        return [HostGroup(0, table[rows, :-(-int(lens[-1]) // bs)], lens)]
    groups, i, ls = [], 0, lens.tolist()
    while i < n:
        total = ls[i]
        j = i + 1  # grow while padding to the group's longest stays under PAD_SLACK x real
        while j < n and (j - i + 1) * ls[j] <= PAD_SLACK * (total + ls[j]) + PAD_MIN:
            total += ls[j]
            j += 1
        nblk = -(-ls[j - 1] // bs)
        groups.append(HostGroup(i, table[rows[i:j], :nblk], lens[i:j]))  # padded with real blocks
        i = j
    return groups


@dataclass
class DecodeGroup:
    start: int
    blocks: torch.Tensor  # (B, nblk)
    lens: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, 1, 1, nblk x block_size) bool, True = a real context position


@dataclass
class PrefillMeta:
    q_start: int
    q_len: int
    ctx_blocks: torch.Tensor | None  # (nblk,) KV blocks of the context; None: chunk is the whole context
    ctx_len: int
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend


@dataclass
class SdpaPlan:
    groups: list[tuple[int, Part, Part]]  # (start, blocks, lens)
    prefills: list[tuple[int, int, int, Part | None]]  # (q_start, q_len, start, ctx blocks)


class SdpaBackend:
    name = "sdpa"

    def __init__(self, block_size: int, fused_decode: object | None = None) -> None:
        self.block_size = block_size
        self.fused_decode = fused_decode

    def plan(self, layout: PassLayout, pack: HostPack) -> SdpaPlan:
        bs = self.block_size
        prefills = [(p.q_start, p.q_len, p.start,
                     pack.add(layout.table[p.table_row, :-(-(p.start + p.q_len) // bs)]) if p.start else None)
                    for p in layout.prefills]
        return SdpaPlan([(g.start, pack.add(g.blocks), pack.add(g.lens)) for g in layout.groups], prefills)

    def metadata(self, plan: SdpaPlan, pack: HostPack, positions: torch.Tensor) -> SdpaMeta:
        device, bs = pack.device_buffer.device, self.block_size
        groups = []
        for start, blocks_part, lens_part in plan.groups:
            blocks, lens = pack.get(blocks_part), pack.get(lens_part)
            pos = torch.arange(blocks.shape[1] * bs, device=device)
            groups.append(DecodeGroup(start, blocks, lens, (pos[None, :] < lens[:, None])[:, None, None, :]))
        prefills = []
        for q_start, n, start, ctx in plan.prefills:
            if ctx is None:
                prefills.append(PrefillMeta(q_start, n, None, n, None))
                continue
            q_pos = torch.arange(start, start + n, device=device)
            mask = torch.arange(start + n, device=device)[None, :] <= q_pos[:, None]  # (n, ctx)
            prefills.append(PrefillMeta(q_start, n, pack.get(ctx), start + n, mask))
        return SdpaMeta(bs, groups, prefills, self.fused_decode)


@dataclass
class SdpaMeta:
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillMeta]
    fused_decode: object | None

    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, scaling: float | None) -> torch.Tensor:
        # Contexts are gathered block by block (a block's slots are contiguous: one copy per
        # block, about twice as fast as a copy per slot on CPU).
        bs = self.block_size
        kb, vb = kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:])
        out = q.new_empty(q.shape)  # (T, H, D)
        for g in self.decodes:
            b, width = g.blocks.shape[0], g.mask.shape[-1]
            rows = slice(g.start, g.start + b)
            if self.fused_decode is not None:
                # (B, Hkv, G, D), contiguous: the compiled kernel's strides are then the model's
                # (a fused QKV projection leaves the query strided by the pass's layout: a recompile)
                qg = q[rows].reshape(b, kc.shape[1], -1, q.shape[-1]).contiguous()
                scale = module.scaling if scaling is None else scaling
                out[rows] = self.fused_decode(qg, kb, vb, g.blocks, g.lens, scale).flatten(1, 2)
                continue
            # A KV head's G query heads as its G query rows: one (G x Lmax) attention per KV head
            # instead of G of (1 x Lmax) (HF's repeat_kv order: query head h reads KV head h // G).
            qd = q[rows].reshape(b, kc.shape[1], -1, q.shape[-1])  # (B, Hkv, G, D)
            shape = (b, width, *kc.shape[1:])  # (B, Lmax, Hkv, D)
            flat = g.blocks.flatten()  # index_select is far faster than 2-D fancy indexing on CPU
            kd = kb.index_select(0, flat).view(shape).transpose(1, 2)  # (B, Hkv, Lmax, D)
            vd = vb.index_select(0, flat).view(shape).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scaling)  # (B, Hkv, G, D)
            out[rows] = od.reshape(b, -1, q.shape[-1])
        for p in self.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if p.ctx_blocks is None:  # first chunk: its own k/v are the whole context
                kp, vp = k[rows], v[rows]
            else:  # (ctx, Hkv, D)
                kp = kb.index_select(0, p.ctx_blocks).flatten(0, 1)[:p.ctx_len]
                vp = vb.index_select(0, p.ctx_blocks).flatten(0, 1)[:p.ctx_len]
            kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
            vp = vp.transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scaling,
                                                is_causal=p.mask is None, enable_gqa=True)
            out[rows] = op[0].transpose(0, 1)
        return out


def decode_in_place(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, blocks: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention read straight from the paged cache (for torch.compile to fuse).

    q (B, Hkv, G, D), kb/vb (blocks, block_size, Hkv, D), blocks (B, nblk), lens (B,) ->
    (B, Hkv, G, D). Written as broadcast multiply-and-sum so inductor fuses the block lookups
    into the reductions: each context's keys and values are read once, never copied out.
    """
    b, n = blocks.shape
    k = kb[blocks]  # (B, nblk, bs, Hkv, D): an indexed load, not a copy, once compiled
    s = (q[:, None, None] * k[:, :, :, :, None, :]).sum(-1) * scale  # (B, nblk, bs, Hkv, G)
    s = s.flatten(1, 2)
    pos = torch.arange(s.shape[1], device=s.device)
    s = s.masked_fill((pos[None, :] >= lens[:, None])[:, :, None, None], float("-inf"))
    p = torch.softmax(s, dim=1).view(b, n, -1, *s.shape[2:])
    return (p[..., None] * vb[blocks][:, :, :, :, None, :]).sum((1, 2))


def _static_dims(kernel):
    """The compiled decode kernel with only its varying sizes symbolic: the number of decodes
    and of context blocks. Heads, head size, block size and the cache's block count are fixed in
    an engine; marked static, inductor generates the kernel for them (constant loop bounds, no
    vector tails)."""
    def call(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, blocks: torch.Tensor,
             lens: torch.Tensor, scale: float) -> torch.Tensor:
        for d in range(1, q.dim()):
            torch._dynamo.mark_static(q, d)
        for t in (kb, vb):
            for d in range(t.dim()):
                torch._dynamo.mark_static(t, d)
        return kernel(q, kb, vb, blocks, lens, scale)
    return call


def compiled_decode(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, heads: int):
    """The decode kernel compiled at start for every shape class a pass can bring, so no request
    waits for a compile (seconds) in the middle of its stream: torch.compile with dynamic shapes
    still specializes a size of 1, so one or several decodes, over one or several blocks of
    context, first in the pass or not, are each tried once; after these, new sizes reuse the
    dynamic graphs. Without duck shaping: sizes that happen to be equal here (3 decodes, 3 heads)
    must not become one symbol, or a pass where they differ recompiles."""
    kernel = _static_dims(torch.compile(own_copy(decode_in_place), dynamic=True))
    kv_heads, head_dim = k_cache.shape[2:]  # (layers, slots, Hkv, D)
    kb = k_cache[0].view(-1, block_size, kv_heads, head_dim)
    vb = v_cache[0].view(-1, block_size, kv_heads, head_dim)
    with torch.inference_mode(), shape_config.patch(use_duck_shape=False):
        for b, start, nblk in itertools.product((1, 3), (0, 2), (1, 5)):
            q = torch.zeros(start + b + 1, heads, head_dim, dtype=k_cache.dtype, device=k_cache.device)
            qg = q[start:start + b].reshape(b, kv_heads, -1, head_dim).contiguous()  # as SdpaMeta.attend
            blocks = torch.zeros(b, nblk, dtype=torch.int64, device=k_cache.device)
            lens = torch.ones(b, dtype=torch.int64, device=k_cache.device)
            kernel(qg, kb, vb, blocks, lens, 1.0)
    return kernel
