"""The attention backends agree: FlexAttention over the paged cache gives the grouped-SDPA
backend's greedy tokens and logits (within float tolerance) over mixed passes: decodes of
different context lengths, chunked prefill with context, shared prefix blocks, GQA models;
"auto" picks flex on CUDA and sdpa elsewhere; a pass's block tables map to the mask exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.attention import PassLayout, PrefillSpan, resolve_backend
from replicas.attention_flex import build_block_mask, logical_blocks, seq_tables
from replicas.models import load_model

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


def test_block_tables_become_the_mask_a_row_attends_with():
    """Two decodes and a chunk with context, tables with stale tails: each row sees exactly
    its own sequence's slots up to its position, whatever else the cache holds."""
    bs, num_blocks = 4, 64
    table = np.full((5, 8), 63)  # stale entries everywhere
    table[0, :2] = [7, 3]  # decode at position 5: blocks 7, 3
    table[2, :1] = [7]  # decode at position 2 sharing block 7 (a cached prefix)
    table[4, :3] = [10, 11, 40]  # chunk of 3 tokens at positions 8..10
    layout = PassLayout(table, bs, [2, 0], [3, 6], [PrefillSpan(2, 3, 8, 4)], 5, [])
    seq, tables = seq_tables(layout, num_blocks)
    assert seq.tolist() == [0, 1, 2, 2, 2]
    assert tables.tolist() == [[7, 64, 64], [7, 3, 64], [10, 11, 40]]
    logical = logical_blocks(torch.from_numpy(tables), num_blocks)
    assert logical[1, 7] == 0 and logical[1, 3] == 1 and logical[0, 3] == -1 and logical[2, 40] == 2
    pos = torch.tensor([2, 5, 8, 9, 10])
    mask = build_block_mask(torch.from_numpy(seq), pos, logical, bs, num_blocks * bs)
    dense = mask.to_dense()  # tiles: everything here is in the first tile of rows
    assert dense.shape[-2:] == (1, -(-num_blocks * bs // 128)) and dense.sum() >= 1
    seen = mask.mask_mod(0, 0, torch.arange(5)[:, None], torch.arange(num_blocks * bs)[None, :])
    visible = [torch.nonzero(r).flatten().tolist() for r in seen]
    assert visible[0] == [28, 29, 30]  # block 7 slots 28..30: positions 0..2
    assert visible[1] == [12, 13, 28, 29, 30, 31]  # block 7 (0..3) then block 3 (4..5)
    assert visible[2] == [40, 41, 42, 43, 44, 45, 46, 47, 160]  # positions 0..8
    assert visible[4] == visible[2] + [161, 162]
