"""One forward pass per iteration over the packed batch, with paged attention.

The HF model's own modules do everything but attention. Our attention function is
registered with `transformers.AttentionInterface`; it receives q/k/v for ALL packed tokens
of the step (positions already applied), writes k/v into the paged cache, and attends:

- decodes (one query each) in ONE batched SDPA call over their gathered, padded contexts;
- each prefill chunk in its own SDPA call (a handful per pass) with a causal offset mask.

Per-step metadata (slots, gathered context indices, masks) is built once per pass and
reaches every layer through the model's **kwargs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from replicas.kv_cache import BlockManager
from replicas.scheduler import SchedulerOutput

ATTN_IMPL = "stallfree_paged"


@dataclass
class PrefillMeta:
    q_start: int  # first row of the chunk in the packed batch
    q_len: int
    ctx_slots: torch.Tensor | None  # (ctx_len,) cache slots of all context; None: chunk is the whole context
    mask: torch.Tensor | None  # (q_len, ctx_len) bool, True = may attend


@dataclass
class AttnMeta:
    k_cache: torch.Tensor  # (layers, slots, Hkv, D)
    v_cache: torch.Tensor
    slots: torch.Tensor  # (T,) where each packed token's k/v is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # (B, Lmax) context slots of each decode, padded
    decode_mask: torch.Tensor | None  # (B, 1, 1, Lmax) bool
    prefills: list[PrefillMeta]


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
    out = q.new_empty(q.shape)  # (T, H, D)
    b = m.num_decodes
    if b:
        qd = q[:b].unsqueeze(2)  # (B, H, 1, D)
        shape = (*m.decode_slots.shape, *kc.shape[1:])  # (B, Lmax, Hkv, D)
        flat = m.decode_slots.flatten()  # index_select is far faster than 2-D fancy indexing on CPU
        kd = kc.index_select(0, flat).view(shape).transpose(1, 2)  # (B, Hkv, Lmax, D)
        vd = vc.index_select(0, flat).view(shape).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.decode_mask,
                                            scale=scaling, enable_gqa=True)
        out[:b] = od.squeeze(2)
    for p in m.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if p.ctx_slots is None:  # first chunk: its own k/v are the whole context
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = kc.index_select(0, p.ctx_slots), vc.index_select(0, p.ctx_slots)  # (ctx, Hkv, D)
        kp = kp.transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scaling,
                                            is_causal=p.mask is None, enable_gqa=True)
        out[rows] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPL, paged_attention)


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


class ModelRunner:
    """Owns the KV tensors and runs one packed forward pass per scheduler output."""

    def __init__(self, model: PreTrainedModel, blocks: BlockManager) -> None:
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
        self._keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._arange_bs = torch.arange(blocks.block_size, device=self.device)

    def _context_slots(self, request_ids: list[str], ctx_lens: list[int]) -> torch.Tensor:
        """(N, max ctx) cache slots of each request's first ctx_len positions, zero padded."""
        tables = [self.blocks.block_table(r) for r in request_ids]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)
        slots = (padded[:, :, None] * self.blocks.block_size + self._arange_bs).flatten(1)  # (N, width*bs)
        return slots[:, :max(ctx_lens)]

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor:
        """Run the pass; returns logits (N, V) for the sequences that sample, in batch order."""
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        bs = self.blocks.block_size
        for seq in batch.seqs:
            req, start, n = seq.request, seq.start, seq.num_tokens
            table = self.blocks.block_table(req.request_id)
            if n == 1:
                ids.append(req.token_at(start))
                slots.append(table[start // bs] * bs + start % bs)
                positions.append(start)
            else:
                ids.extend((req.prompt_token_ids + req.output_token_ids)[start:start + n])
                slots.extend(self.blocks.slots(req.request_id, start, start + n))
                positions.extend(range(start, start + n))
            if seq.samples:
                sample_rows.append(len(ids) - 1)
        prefills: list[PrefillMeta] = []
        row = len(batch.decodes)
        for seq in batch.prefills:
            start, n = seq.start, seq.num_tokens
            if start == 0:
                prefills.append(PrefillMeta(row, n, None, None))
            else:
                ctx = start + n
                q_pos = torch.arange(start, ctx, device=self.device)
                mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]  # (n, ctx)
                ctx_slots = self._context_slots([seq.request.request_id], [ctx])[0]
                prefills.append(PrefillMeta(row, n, ctx_slots, mask))
            row += n
        decode_slots = decode_mask = None
        if batch.decodes:
            lens = [s.start + 1 for s in batch.decodes]
            decode_slots = self._context_slots([s.request.request_id for s in batch.decodes], lens)  # (B, Lmax)
            lens_t = torch.tensor(lens, device=self.device)
            arange = torch.arange(decode_slots.shape[1], device=self.device)
            decode_mask = (arange[None, :] < lens_t[:, None])[:, None, None, :]  # (B, 1, 1, Lmax)
        meta = AttnMeta(self.k_cache, self.v_cache, torch.tensor(slots, device=self.device),
                        len(batch.decodes), decode_slots, decode_mask, prefills)
        input_ids = torch.tensor([ids], device=self.device)  # (1, T)
        position_ids = torch.tensor([positions], device=self.device)  # (1, T)
        keep = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        kwargs = {"logits_to_keep": keep} if self._keep_logits else {}
        logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            attn_meta=meta, **kwargs).logits[0]
        return logits if self._keep_logits else logits[keep]  # (N, V)
