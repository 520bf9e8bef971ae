"""The block manager's bulk paths give what the one-by-one ones give: `append_blocks` hands each
request the very block `allocate` would (plain free blocks first, then cached-free ones from the
least recently freed), all or nothing, and a request's blocks go back to the pool in the order
that makes the next allocation reuse them first."""

from __future__ import annotations

import random

import pytest

from replicas.scheduling.kv_cache import BlockManager
from replicas.request import Request, SamplingParams

pytestmark = pytest.mark.unit


def fill(bm: BlockManager, rng: random.Random, n: int) -> list[str]:
    """Requests of random prompts (a small alphabet: shared prefixes get cached), some freed."""
    live = []
    for i in range(n):
        req = Request(f"q{i}", [rng.randint(0, 1) for _ in range(rng.randint(1, 14))],
                      SamplingParams(max_tokens=4, temperature=0))
        if not bm.allocate(req.request_id, req.num_tokens, bm.cached_prefix(req)):
            continue
        req.num_computed_tokens = req.num_tokens
        bm.cache_computed(req)
        live.append(req.request_id)
        if rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
    return live


@pytest.mark.parametrize("seed", range(12))
def test_append_blocks_takes_what_allocate_takes_block_for_block(seed):
    rng = random.Random(seed)
    bulk, single = BlockManager(40, 4, enable_caching=True), BlockManager(40, 4, enable_caching=True)
    live = fill(bulk, random.Random(seed), 30)
    assert fill(single, random.Random(seed), 30) == live and live
    evictions = 0
    for _ in range(20):
        grow = rng.sample(live, rng.randint(1, len(live)))
        ok = bulk.append_blocks(grow)
        assert ok == (len(grow) <= single.num_free)
        if ok:
            for rid in grow:
                assert single.allocate(rid, (len(single.block_table(rid)) + 1) * single.block_size)
        assert bulk._tables == single._tables and bulk._refs == single._refs
        assert bulk.num_free == single.num_free and bulk.evictions == single.evictions
        bulk.check()
        evictions = bulk.evictions
        if rng.random() < 0.5:
            rid = live.pop(rng.randrange(len(live)))
            assert bulk.free(rid) == single.free(rid)
        if not live:
            break
    assert evictions or seed % 4, "some seeds reclaim cached-free blocks"


def test_append_blocks_is_all_or_nothing():
    bm = BlockManager(4, 2)
    assert bm.allocate("a", 2) and bm.allocate("b", 2) and bm.allocate("c", 2)
    assert not bm.append_blocks(["a", "b"])  # one free block, two asked
    assert [len(bm.block_table(r)) for r in "abc"] == [1, 1, 1] and bm.num_free == 1
    assert bm.append_blocks(["b"]) and bm.block_table("b")[-1] == 3 and bm.num_free == 0
    bm.check()


def test_freed_blocks_are_reused_first_and_first_block_first():
    bm = BlockManager(8, 2)
    assert bm.allocate("a", 6)
    table = bm.block_table("a")
    assert table == [0, 1, 2]
    assert bm.free("a") == 3
    assert bm.allocate("b", 8) and bm.block_table("b") == [0, 1, 2, 3]
    bm.check()
