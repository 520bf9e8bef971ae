"""Paged attention behind one interface: a backend turns a pass's layout into its metadata
(host arrays added to the pass's one upload, then device views of them) and attends with it.

One function is registered with `transformers.AttentionInterface`; it writes the step's k/v
into the paged cache at the pass's slots and hands the rest to the metadata the runner passed
through the model's **kwargs. Backends:

- "sdpa" (`replicas.execution.attention_sdpa`): decodes grouped by context length, each group one SDPA
  call over its gathered context; each prefill chunk its own SDPA call. The CPU default.
- "flex" (`replicas.execution.attention_flex`): torch's FlexAttention over the whole paged cache, every
  row of the pass in one call, a block mask built from the block tables. The CUDA default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from replicas.config import DEFAULT_BLOCK_SIZE, FLEX_BLOCK_SIZE
from replicas.execution.transfer import HostPack

ATTN_IMPL = "stallfree_paged"
BACKENDS = ("auto", "sdpa", "flex")


@dataclass
class PrefillSpan:
    """A prefill chunk of the pass: its packed rows and where its context lives."""

    q_start: int  # first row of the chunk in the packed batch
    q_len: int
    start: int  # tokens of the request before the chunk (its cached context)
    table_row: int  # its row of the runner's block table


@dataclass
class PassLayout:
    """A pass as the backends see it on the host. Decodes come first in the packed batch,
    sorted by context length; prefill chunks follow."""

    table: np.ndarray  # (rows, width) the runner's persistent block table
    block_size: int
    decode_rows: np.ndarray  # (D,) table row of each decode (a list where built by hand)
    decode_lens: np.ndarray  # (D,) context length of each decode, its new token included
    prefills: list[PrefillSpan]
    num_tokens: int  # packed rows of the pass
    groups: list  # the decodes' `attention_sdpa.HostGroup`s (the runner's `_decode_groups`)


class AttentionMeta(Protocol):
    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) of the pass (already in the cache), kc/vc the layer's
        cache (slots, Hkv, D) -> out (T, H, D)."""


class Backend(Protocol):
    name: str

    def plan(self, layout: PassLayout, pack: HostPack) -> object:
        """Host side: add the arrays the metadata needs to the pass's upload."""

    def metadata(self, plan: object, pack: HostPack, positions: torch.Tensor) -> AttentionMeta:
        """Device side, after the upload (`positions`: (T,) each row's): the metadata every
        layer receives."""


@dataclass
class PassMeta:
    """What every layer of one pass receives (through the model's **kwargs)."""

    # Each layer's cache (slots, Hkv, D): views of the runner's (layers, slots, Hkv, D) tensor, one
    # object a layer. Compiled, a write into one is in place; selecting the layer from the whole
    # tensor inside the graph makes inductor copy the whole cache in and back each step.
    k_cache: tuple[torch.Tensor, ...]
    v_cache: tuple[torch.Tensor, ...]
    slots: torch.Tensor  # (T,) where each packed token's k/v is written
    attention: AttentionMeta


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    attn_meta: PassMeta | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> out (1, T, H, D)."""
    m = attn_meta
    if m is None:  # a plain HF call on the same model (e.g. generate): standard attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    q = query[0].transpose(0, 1)  # (T, H, D)
    k = key[0].transpose(0, 1)  # (T, Hkv, D)
    v = value[0].transpose(0, 1)
    kc, vc = m.k_cache[module.layer_idx], m.v_cache[module.layer_idx]  # (S, Hkv, D)
    if torch.compiler.is_compiling():
        # index_put_: inductor writes it in place into the cache (its reinplacing knows it);
        # index_copy_ would be functionalized into a copy of the whole cache, then copied back
        kc[m.slots] = k
        vc[m.slots] = v
    else:
        kc.index_copy_(0, m.slots, k)
        vc.index_copy_(0, m.slots, v)
    return m.attention.attend(module, q, k, v, kc, vc, scaling).unsqueeze(0), None


AttentionInterface.register(ATTN_IMPL, paged_attention)


def resolve_block_size(block_size: int | None, backend: str, device: torch.device) -> int:
    """EngineConfig.block_size, null resolved: FLEX_BLOCK_SIZE on the flex backend on CUDA (the
    kernels read a block per KV tile), DEFAULT_BLOCK_SIZE elsewhere."""
    if block_size is not None:
        return block_size
    flex = resolve_backend(backend, device) == "flex" and device.type == "cuda"
    return FLEX_BLOCK_SIZE if flex else DEFAULT_BLOCK_SIZE


def resolve_backend(name: str, device: torch.device) -> str:
    """"auto": flex on CUDA (one fused kernel over the paged cache), sdpa elsewhere (on CPU the
    grouped SDPA calls are faster than FlexAttention's generated loops)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return name
