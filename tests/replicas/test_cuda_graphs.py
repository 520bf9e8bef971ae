"""Decode-only passes in captured graphs: every batch size has a bucket, padding rows live in a
reserved scratch block (the block manager never hands it out, its accounting stays exact), they
never touch a request's KV, and the padded pass gives the real rows the unpadded pass's logits.
The capture itself needs CUDA; on CPU the same padded path runs eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.cuda_graphs import bucket_sizes, choose_bucket
from replicas.scheduling.kv_cache import BlockManager
from replicas.loading.models import load_model
from replicas.execution.transfer import HostPack

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def engine(llama, **runner) -> Engine:
    return Engine(*llama, EngineConfig(max_batch_prefill_tokens=32, max_batch_total_tokens=1024,
                                       block_size=4, max_num_seqs=12, **runner))


def test_buckets_cover_every_batch_size() -> None:
    assert bucket_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(50) == [1, 2, 4, 8, 16, 32, 50]
    buckets = bucket_sizes(128)
    for n in range(1, 129):
        b = choose_bucket(n, buckets)
        assert b >= n and (b == 1 or max(x for x in buckets if x < b) < n)  # the smallest that fits
    assert choose_bucket(129, buckets) is None


def test_padding_rows_write_and_read_the_scratch_block_only(llama) -> None:
    """A pass of 3 decodes in bucket 4: the padding row writes the scratch block's first slot,
    reads that page alone through the page map's padding row; the lists are only as wide as
    the longest live context needs, never max_model_len."""
    eng = engine(llama, attention_backend="flex", cuda_graphs=True)
    graphs, pm = eng.runner.graphs, eng.runner.page_map
    scratch = graphs.scratch_block
    assert pm.table[pm.pad_row, scratch] == 0  # written at start (applied with the first pass)
    tokens = np.array([[11, 12, 13], [5, 2, 9], [4 * 3 + 1, 4 * 7 + 2, 4 * 5 + 1]])  # ids, positions, slots
    eng.runner._table[[0, 1, 2], :3] = [[3, 4, 0], [7, 0, 0], [5, 6, 8]]
    pack = HostPack()
    parts = graphs.plan(tokens, [0, 1, 2], [6, 3, 10], 4, pack)
    host = [a for _, a in pack._arrays]
    padded, kv_num, kv_idx = host
    assert padded.tolist() == [[11, 12, 13, 0], [5, 2, 9, 0], [13, 30, 21, scratch * 4], [0, 1, 2, pm.pad_row]]
    assert kv_num.tolist() == [2, 1, 3, 1]
    assert kv_idx.shape == (4, 4) and graphs.max_width >= 128 // 4  # bucketed to the live contexts
    assert kv_idx[:, :3].tolist() == [[3, 4, 0], [7, 0, 0], [5, 6, 8], [scratch] * 3]
    assert len(parts) == 3


def test_the_scratch_block_is_reserved_and_accounting_stays_exact() -> None:
    bm = BlockManager(8, 4)
    scratch = bm.reserve()
    assert scratch == 7 and bm.num_blocks == 7 and bm.num_free == 7 and bm.capacity_tokens == 28
    bm.check()
    assert bm.allocate("a", 28)  # every block a request can have
    assert scratch not in bm.block_table("a") and not bm.can_allocate("b", 1)
    bm.check()
    with pytest.raises(RuntimeError):
        bm.reserve()
    bm.free("a")
    assert bm.num_free == bm.num_blocks
    bm.check()


def test_padded_decode_passes_equal_the_eager_ones(llama) -> None:
    """Prompts of several lengths (decode batches of 1-7 rows, padded to 1/2/4/8): the same
    greedy tokens and logprobs as the flex and sdpa backends unpadded; padding rows wrote the
    scratch block and nothing else (every other slot holds what the unpadded run wrote)."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(5, 1900, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 60, 2, 25)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    graphed = engine(llama, attention_backend="flex", cuda_graphs=True)
    assert graphed.runner.cuda_graphs and graphed.runner.graphs.buckets == [1, 2, 4, 8, 12]
    scratch = graphed.runner.graphs.scratch_block
    replays: list[tuple[int, int]] = []  # (real rows, bucket)
    plan = graphed.runner.graphs.plan

    def counted(tokens, rows, lens, bucket, pack):
        replays.append((tokens.shape[1], bucket))
        return plan(tokens, rows, lens, bucket, pack)

    graphed.runner.graphs.plan = counted
    outs = graphed.generate(ps, params)
    assert {b for _, b in replays} <= {1, 2, 4, 8} and any(n < b for n, b in replays)
    assert graphed.blocks.num_free == graphed.blocks.num_blocks == graphed.runner.k_cache.shape[1] // 4 - 1
    graphed.blocks.check()
    for backend in ("flex", "sdpa"):
        plain = engine(llama, attention_backend=backend, cuda_graphs=False)
        assert plain.runner.graphs is None
        want = plain.generate(ps, params)
        for a, b in zip(want, outs):
            assert a.token_ids == b.token_ids
            assert [x[0] for x in b.logprobs] == pytest.approx([x[0] for x in a.logprobs], abs=1e-4)
    # Block ids are handed out alike (the scratch block is the last): every slot but the
    # scratch block's holds the same k/v in both caches.
    real = torch.ones(plain.runner.k_cache.shape[1], dtype=torch.bool)
    real[scratch * 4:(scratch + 1) * 4] = False
    assert torch.allclose(graphed.runner.k_cache[:, real], plain.runner.k_cache[:, real], atol=1e-5)
    assert torch.allclose(graphed.runner.v_cache[:, real], plain.runner.v_cache[:, real], atol=1e-5)


def test_graphs_need_the_flex_backend(llama) -> None:
    with pytest.raises(ValueError, match="flex"):
        engine(llama, attention_backend="sdpa", cuda_graphs=True)
    assert engine(llama).runner.cuda_graphs is False  # the CPU default


def test_flex_and_padded_passes_make_no_tensor_off_the_device(llama) -> None:
    """With torch's default device set to meta, a tensor the flex backend or the padded decode
    path made without naming the pass's device would land on meta and the pass would fail (as
    the same line would on CUDA); the tokens are those of the plain run."""
    eng = engine(llama, attention_backend="flex", cuda_graphs=True)
    ps = [[5, 6, 7], list(range(40, 75)), [9] * 12]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    want = eng.generate(ps, params)
    with torch.device("meta"):
        got = eng.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]


def test_chosen_graph_sizes_are_the_only_buckets(llama) -> None:
    """cuda_graph_sizes (4,): every decode-only pass of 1-4 rows runs padded in bucket 4, past it
    eagerly; the tokens are the unpadded path's. Sizes outside 1..max_num_seqs are refused."""
    eng = engine(llama, attention_backend="flex", cuda_graphs=True, cuda_graph_sizes=(4,))
    assert eng.runner.graphs.buckets == [4]
    assert eng.runner.graphs.bucket(3) == 4 and eng.runner.graphs.bucket(5) is None
    ps = [[5, 6, 7], list(range(40, 75)), [9] * 12, [3] * 5, [8] * 7, [2, 2]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = engine(llama).generate(ps, params)
    assert [o.token_ids for o in eng.generate(ps, params)] == [o.token_ids for o in want]
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(max_num_seqs=8, cuda_graph_sizes=(16,))
