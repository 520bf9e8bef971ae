"""The attention backends agree: FlexAttention over the paged cache gives the grouped-SDPA
backend's greedy tokens and logits (within float tolerance) over mixed passes: decodes of
different context lengths, chunked prefill with context, shared prefix blocks, GQA models;
"auto" picks flex on CUDA and sdpa elsewhere; a pass's block tables map to the mask exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.attention import PassLayout, PrefillSpan, resolve_backend
from replicas.execution.attention_flex import (PageMap, decode_block_mask, decode_lists, prefill_block_mask, prefill_lists,
                                     tile_visits)
from replicas.loading.models import load_model
from replicas.execution.transfer import HostPack, Staging

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["embedded:tiny", "embedded:mid"])
def model_tok(request):
    return load_model(request.param)


def engine(model_tok, backend: str, **overrides) -> Engine:
    cfg = dict(max_batch_prefill_tokens=24, max_batch_total_tokens=1024, block_size=4, max_num_seqs=8,
               attention_backend=backend)
    cfg.update(overrides)
    return Engine(*model_tok, EngineConfig(**cfg))


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [5, 70, 1, 33, 150, 12, 9, 64][:n]
    return [torch.randint(5, 1900, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("caching", [False, True])
def test_flex_equals_sdpa_on_mixed_passes(model_tok, caching):
    """Prompts of 1-150 tokens in 24-token chunks next to running decodes (every pass mixes
    decodes of several context lengths with a chunk that has context); with caching, prompts
    that share a 40-token prefix read its blocks from several tables."""
    ps = prompts(8)
    if caching:
        ps = [ps[4][:40] + p for p in ps]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = {}
    for backend in ("sdpa", "flex"):
        eng = engine(model_tok, backend, enable_prefix_caching=caching)
        assert eng.runner.attention_backend == backend
        outs[backend] = eng.generate(ps, params if not caching else
                                     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3))
        assert eng.blocks.num_free == eng.blocks.num_blocks
        eng.blocks.check()
        mixed = [it for it in eng.iterations if it.num_prefill_tokens and it.num_decode_tokens]
        assert mixed, "no pass mixed decodes with a prefill chunk"
    for a, b in zip(outs["sdpa"], outs["flex"]):
        assert a.token_ids == b.token_ids
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
            assert lp_b == pytest.approx(lp_a, abs=1e-4)
            assert [v for _, v in top_b] == pytest.approx([v for _, v in top_a], abs=1e-4)
        if a.prompt_logprobs is not None:
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
            for (lp_a, _), (lp_b, _) in zip(a.prompt_logprobs, b.prompt_logprobs):
                assert lp_b == pytest.approx(lp_a, abs=1e-4)


def test_auto_is_flex_on_cuda_and_sdpa_elsewhere():
    assert resolve_backend("auto", torch.device("cuda")) == "flex"
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("sdpa", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("flash", torch.device("cpu"))


def sparse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
                     scale: float | None = None) -> torch.Tensor:
    """Attention as the fused kernels compute it: a query tile reads only the pages its lists
    name, mask_mod applied on partial pages only (full ones are taken whole). For tests: the
    lists are what a GPU run trusts, and torch's unfused path ignores them.
    q (B, H, L, D), k/v (1, Hkv, S, D) -> (B, H, L, D)."""
    b, h, length, d = q.shape
    s = k.shape[2]
    qt, kt = mask.BLOCK_SIZE
    allowed = torch.zeros((b, length, s), dtype=torch.bool, device=q.device)
    rows = torch.arange(length, device=q.device)
    for bi in range(b):
        for ti in range(-(-length // qt)):
            r = rows[ti * qt:(ti + 1) * qt]
            lists = [(mask.kv_num_blocks, mask.kv_indices, True)]
            if mask.full_kv_num_blocks is not None:
                lists.append((mask.full_kv_num_blocks, mask.full_kv_indices, False))
            for num, idx, partial in lists:
                for page in idx[bi, 0, ti, :int(num[bi, 0, ti])].tolist():
                    cols = torch.arange(page * kt, (page + 1) * kt, device=q.device)
                    ok = (mask.mask_mod(torch.tensor(bi), torch.tensor(0), r[:, None], cols[None, :])
                          if partial else torch.ones((len(r), kt), dtype=torch.bool, device=q.device))
                    allowed[bi, r[0]:r[-1] + 1, page * kt:(page + 1) * kt] |= ok
    group = h // k.shape[1]
    kk = k[0].repeat_interleave(group, 0).float()  # (H, S, D)
    vv = v[0].repeat_interleave(group, 0).float()
    scores = (q.float() @ kk.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ vv).to(q.dtype)


def _slots(table_row: np.ndarray, n: int, bs: int) -> list[int]:
    return [int(table_row[p // bs]) * bs + p % bs for p in range(n)]


def _page_map(table: np.ndarray, counts: dict[int, int], num_pages: int) -> PageMap:
    pm = PageMap(table.shape[0] + 1, num_pages, torch.device("cpu"))
    for row, n in counts.items():
        pm.write(row, 0, table[row, :n])
    pm.apply(pm.plan(pack := HostPack()), _sent(pack))
    return pm


def _sent(pack: HostPack) -> HostPack:
    pack.send(torch.device("cpu"), Staging(torch.device("cpu")))
    return pack


@pytest.mark.parametrize("full_blocks", [False, True])
def test_decode_lists_read_each_sequence_own_pages_only(full_blocks):
    """Three decodes with stale table tails and a shared prefix page: each entry lists its own
    pages, the mask shows exactly its slots up to its position, and attention through the
    lists as the fused kernel reads them equals attention over the gathered context."""
    bs, num_pages = 4, 32
    table = np.full((4, 8), 31)  # stale entries everywhere
    table[0, :2] = [7, 3]  # 6 tokens: page 7 then 3 (partial)
    table[2, :1] = [7]  # 3 tokens, sharing page 7 (a cached prefix)
    table[3, :3] = [10, 11, 20]  # 12 tokens: three full pages
    rows, lens = [0, 2, 3], [6, 3, 12]
    lists = decode_lists(table, rows, lens, bs, full_blocks=full_blocks)
    pm = _page_map(table, {0: 2, 2: 1, 3: 3}, num_pages)
    pos = torch.tensor(lens) - 1
    mask = decode_block_mask({k: torch.from_numpy(v) for k, v in lists.items()}, pm.table,
                             torch.tensor(rows), pos, bs, num_pages * bs)
    listed = tile_visits(mask)[:, 0].tolist()
    assert listed == [2, 1, 3]  # its own pages, nothing of the others'
    seen = mask.mask_mod(torch.arange(3)[:, None], 0, 0, torch.arange(num_pages * bs)[None, :])
    visible = [torch.nonzero(r).flatten().tolist() for r in seen]
    for i, (row, n) in enumerate(zip(rows, lens)):
        assert visible[i] == sorted(_slots(table[row], n, bs))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 8, generator=g)
    k, v = torch.randn(1, 2, num_pages * bs, 8, generator=g), torch.randn(1, 2, num_pages * bs, 8, generator=g)
    got = sparse_reference(q, k, v, mask)
    for i, (row, n) in enumerate(zip(rows, lens)):
        idx = torch.tensor(_slots(table[row], n, bs))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[i:i + 1], k[:, :, idx], v[:, :, idx], enable_gqa=True)
        assert torch.allclose(got[i], want[0], atol=1e-5)


def test_prefill_lists_skip_pages_past_each_tile_and_take_earlier_ones_whole():
    """A 300-row chunk at positions 40..339 in 128-row tiles, pages of 16: tile i lists whole the
    pages before its first row, partial the pages up to its last row's, nothing after; through
    the lists (mask_mod on partial pages only) it equals causal attention over the context."""
    bs, start, n = 16, 40, 300
    pages = np.arange(100, 100 + 22)[::-1].copy()  # 22 pages (340 tokens), in no order
    lists = prefill_lists(pages, start, n, bs)
    assert lists["full_num"].tolist() == [2, 10, 18] and lists["kv_num"].tolist() == [9, 9, 4]
    assert lists["kv_idx"][0, :9].tolist() == pages[2:11].tolist()
    assert lists["full_idx"][2, :18].tolist() == pages[:18].tolist()
    num_pages = 128
    table = np.zeros((1, 22), dtype=np.int64)
    table[0] = pages
    pm = _page_map(table, {0: 22}, num_pages)
    q_pos = torch.arange(start, start + n)
    mask = prefill_block_mask({k: torch.from_numpy(v) for k, v in lists.items()}, pm.table[0], q_pos, bs,
                              num_pages * bs)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, n, 8, generator=g)
    k, v = torch.randn(1, 1, num_pages * bs, 8, generator=g), torch.randn(1, 1, num_pages * bs, 8, generator=g)
    got = sparse_reference(q, k, v, mask)
    idx = torch.tensor(_slots(pages, start + n, bs))
    causal = torch.arange(start + n)[None, :] <= q_pos[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, idx], v[:, :, idx], attn_mask=causal,
                                                            enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)
    # 128-row tiles x 16-slot pages: tile 0 reads 11 of the 22 pages, tile 2 all 22
    assert tile_visits(mask)[0].tolist() == [11, 19, 22]


def test_page_map_follows_writes_and_clears_in_order():
    pm = PageMap(3, 10, torch.device("cpu"))
    pm.write(0, 0, [4, 5])
    pm.clear(0, [4])
    pm.write(0, 2, [4])  # the last change to (row 0, page 4) wins
    pm.write(1, 0, [9])
    pm.apply(pm.plan(pack := HostPack()), _sent(pack))
    assert pm.table[0, [4, 5]].tolist() == [2, 1] and pm.table[1, 9] == 0 and pm.table[2].eq(-1).all()
    assert pm.plan(HostPack()) is None  # nothing pending
