"""One forward pass per iteration over the packed batch, with paged attention.

The HF model's own modules do everything but attention. Our attention function is
registered with `transformers.AttentionInterface`; it receives q/k/v for ALL packed tokens
of the step (positions already applied), writes k/v into the paged cache, and attends:

- decodes (one query each) in a few batched SDPA calls over their gathered contexts, grouped by
  context length so a long request does not pad every short one to its length;
- each prefill chunk in its own SDPA call (a handful per pass) with a causal offset mask.

Per-step metadata (slots, gathered context indices, masks) is built once per pass and
reaches every layer through the model's **kwargs. Block tables live in a persistent tensor (a
row per request, a block written in when it is allocated), not rebuilt from lists every pass.
"""

from __future__ import annotations

import inspect
import itertools
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental import _config as shape_config  # torch.compile's symbolic shapes
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from replicas.kv_cache import BlockManager
from replicas.request import Request
from replicas.scheduler import ScheduledSeq, SchedulerOutput

ATTN_IMPL = "stallfree_paged"
# Decodes share one attention call while padding them to the group's longest context costs at
# most PAD_SLACK x their real context (+ PAD_MIN tokens): CPU attention pays per padded token.
PAD_SLACK = 1.5
PAD_MIN = 256


@dataclass
class PrefillMeta:
    q_start: int  # first row of the chunk in the packed batch
    q_len: int
    ctx_blocks: torch.Tensor | None  # (nblk,) KV blocks of the context; None: chunk is the whole context
    ctx_len: int
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend


@dataclass
class DecodeGroup:
    """Decodes of similar context length attended in one batched call (rows are contiguous)."""

    start: int  # first row in the packed batch
    blocks: torch.Tensor  # (B, nblk) KV blocks of each decode's context (padded with its own)
    mask: torch.Tensor  # (B, 1, 1, nblk x block_size) bool, True = a real context position
    lens: torch.Tensor  # (B,) context lengths


@dataclass
class PassLogits:
    """What a pass keeps of the model's logits: nothing for the positions nobody reads."""

    sampled: torch.Tensor  # (N, V) the sequences that sample, in batch order
    # (M, V) positions whose next token is a prompt token, for the requests that score their
    # prompt (SamplingParams.prompt_logprobs): row i scores the token after its position.
    prompt: torch.Tensor
    # (request, rows) in the order of `prompt`: its next `rows` prompt tokens are scored, from
    # token len(request.prompt_logprobs) + 1 on.
    prompt_spans: list[tuple[Request, int]]


@dataclass
class AttnMeta:
    k_cache: torch.Tensor  # (layers, slots, Hkv, D)
    v_cache: torch.Tensor
    block_size: int
    slots: torch.Tensor  # (T,) where each packed token's k/v is written
    decodes: list[DecodeGroup]
    prefills: list[PrefillMeta]
    fused_decode: object | None = None  # the compiled decode kernel, when configured


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


def _own_copy(fn):
    """`fn` with a code object of its own: torch.compile keeps its graphs per code object (at most
    `recompile_limit`, then it silently runs the function eagerly), and each runner's graphs are
    specialised to its model and cache, so runners in one process must not share them."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def _static_dims(kernel):
    """The compiled decode kernel with only its varying sizes symbolic: the number of decodes
    and of context blocks. Heads, head size, block size and the cache's block count are fixed in
    an engine; marked static, inductor generates the kernel for them (constant loop bounds, no
    vector tails): 1.7x faster than with every size symbolic at 64 decodes on CPU."""
    def call(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, blocks: torch.Tensor,
             lens: torch.Tensor, scale: float) -> torch.Tensor:
        for d in range(1, q.dim()):
            torch._dynamo.mark_static(q, d)
        for t in (kb, vb):
            for d in range(t.dim()):
                torch._dynamo.mark_static(t, d)
        return kernel(q, kb, vb, blocks, lens, scale)
    return call


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    attn_meta: AttnMeta | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> out (1, T, H, D)."""
    m = attn_meta
    if m is None:  # a plain HF call on the same model (e.g. generate): standard attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **_)
    q = query[0].transpose(0, 1)  # (T, H, D)
    k = key[0].transpose(0, 1)  # (T, Hkv, D)
    v = value[0].transpose(0, 1)
    kc, vc = m.k_cache[module.layer_idx], m.v_cache[module.layer_idx]  # (S, Hkv, D)
    kc.index_copy_(0, m.slots, k)
    vc.index_copy_(0, m.slots, v)
    # Contexts are gathered block by block (a block's slots are contiguous: one copy per block,
    # about twice as fast as a copy per slot on CPU).
    kb, vb = kc.view(-1, m.block_size, *kc.shape[1:]), vc.view(-1, m.block_size, *vc.shape[1:])
    out = q.new_empty(q.shape)  # (T, H, D)
    for g in m.decodes:
        b, width = g.blocks.shape[0], g.mask.shape[-1]
        rows = slice(g.start, g.start + b)
        if m.fused_decode is not None:
            # (B, Hkv, G, D), contiguous: the compiled kernel's strides are then the model's
            # (a fused QKV projection leaves the query strided by the pass's layout: a recompile)
            qg = q[rows].reshape(b, kc.shape[1], -1, q.shape[-1]).contiguous()
            scale = module.scaling if scaling is None else scaling
            out[rows] = m.fused_decode(qg, kb, vb, g.blocks, g.lens, scale).flatten(1, 2)
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
    for p in m.prefills:
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
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPL, paged_attention)


def text_config(config):
    """The decoder's own config (a multimodal config holds it inside)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    text = text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    """Owns the KV tensors and runs one packed forward pass per scheduler output."""

    def __init__(self, model: PreTrainedModel, blocks: BlockManager, max_model_len: int,
                 compile_decode_attention: bool = False) -> None:
        self.model = model
        self.blocks = blocks
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layers, kv_heads, head_dim = kv_shape(model.config)
        slots = blocks.num_blocks * blocks.block_size
        shape = (layers, slots, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        model.set_attn_implementation(ATTN_IMPL)
        self._fused_decode = None
        if compile_decode_attention:
            self._fused_decode = _static_dims(torch.compile(_own_copy(decode_in_place), dynamic=True))
            self._compile_decode_shapes(text_config(model.config).num_attention_heads)
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Persistent block table, on the host: one row per request in recent passes (see _row).
        # Each pass's metadata is sliced from it with numpy (microseconds, where a small torch op
        # costs ~10 us on CPU) and handed to the device once.
        width = -(-max_model_len // blocks.block_size)
        self._table = np.zeros((64, width), dtype=np.int64)
        self._free_rows: list[int] = list(range(63, -1, -1))
        # request -> [row, blocks written, preemptions when written]
        self._rows: dict[Request, list[int]] = {}
        self._live: dict[Request, list[int]] = {}
        self._new_rows = False  # a request got an entry this pass (see _end_pass)

    def _compile_decode_shapes(self, heads: int) -> None:
        """Compile the decode kernel at start for every shape class a pass can bring, so no
        request waits for a compile (seconds) in the middle of its stream: torch.compile with
        dynamic shapes still specializes a size of 1, so one or several decodes, over one or
        several blocks of context, first in the pass or not, are each tried once; after these,
        new sizes reuse the dynamic graphs. Without duck shaping: sizes that happen to be equal
        here (3 decodes, 3 heads) must not become one symbol, or a pass where they differ recompiles."""
        kv_heads, head_dim = self.k_cache.shape[2:]  # (layers, slots, Hkv, D)
        bs = self.blocks.block_size
        kb = self.k_cache[0].view(-1, bs, kv_heads, head_dim)
        vb = self.v_cache[0].view(-1, bs, kv_heads, head_dim)
        with torch.inference_mode(), shape_config.patch(use_duck_shape=False):
            for b, start, nblk in itertools.product((1, 3), (0, 2), (1, 5)):
                q = torch.zeros(start + b + 1, heads, head_dim, dtype=self.dtype, device=self.device)
                qg = q[start:start + b].reshape(b, kv_heads, -1, head_dim).contiguous()  # as paged_attention
                blocks = torch.zeros(b, nblk, dtype=torch.int64, device=self.device)
                lens = torch.ones(b, dtype=torch.int64, device=self.device)
                self._fused_decode(qg, kb, vb, blocks, lens, 1.0)

    def _row(self, req: Request, table: list[int]) -> int:
        """The request's row of the persistent block table (`table`: its block table now), its
        new blocks written in.

        A preempted request comes back with new blocks (its entry remembers the preemption
        count it was written for). A request absent from a pass gives its row back (rows are
        cheap to fill again).
        """
        entry = self._rows.get(req)
        if entry is None or entry[2] != req.num_preemptions:
            row = entry[0] if entry is not None else self._take_row()
            entry = [row, 0, req.num_preemptions]
            self._new_rows = True
        row, have = entry[0], entry[1]
        if have < len(table):
            self._table[row, have:len(table)] = table[have:]
            entry[1] = len(table)
        self._live[req] = entry
        return row

    def _decode_rows(self, decodes: list[ScheduledSeq]) -> list[int]:
        """`_row` of every decode; a decode whose row already holds the block of its position
        (all but one pass in block_size) is a dict lookup."""
        rows_get, live, bs = self._rows.get, self._live, self.blocks.block_size
        table_of, slow = self.blocks.block_table, self._row
        out = []
        for seq in decodes:
            req = seq.request
            entry = rows_get(req)
            if entry is None or entry[1] * bs <= seq.start or entry[2] != req.num_preemptions:
                out.append(slow(req, table_of(req.request_id)))
            else:
                live[req] = entry
                out.append(entry[0])
        return out

    def _take_row(self) -> int:
        if not self._free_rows:  # double the table
            n = self._table.shape[0]
            self._table = np.concatenate((self._table, np.zeros_like(self._table)))
            self._free_rows.extend(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _end_pass(self) -> None:
        """Rows of requests that were not in this pass go back to the free list."""
        live = self._live
        if self._new_rows or len(live) != len(self._rows):  # else the same requests as last pass
            for req, entry in self._rows.items():
                if req not in live:
                    self._free_rows.append(entry[0])
        self._rows, self._live, self._new_rows = live, {}, False

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)

    def _decode_groups(self, seqs: list[ScheduledSeq], rows: list[int]) -> list[DecodeGroup]:
        """Decodes (sorted by context length) in groups whose padding stays small."""
        groups, i, n = [], 0, len(seqs)
        lens = [s.start + 1 for s in seqs]
        bs = self.blocks.block_size
        table = self._table
        while i < n:
            total = lens[i]
            if i == 0 and n * lens[-1] <= PAD_SLACK * sum(lens) + PAD_MIN:
                j = n  # the usual case: all of them in one group
            else:
                j = i + 1  # grow while padding to the group's longest stays under PAD_SLACK x real
                while j < n and (j - i + 1) * lens[j] <= PAD_SLACK * (total + lens[j]) + PAD_MIN:
                    total += lens[j]
                    j += 1
            nblk = -(-lens[j - 1] // bs)
            blocks = table[rows[i:j], :nblk]  # (B, nblk), padded with real blocks
            lens_a = np.array(lens[i:j])
            mask = (np.arange(nblk * bs)[None, :] < lens_a[:, None])[:, None, None, :]  # (B, 1, 1, Lmax)
            groups.append(DecodeGroup(i, self._tensor(blocks), self._tensor(mask), self._tensor(lens_a)))
            i = j
        return groups

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> PassLogits:
        """Run the pass; returns the logits of the sequences that sample, in batch order, and of
        the prompt positions of requests that score their prompt (only those rows are computed).

        Decodes are packed by context length (for the grouped attention), prefill chunks after
        them; the logits come back in the batch's own order.
        """
        order = sorted(range(len(batch.decodes)), key=lambda i: batch.decodes[i].start)
        decodes = [batch.decodes[i] for i in order]
        bs = self.blocks.block_size
        # A decode runs its last sampled token at position `start`; its slot comes from the
        # persistent block table, all decodes at once.
        ids = [seq.request.output_token_ids[-1] for seq in decodes]
        positions = [seq.start for seq in decodes]
        table_rows = self._decode_rows(decodes)
        slot_parts: list[np.ndarray] = []
        if decodes:
            pos = np.array(positions)
            slot_parts.append(self._table[table_rows, pos // bs] * bs + pos % bs)
        # Every decode samples; its row in the packed batch is its place in `order`.
        sampled = [0] * len(order)
        for row, i in enumerate(order):
            sampled[i] = row
        prefills: list[PrefillMeta] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int]] = []
        for seq in batch.prefills:
            req, start, n = seq.request, seq.start, seq.num_tokens
            row = len(ids)
            if req.params.prompt_logprobs is not None:
                rows = _prompt_rows(req, start, n)
                if rows:
                    prompt_rows.extend(range(row + rows.start - start, row + rows.stop - start))
                    prompt_spans.append((req, len(rows)))
            ids.extend(req.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            slot_parts.append(np.array(self.blocks.slots(req.request_id, start, start + n), dtype=np.int64))
            if start == 0:
                prefills.append(PrefillMeta(row, n, None, n, None))
            else:
                ctx = start + n
                q_pos = torch.arange(start, ctx, device=self.device)
                mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]  # (n, ctx)
                table_row = self._row(req, self.blocks.block_table(req.request_id))
                ctx_blocks = self._tensor(self._table[table_row, :-(-ctx // bs)])
                prefills.append(PrefillMeta(row, n, ctx_blocks, ctx, mask))
            if seq.samples:
                sampled.append(len(ids) - 1)
        groups = self._decode_groups(decodes, table_rows)
        self._end_pass()
        slots = self._tensor(slot_parts[0] if len(slot_parts) == 1 else np.concatenate(slot_parts))
        meta = AttnMeta(self.k_cache, self.v_cache, bs, slots, groups, prefills, self._fused_decode)
        input_ids = torch.tensor([ids], device=self.device)  # (1, T)
        position_ids = torch.tensor([positions], device=self.device)  # (1, T)
        keep = torch.tensor(sampled + prompt_rows, dtype=torch.long, device=self.device)
        kwargs = {"logits_to_keep": keep} if self._keep_logits else {}
        logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            attn_meta=meta, **kwargs).logits[0]
        logits = logits if self._keep_logits else logits[keep]  # (N + M, V)
        return PassLogits(logits[:len(sampled)], logits[len(sampled):], prompt_spans)


def _prompt_rows(req: Request, start: int, n: int) -> range:
    """Positions of the chunk [start, start + n) whose logits score a prompt token not scored
    yet: position p scores token p + 1, so the prompt's last position (it samples) never does."""
    done, end = len(req.prompt_logprobs), req.num_prompt_tokens - 1  # [0, done): scored already
    if done >= end:  # all scored (a recompute after preemption scores nothing again)
        return range(0)
    if done < start:  # a gap would misalign every score after it
        raise RuntimeError(f"{req.request_id}: prompt position {done} was never run through the "
                           f"model (a chunk starts at {start}); prompt logprobs need every position")
    return range(done, max(done, min(start + n, end)))
