"""The block manager never over-commits and its prefix cache shares exactly the computed full
blocks of equal prefixes: used + cached-free + free == total after every operation."""

from __future__ import annotations

import random

import pytest

from replicas.scheduling.kv_cache import BlockManager
from replicas.scheduling.prefix_hash import PrefixSketch, block_hashes
from replicas.request import Request, SamplingParams

pytestmark = pytest.mark.unit


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, temperature=0))


def compute(bm: BlockManager, req: Request, prefix: list[int] | None = None) -> None:
    """Admit `req` (with its cached prefix) and run its whole prompt, as the scheduler does."""
    prefix = bm.cached_prefix(req) if prefix is None else prefix
    assert bm.allocate(req.request_id, req.num_tokens, prefix)
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed(req)


def test_equal_prefixes_share_full_blocks_and_the_last_token_always_runs():
    bm = BlockManager(16, 4, enable_caching=True)
    a = request("a", list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    assert bm.cached_prefix(a) == []
    compute(bm, a)
    assert bm.num_cached == 2 and bm.num_used == 3
    table_a = bm.block_table("a")
    # Same 10 tokens: both full blocks (8 tokens) are hits, token 9 and 10 run again.
    assert bm.cached_prefix(request("b", list(range(10)))) == table_a[:2]
    # Exactly 8 tokens: only the first block, so the pass still has a token to sample from.
    assert bm.cached_prefix(request("c", list(range(8)))) == table_a[:1]
    # Diverging inside the second block: the first block only.
    assert bm.cached_prefix(request("d", [0, 1, 2, 3, 4, 99, 6, 7, 8])) == table_a[:1]
    # Diverging in the first block: nothing.
    assert bm.cached_prefix(request("e", [5, 1, 2, 3, 4, 5, 6, 7, 8])) == []
    # Sharing takes references, not blocks: only the new tail block leaves the pool.
    b = request("b", list(range(10)) + [50, 51])
    free_before = bm.num_free
    compute(bm, b)
    assert bm.block_table("b")[:2] == table_a[:2]
    assert bm.num_free == free_before - 1
    bm.check()


def test_freed_cached_blocks_stay_findable_until_reclaimed_tail_first():
    bm = BlockManager(4, 4, enable_caching=True)
    a = request("a", list(range(17)))  # 4 full blocks + 1 token: needs 5 > 4 blocks
    assert not bm.allocate("a", 17)
    a = request("a", list(range(12)))  # three full blocks, all registered once computed
    compute(bm, a)
    table = list(bm.block_table("a"))
    bm.free("a")
    assert bm.num_used == 0 and bm.num_free == 4 and bm.num_cached == 3
    # Back again: its prefix (all but the last token's block) is still there.
    assert bm.cached_prefix(request("a2", list(range(12)))) == table[:2]
    # A new request needs 2 blocks: the one plain free block, then the cached tail block.
    assert bm.allocate("x", 8)
    assert bm.evictions == 1 and bm.num_cached == 2
    assert bm.cached_prefix(request("a3", list(range(12)))) == table[:2]
    bm.check()


def test_caching_off_shares_nothing():
    bm = BlockManager(8, 4)
    compute(bm, request("a", list(range(10))))
    assert bm.num_cached == 0 and bm.cached_prefix(request("b", list(range(10)))) == []
    assert bm.sketch() is None


def test_randomized_operations_keep_the_invariant():
    """Hundreds of seeded allocate / append / share / free / preempt / evict steps."""
    rng = random.Random(1234)
    bm = BlockManager(40, 4, enable_caching=True)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    live: dict[str, Request] = {}
    ops = {"admit": 0, "append": 0, "free": 0, "preempt": 0, "hit": 0}
    for step in range(600):
        op = rng.choice(["admit", "admit", "append", "append", "free", "preempt"])
        if op == "admit" or not live:
            stem = rng.choice(stems)
            tokens = stem[:rng.randrange(1, len(stem) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
            req = request(f"r{step}", tokens)
            prefix = bm.cached_prefix(req)
            if not bm.can_allocate(req.request_id, req.num_tokens, prefix=prefix):
                bm.check()
                continue
            ops["hit"] += bool(prefix)
            compute(bm, req, prefix)
            live[req.request_id] = req
            op = "admit"
        elif op == "append":
            req = live[rng.choice(sorted(live))]
            if bm.allocate(req.request_id, req.num_tokens + 1):
                req.output_token_ids.append(rng.randrange(100))
                req.num_computed_tokens += 1
                bm.cache_computed(req)
        else:  # free (finished) or preempt (freed, recomputed later from its own prefix)
            rid = rng.choice(sorted(live))
            req = live.pop(rid)
            bm.free(rid)
            if op == "preempt":
                req.num_computed_tokens = 0
                again = bm.cached_prefix(req)
                assert len(again) <= (req.num_tokens - 1) // 4
        ops[op] += 1
        bm.check()
    assert min(ops.values()) > 20, ops  # every kind of operation ran, sharing included
    assert bm.evictions > 0  # the pool was small enough to reclaim cached blocks
    for rid in list(live):
        bm.free(rid)
    bm.check()
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks


def test_sketch_reports_the_leading_cached_blocks():
    bm = BlockManager(64, 4, enable_caching=True)
    tokens = list(range(40))
    compute(bm, request("a", tokens))
    sketch = bm.sketch()
    assert isinstance(sketch, PrefixSketch) and sketch.num_bits >= 64 * 16
    hashes = block_hashes(tokens + [1, 2, 3, 4], 4)  # the router hashes the prompt the same way
    assert sketch.matched_blocks(hashes) == 10  # all of a's full blocks, not the new one
    assert sketch.matched_blocks(block_hashes([7] + tokens[1:], 4)) == 0
    assert bm.sketch() is sketch  # unchanged cache: the same object, not rebuilt


def test_the_kept_sketch_equals_one_built_from_the_cached_hashes():
    """The counts follow registration and reclaim exactly: the packed sketch is the Bloom filter
    of what is cached now (evicted hashes gone), bit for bit."""
    bm = BlockManager(8, 4, enable_caching=True)
    for seed in range(6):  # 6 x 2 full blocks through an 8-block pool: reclaim happens
        req = request(f"r{seed}", [seed * 100 + i for i in range(9)])
        compute(bm, req)
        bm.free(req.request_id)
    assert bm.evictions > 0
    assert bm.sketch() == PrefixSketch.of(bm._cached, bm.num_blocks)
