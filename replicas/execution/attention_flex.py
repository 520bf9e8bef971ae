"""The FlexAttention backend (the CUDA default), in the layout torch's paged attention uses
(`torch.nn.attention.experimental._paged_attention`, the "FlexAttention for Inference" post):
the keys and values are the layer's whole paged cache, read in place, and each call's block
mask lists, per query tile, the cache blocks (pages) it reads. A page is one KV tile of the
mask (`block_size` slots), so a row visits its own sequence's pages and no other.

- Decodes: one batch entry per sequence, queries (B, H, 1, D). Entry b lists the pages of its
  table (`decode_lists`); optionally (`full_blocks`) all but the last, partial page are marked
  full, so `mask_mod` runs on that page alone.
- Prefill chunks: one call each, queries (1, H, n, D) in tiles of Q_TILE rows. A tile lists the
  pages its rows see: those every row sees whole are full, the rest up to its last row's page
  are partial (`prefill_lists`); pages past the tile's last row are skipped (causality).

`mask_mod` says exactly which slots a row sees, whatever the lists say (torch's unfused
reference, the CPU path, evaluates it over the whole cache and ignores the lists): slot j of
page j // block_size is visible to a row of runner row r at position p when the page is at
logical index l of r's table and l * block_size + j % block_size <= p. The logical indices
come from `PageMap`, a device table per runner row kept up to date by the runner as pages are
written into its tables (a few entries a pass), as torch's PagedAttention keeps its
physical-to-logical map. A page shared through the prefix cache sits at the same logical index
in every table that holds it (prefix matching is positional).

Kernels (torch 2.11, the device image's): a short query with a power-of-two GQA group lowers to
the flex decoding kernel, whose row block next_pow2(q_len x group) must divide the mask's query
tile, which fails for chunks of 33-127 rows at 4:1 (pytorch#185349); so prefill calls force
the main kernel (`PREFILL_OPTIONS`), and decode calls have q_len 1 (a row block of 16). Inductor
takes the decoding kernel only for a static batch: the decodes of every compiled pass, mixed
ones too, are padded to a bucket of entries, a static call each (`DecodeBuckets`). Both kernels
take KV tiles of `block_size` slots (`BLOCK_N`), so on CUDA the block size is a power of two of
at least 16 (`check_block_size`), 64 by default (EngineConfig.block_size).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from replicas.execution.attention import PassLayout
from replicas.execution.transfer import HostPack, Part

Q_TILE = 128  # query rows per mask tile (prefill calls; a decode entry has one row)
MIN_WIDTH = 2  # lists are at least this wide: a width of 1 would be its own compiled shape
PREFILL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}  # never the decoding kernel (see the note)
# torch 2.11's decoding kernel, given full blocks, splits each sequence's pages across its
# programs by the whole cache's length (`TILE_KV_OG = cdiv(KV_LEN, SPLIT_KV)` in
# flex_decode.py.jinja) rather than by the sequence's own, so a short batch gets no split-KV
# parallelism. Off by default; `loadtests.device.check --probe` times both.
DECODE_FULL_BLOCKS = False


def flex_call(q, k, v, block_mask, scale, enable_gqa, kernel_options):  # noqa: ANN001, ANN201
    """flex_attention, for a runner to compile as its own (see compiling.own_copy)."""
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


def check_block_size(block_size: int, device: torch.device) -> None:
    """The flex kernels read one page per KV tile: on CUDA a power of two of at least 16."""
    if device.type == "cuda" and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"the flex backend on CUDA needs a block_size that is a power of two >= 16, "
                         f"got {block_size}")


def kernel_options(block_size: int, prefill: bool) -> dict:
    """A KV tile of one page (the kernels' default 64 does not divide a 16-slot page)."""
    opts = {"BLOCK_N": min(block_size, 64)}
    return {**opts, **PREFILL_OPTIONS} if prefill else opts


def bucket_width(n: int) -> int:
    """Widths of page lists, rounded up to a power of two (at least MIN_WIDTH): few shapes."""
    return max(MIN_WIDTH, 1 << max(0, int(n) - 1).bit_length())


class PageMap:
    """Each runner row's physical page -> logical index (-1: not in its table), on the device.

    The runner reports what it writes into its host table (`write`) and the rows it lets go
    (`clear`); the pending changes travel in the next pass's upload (`plan`) and are applied
    before its forward (`apply`). The last row is the padding row of captured decode passes.
    """

    def __init__(self, rows: int, num_pages: int, device: torch.device) -> None:
        self.table = torch.full((rows, num_pages + 1), -1, dtype=torch.int32, device=device)
        self.rows, self.num_pages = rows, num_pages
        self._pending: dict[tuple[int, int], int] = {}  # (row, page) -> logical; the last write wins

    @property
    def pad_row(self) -> int:
        return self.rows - 1

    def write(self, row: int, first: int, pages) -> None:
        for i, page in enumerate(pages):
            self._pending[(row, int(page))] = first + i

    def clear(self, row: int, pages) -> None:
        for page in pages:
            self._pending[(row, int(page))] = -1

    def plan(self, pack: HostPack) -> Part | None:
        if not self._pending:
            return None
        keys = np.array(list(self._pending), dtype=np.int64).reshape(-1, 2)
        updates = np.concatenate((keys.T, np.array([list(self._pending.values())], dtype=np.int64)))
        self._pending.clear()
        return pack.add(updates)  # (3, n): row, page, logical

    def apply(self, part: Part | None, pack: HostPack) -> None:
        if part is not None:
            u = pack.get(part)
            self.table[u[0], u[1]] = u[2].to(torch.int32)


def decode_lists(table: np.ndarray, rows, lens, block_size: int, width: int | None = None,
                 full_blocks: bool = DECODE_FULL_BLOCKS) -> dict[str, np.ndarray]:
    """The decode entries' page lists: (B,) counts and (B, width) pages, int32; with
    `full_blocks`, the full pages under full_* and the last partial page (if any) alone."""
    rows = np.asarray(rows, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    npg = -(-lens // block_size)
    width = width or bucket_width(int(npg.max()) if len(npg) else 1)
    pages = np.zeros((len(rows), width), dtype=np.int32)
    w = min(width, table.shape[1])
    pages[:, :w] = table[rows, :w]
    if not full_blocks:
        return {"kv_num": npg.astype(np.int32), "kv_idx": pages}
    nfull = lens // block_size
    last = pages[np.arange(len(rows)), np.maximum(npg - 1, 0)]
    partial = np.zeros_like(pages)
    partial[:, 0] = last
    return {"kv_num": (npg - nfull).astype(np.int32), "kv_idx": partial,
            "full_num": nfull.astype(np.int32), "full_idx": pages}


def prefill_lists(pages: np.ndarray, start: int, n: int, block_size: int) -> dict[str, np.ndarray]:
    """A chunk's per-tile page lists (tile i: rows [i*Q_TILE, ...), positions from `start`):
    pages every row of the tile sees whole are full, then partial ones up to the tile's last
    row's page; later pages are skipped. `pages`: the request's table (its first pages)."""
    nq = -(-n // Q_TILE)
    first = start + np.arange(nq) * Q_TILE  # the tile's first and last rows' positions
    last = start + np.minimum(n, (np.arange(nq) + 1) * Q_TILE) - 1
    nfull = (first + 1) // block_size  # pages [0, nfull) hold only positions <= first
    end = last // block_size + 1
    nq_pad = max(nq, MIN_WIDTH)  # a tile count of 1 would be a compiled shape of its own
    wp = bucket_width(int((end - nfull).max()))
    wf = bucket_width(int(nfull.max()))
    kv_idx = np.zeros((nq_pad, wp), dtype=np.int32)
    full_idx = np.zeros((nq_pad, wf), dtype=np.int32)
    for i in range(nq):
        kv_idx[i, :end[i] - nfull[i]] = pages[nfull[i]:end[i]]
        full_idx[i, :nfull[i]] = pages[:nfull[i]]
    kv_num = np.zeros(nq_pad, dtype=np.int32)
    full_num = np.zeros(nq_pad, dtype=np.int32)
    kv_num[:nq], full_num[:nq] = end - nfull, nfull
    return {"kv_num": kv_num, "kv_idx": kv_idx, "full_num": full_num, "full_idx": full_idx}


def _from_lists(lists: dict[str, torch.Tensor], block_size: int, num_slots: int, q_len: int,
                mask_mod) -> BlockMask:
    """A BlockMask from lists (B, nq) counts and (B, nq, W) pages: one head for all."""
    def shape(t: torch.Tensor) -> torch.Tensor:
        return t[:, None]

    full = lists.get("full_num")
    return BlockMask.from_kv_blocks(
        shape(lists["kv_num"]), shape(lists["kv_idx"]),
        None if full is None else shape(full), None if full is None else shape(lists["full_idx"]),
        BLOCK_SIZE=(Q_TILE, block_size), mask_mod=mask_mod, seq_lengths=(q_len, num_slots),
        compute_q_blocks=False)


def decode_block_mask(lists: dict[str, torch.Tensor], page_map: torch.Tensor, rows: torch.Tensor,
                      pos: torch.Tensor, block_size: int, num_slots: int) -> BlockMask:
    """The decode call's mask: entry b (runner row rows[b], position pos[b]) sees its pages up
    to its position. lists: kv_num (B,), kv_idx (B, W) [, full_num, full_idx]."""
    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 (torch's signature)
        logical = page_map[rows[b], kv_idx // block_size]
        return (logical >= 0) & (logical * block_size + kv_idx % block_size <= pos[b])

    lists = {k: v.view(v.shape[0], 1, *v.shape[1:]) for k, v in lists.items()}  # one query tile each
    return _from_lists(lists, block_size, num_slots, 1, mask_mod)


def prefill_block_mask(lists: dict[str, torch.Tensor], map_row: torch.Tensor, q_pos: torch.Tensor,
                       block_size: int, num_slots: int) -> BlockMask:
    """A chunk's mask: row i (position q_pos[i]) sees its request's pages up to its position.
    map_row: (pages + 1,) the request's row of the page map; lists per query tile."""
    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        logical = map_row[kv_idx // block_size]
        return (logical >= 0) & (logical * block_size + kv_idx % block_size <= q_pos[q_idx])

    lists = {k: v[None] for k, v in lists.items()}  # batch of one
    return _from_lists(lists, block_size, num_slots, q_pos.shape[0], mask_mod)


def tile_visits(mask: BlockMask) -> torch.Tensor:
    """KV tiles each (batch entry, query tile) reads: its partial and full lists' counts."""
    visits = mask.kv_num_blocks.sum(1)
    if mask.full_kv_num_blocks is not None:
        visits = visits + mask.full_kv_num_blocks.sum(1)
    return visits  # (B, nq)


@dataclass
class FlexPlan:
    decode: dict[str, Part] | None
    decode_rows: Part | None
    prefills: list[tuple[int, int, Part, dict[str, Part]]]  # (q_start, n, runner row (1,), lists)
    bucketed: dict[str, Part] | None = None  # the decodes through `DecodeBuckets`
    num_decodes: int = 0


class FlexBackend:
    name = "flex"

    def __init__(self, block_size: int, num_pages: int, page_map: PageMap, device: torch.device,
                 attend_fn=None, full_blocks: bool = DECODE_FULL_BLOCKS,
                 decode_buckets: Any = None) -> None:
        """`attend_fn`: flex_attention compiled (the runner's, CUDA); None: torch's unfused
        flex_attention (CPU: every slot scored, for tests, not for serving). `decode_buckets`:
        the decodes' static calls (`flex_buckets.DecodeBuckets`, with a compiled attend_fn)."""
        check_block_size(block_size, device)
        self.block_size, self.num_pages, self.page_map = block_size, num_pages, page_map
        self.full_blocks = full_blocks
        self.decode_buckets = decode_buckets
        if attend_fn is None:
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
            attend_fn = flex_attention
        self.attend_fn = attend_fn

    def plan(self, layout: PassLayout, pack: HostPack) -> FlexPlan:
        bs, decode, rows, bucketed = self.block_size, None, None, None
        if len(layout.decode_rows) and self.decode_buckets is not None:
            pos = np.asarray(layout.decode_lens, dtype=np.int64) - 1
            bucketed = self.decode_buckets.plan(layout.table, layout.decode_rows, layout.decode_lens, pos, bs, pack)
        if len(layout.decode_rows) and bucketed is None:
            lists = decode_lists(layout.table, layout.decode_rows, layout.decode_lens, bs,
                                 full_blocks=self.full_blocks)
            decode = {k: pack.add(v) for k, v in lists.items()}
            rows = pack.add(np.asarray(layout.decode_rows, dtype=np.int64))
        prefills = []
        for p in layout.prefills:
            pages = layout.table[p.table_row, :-(-(p.start + p.q_len) // bs)]
            lists = prefill_lists(pages, p.start, p.q_len, bs)
            prefills.append((p.q_start, p.q_len, pack.add([p.table_row]),
                             {k: pack.add(v) for k, v in lists.items()}))
        return FlexPlan(decode, rows, prefills, bucketed, len(layout.decode_rows))

    def metadata(self, plan: FlexPlan, pack: HostPack, pos: torch.Tensor) -> FlexMeta:
        bs, slots, pmap = self.block_size, self.num_pages * self.block_size, self.page_map.table
        decode, decode_fn = None, None
        if plan.bucketed is not None:
            decode, decode_fn = self.decode_buckets.metadata(plan.bucketed, pack, pmap, bs, slots)
        elif plan.decode is not None:
            lists = {k: pack.get(v) for k, v in plan.decode.items()}
            n = lists["kv_num"].shape[0]
            decode = decode_block_mask(lists, pmap, pack.get(plan.decode_rows), pos[:n], bs, slots)
        prefills = []
        for q_start, n, row, parts in plan.prefills:
            lists = {k: pack.get(v) for k, v in parts.items()}
            map_row = pmap.index_select(0, pack.get(row))[0]  # a copy: one compiled shape for any row
            mask = prefill_block_mask(lists, map_row, pos[q_start:q_start + n], bs, slots)
            prefills.append((q_start, n, mask))
        return FlexMeta(decode, prefills, self.attend_fn, bs, decode_fn, plan.num_decodes)


def _canonical(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` viewed as `shape` with the contiguous strides of that shape, size-1 dimensions too
    (contiguous() keeps whatever stride a size-1 dimension had)."""
    return t.reshape(-1).view(shape)


@dataclass
class FlexMeta:
    decode: BlockMask | None  # decodes first in the packed batch, one row each
    prefills: list[tuple[int, int, BlockMask]] = field(default_factory=list)  # (q_start, n, mask)
    attend_fn: object = flex_attention
    block_size: int = 16
    decode_fn: object = None  # the decodes' bucket call (`DecodeBuckets`); None: attend_fn
    num_decodes: int | None = None  # real decode entries (a bucket's mask pads after them); None: all

    def attend(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, scaling: float | None) -> torch.Tensor:
        kf = kc.transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D): the whole cache, in place
        vf = vc.transpose(0, 1).unsqueeze(0)
        outs = []
        if self.decode is not None:
            b = self.decode.kv_num_blocks.shape[0]
            n = b if self.num_decodes is None else self.num_decodes
            # (B, H, 1, D), one entry per sequence. Laid out anew (`_canonical`): the model's q
            # is strided by the pass's row count, and a compiled call guards on strides
            if self.decode_fn is None:
                qd = _canonical(q[:n], (n, q.shape[1], 1, q.shape[2]))
            else:  # padded to the bucket's b entries
                qd = q.new_zeros((b, q.shape[1], 1, q.shape[2]))
                qd[:n, :, 0] = q[:n]
            fn = self.attend_fn if self.decode_fn is None else self.decode_fn
            out = fn(qd, kf, vf, block_mask=self.decode, scale=scaling, enable_gqa=True,
                     kernel_options=kernel_options(self.block_size, prefill=False))
            outs.append(out[:n].squeeze(2))
        for q_start, n, mask in self.prefills:
            qp = _canonical(q[q_start:q_start + n].transpose(0, 1), (1, q.shape[1], n, q.shape[2]))
            out = self.attend_fn(qp, kf, vf, block_mask=mask, scale=scaling, enable_gqa=True,
                                 kernel_options=kernel_options(self.block_size, prefill=True))
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
