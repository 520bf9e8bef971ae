"""A decode takes a KV block only in the pass whose token begins one (every block_size passes),
and its table always covers what it computes: the scheduler skips the allocation call otherwise,
with the same blocks, the same preemptions and the same tokens as allocating every pass."""

from __future__ import annotations

import pytest

from replicas.config import EngineConfig
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduling.kv_cache import BlockManager
from replicas.scheduling.scheduler import Scheduler

pytestmark = pytest.mark.unit


def _scheduler(blocks: int, block_size: int = 4) -> Scheduler:
    cfg = EngineConfig(policy="stall_free", max_batch_prefill_tokens=64, max_batch_total_tokens=blocks * block_size,
                       block_size=block_size, max_num_seqs=8)
    return Scheduler(cfg, BlockManager(blocks, block_size), clock=lambda: 0.0)


def _run(s: Scheduler, prompts: list[int], max_tokens: int) -> tuple[list[list[int]], list[str]]:
    """Run to completion; per pass each request's table length, and the preempted ids in order."""
    reqs = [Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                    arrival_time=i) for i, n in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    tables, preempted = [], []
    while s.has_unfinished():
        out = s.schedule()
        preempted += [r.request_id for r in out.preempted]
        for seq in out.decodes:  # the token at `start` has its slot
            assert len(s.blocks.block_table(seq.request.request_id)) * 4 > seq.start
        tables.append([len(s.blocks.block_table(r.request_id)) for r in reqs])
        for r in s.advance(out, [7] * sum(q.samples for q in out.seqs), now=0.0):
            if len(r.output_token_ids) >= max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        assert s.blocks.num_used + s.blocks.num_free == s.blocks.num_blocks
    assert all(len(r.output_token_ids) == max_tokens for r in reqs)
    return tables, preempted


def test_a_decode_takes_a_block_when_its_token_begins_one():
    tables, preempted = _run(_scheduler(64), [5], max_tokens=12)
    # prompt 5 -> 2 blocks; then its tokens at positions 5.. 15: a new block at 8 and at 12
    assert [t[0] for t in tables] == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert preempted == []


def test_every_allocation_skipped_would_have_changed_nothing_even_under_preemption():
    class EveryPass(Scheduler):  # also calls the allocation the walk skips: it must find the block there
        def _schedule_decodes(self, out):  # noqa: ANN001, ANN202
            for r in self.running:
                if not r.is_prefilling and r.num_computed_tokens % 4:
                    assert self.blocks.allocate(r.request_id, r.num_tokens)  # covered: never fails
            return super()._schedule_decodes(out)

    cfg_blocks = 9  # three requests that each grow to 4 blocks cannot all fit
    a = _run(_scheduler(cfg_blocks), [6, 7, 5], max_tokens=9)
    s = _scheduler(cfg_blocks)
    s.__class__ = EveryPass
    b = _run(s, [6, 7, 5], max_tokens=9)
    assert a == b and a[1]  # the same tables every pass, and some request was preempted
