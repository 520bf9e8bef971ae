"""Scheduler decisions, without a model: exact tokens per request per iteration under the budgets."""

from __future__ import annotations

import pytest

from replicas.config import EngineConfig
from replicas.scheduling.kv_cache import BlockManager
from replicas.request import Request, RequestStatus, SamplingParams
from replicas.scheduling.batch import SchedulerOutput
from replicas.scheduling.scheduler import Scheduler


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(policy: str, mbp: int = 16, mbt: int = 256, block_size: int = 4, max_num_seqs: int = 64,
         aging: float = 1000.0) -> tuple[Scheduler, FakeClock]:
    cfg = EngineConfig(policy=policy, max_batch_prefill_tokens=mbp, max_batch_total_tokens=mbt,
                       block_size=block_size, max_num_seqs=max_num_seqs, priority_aging_s=aging)
    clock = FakeClock()
    return Scheduler(cfg, BlockManager(mbt // block_size, block_size), clock), clock


def req(rid: str, prompt_len: int, max_tokens: int, clock: FakeClock, priority: int = 0) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                priority=priority, arrival_time=clock.t)
    clock.t += 0.001
    return r


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, then advance the pass as the engine does (sampled token = 7, length stops only)."""
    out = s.schedule()
    for r in s.advance(out, [7] * sum(seq.samples for seq in out.seqs), now=0.0):
        if len(r.output_token_ids) >= r.params.max_tokens:
            s.finish(r, RequestStatus.FINISHED_LENGTH)
    b = s.blocks
    assert b.num_used + b.num_free == b.num_blocks
    # The incrementally kept counts are the sums they stand for.
    assert s.num_running_tokens == sum(r.num_tokens for r in s.running)
    assert s.num_waiting_tokens == sum(r.num_tokens_to_compute for r in s.waiting)
    return out


def tokens(out: SchedulerOutput) -> dict[str, int]:
    return {seq.request.request_id: seq.num_tokens for seq in out.seqs}


@pytest.mark.unit
def test_stall_free_hybrid_batch_holds_decodes_and_a_cut_chunk():
    s, clock = make("stall_free", mbp=16)
    a, b = req("a", 10, 5, clock), req("b", 30, 5, clock)
    s.add(a)
    s.add(b)
    assert tokens(step(s)) == {"a": 10, "b": 6}  # a's whole prompt, b's first chunk cut to fit
    out = step(s)
    assert tokens(out) == {"a": 1, "b": 15}  # a decodes first; b's chunk fills the rest
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 15
    assert tokens(step(s)) == {"a": 1, "b": 9}  # b's prompt completes (and samples)
    assert tokens(step(s)) == {"a": 1, "b": 1}


@pytest.mark.unit
def test_stall_free_never_skips_a_decoding_request():
    s, clock = make("stall_free", mbp=8, mbt=1024)
    for i in range(4):
        s.add(req(f"d{i}", 4, 40, clock))
    for _ in range(3):  # 8, then 2 decodes + 6 prompt tokens, then 3 decodes + 2
        step(s)
    assert all(not r.is_prefilling for r in s.running)
    for i in range(3):
        s.add(req(f"long{i}", 100, 3, clock))
    for _ in range(30):
        decoding = {r.request_id for r in s.running if not r.is_prefilling}
        out = step(s)
        assert decoding <= set(tokens(out)), "a decoding request was skipped"
        assert out.num_tokens <= 8
        assert out.num_decode_tokens >= len(decoding)


@pytest.mark.unit
def test_dynamic_admission_pass_has_no_decode_tokens():
    s, clock = make("dynamic", mbp=64)
    a = req("a", 8, 10, clock)
    s.add(a)
    assert tokens(step(s)) == {"a": 8}
    assert tokens(step(s)) == {"a": 1}
    s.add(req("long", 60, 3, clock))
    out = step(s)
    assert tokens(out) == {"long": 60}  # whole prompt; a's decode stalls this pass
    assert out.num_decode_tokens == 0
    assert tokens(step(s)) == {"a": 1, "long": 1}


@pytest.mark.unit
def test_dynamic_packs_whole_prompts_up_to_mbp():
    s, clock = make("dynamic", mbp=20)
    for rid, n in [("a", 8), ("b", 10), ("c", 5)]:
        s.add(req(rid, n, 4, clock))
    assert tokens(step(s)) == {"a": 8, "b": 10}  # c would exceed 20 prompt tokens
    assert tokens(step(s)) == {"c": 5}
    assert tokens(step(s)) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.unit
def test_static_admits_only_when_the_batch_is_done():
    s, clock = make("static", mbp=16)
    s.add(req("a", 6, 2, clock))
    s.add(req("b", 6, 4, clock))
    assert tokens(step(s)) == {"a": 6, "b": 6}
    s.add(req("c", 3, 2, clock))
    assert tokens(step(s)) == {"a": 1, "b": 1}  # c waits although budget is free; a finishes
    assert tokens(step(s)) == {"b": 1}
    assert tokens(step(s)) == {"b": 1}  # b done
    assert tokens(step(s)) == {"c": 3}


@pytest.mark.unit
def test_static_chunks_prompts_longer_than_mbp_before_decoding():
    s, clock = make("static", mbp=16)
    s.add(req("a", 20, 2, clock))
    s.add(req("b", 4, 2, clock))
    assert tokens(step(s)) == {"a": 16}
    assert tokens(step(s)) == {"a": 4, "b": 4}
    assert tokens(step(s)) == {"a": 1, "b": 1}


@pytest.mark.unit
def test_mbt_limits_admission_and_blocks_return_to_free():
    s, clock = make("stall_free", mbp=64, mbt=32, block_size=4)  # 8 blocks
    a, b = req("a", 20, 4, clock), req("b", 20, 4, clock)
    s.add(a)
    s.add(b)
    out = step(s)
    # a takes 5 blocks; b is cut to what is left after the 1-block admission watermark.
    assert tokens(out) == {"a": 20, "b": 8}
    assert s.blocks.num_free == 1
    while s.has_unfinished():
        step(s)
    assert s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.unit
def test_a_started_prompt_leaves_the_decodes_the_admission_headroom():
    """A prompt's later chunks take no more KV than admission would: with a request decoding, the
    watermark block stays free for its next tokens (it was taken down to 0, and the decode then
    preempted someone); with nothing decoding, the chunk takes every free block."""
    s, clock = make("stall_free", mbp=8, mbt=48, block_size=4)  # 12 blocks, watermark 1
    a, b = req("a", 4, 10, clock), req("b", 40, 2, clock)
    s.add(a)
    s.add(b)
    assert tokens(step(s)) == {"a": 4, "b": 4}  # a's prompt (1 block), b's first chunk
    preempted = []
    while b.is_prefilling and s.has_unfinished():
        out = step(s)
        preempted += out.preempted
        if "a" in tokens(out) and "b" in tokens(out):  # a decoding beside b's chunk
            assert s.blocks.num_free >= s.watermark_blocks
    assert not preempted and a.num_preemptions == 0
    s2, clock2 = make("stall_free", mbp=8, mbt=48, block_size=4)
    c = req("c", 47, 2, clock2)
    s2.add(c)
    while c.is_prefilling:
        step(s2)
    assert s2.blocks.num_free == 0  # nothing decoding: its chunks took the last block too


@pytest.mark.unit
def test_preemption_picks_least_urgent_latest_and_recomputes():
    s, clock = make("stall_free", mbp=64, mbt=24, block_size=4)  # 6 blocks
    a = req("a", 8, 8, clock, priority=0)
    b = req("b", 8, 8, clock, priority=1)
    s.add(a)
    s.add(b)
    step(s)
    preempted = []
    while s.has_unfinished():
        out = step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted == ["b"]  # the lower-priority request yields, once
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.unit
def test_priority_orders_admission_and_aging_prevents_starvation():
    s, clock = make("dynamic", mbp=8, aging=1.0)
    low = req("low", 8, 2, clock, priority=3)
    high = req("high", 8, 2, clock, priority=0)
    s.add(low)
    s.add(high)
    assert tokens(step(s)) == {"high": 8}  # lower number first despite arriving later
    s2, clock2 = make("dynamic", mbp=8, aging=1.0)
    old = req("old", 8, 2, clock2, priority=3)
    clock2.t += 5.0  # old has waited 5 s: aged to class -2
    new = req("new", 8, 2, clock2, priority=0)
    s2.add(old)
    s2.add(new)
    assert tokens(step(s2)) == {"old": 8}


@pytest.mark.unit
def test_max_num_seqs_caps_running_requests():
    s, clock = make("stall_free", mbp=64, max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 4, 3, clock))
    assert tokens(step(s)) == {"r0": 4, "r1": 4}
    assert len(s.running) == 2 and len(s.waiting) == 2


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["static", "dynamic", "stall_free"])
def test_abort_frees_blocks_from_any_state(policy):
    s, clock = make(policy, mbp=16)
    a, b = req("a", 12, 50, clock), req("b", 30, 50, clock)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished()
    assert s.blocks.num_free == s.blocks.num_blocks
    assert a.finish_reason == "abort"


@pytest.mark.unit
def test_expire_takes_only_never_scheduled_requests_past_the_deadline():
    cfg = EngineConfig(max_batch_prefill_tokens=16, max_batch_total_tokens=256, block_size=4,
                       queue_timeout_s=2.0)
    clock = FakeClock()
    s = Scheduler(cfg, BlockManager(64, 4), clock)
    fresh, old, preempted = (req(r, 4, 4, clock) for r in ("fresh", "old", "preempted"))
    old.arrival_time = preempted.arrival_time = -5.0
    preempted.first_scheduled_time = -4.0  # it ran before: its client has tokens already
    for r in (fresh, old, preempted):
        s.add(r)
    assert s.expire(clock.t) == [old]
    assert old.status == RequestStatus.FINISHED_QUEUE_TIMEOUT and old.finish_reason == "queue_timeout"
    assert [r.request_id for r in s.waiting] == ["preempted", "fresh"]
    assert s.expire(clock.t + 1.0) == []
    clock.t += 2.1
    assert s.expire(clock.t) == [fresh]


@pytest.mark.unit
def test_expire_refuses_at_once_who_the_queue_would_start_past_the_deadline():
    """With the drain rate known, a request whose predicted start (tokens waiting ahead of it /
    rate) lies past its deadline leaves now; those behind it no longer wait for its tokens, and a
    request that has a stream running (preempted) stays whatever the prediction."""
    cfg = EngineConfig(max_batch_prefill_tokens=16, max_batch_total_tokens=1024, block_size=4,
                       queue_timeout_s=2.5)
    clock = FakeClock()
    s = Scheduler(cfg, BlockManager(256, 4), clock)
    a, b, c, d = (req(r, 100, 4, clock) for r in "abcd")  # arrive at 0, 1, 2 and 3 ms
    e = req("e", 10, 4, clock)
    for r in (a, b, c, d, e):
        s.add(r)
    now = clock.t
    assert s.expire(now, drain_tps=None) == []  # no rate: only the deadline counts
    # 100 tokens/s: a starts now, b in 1 s, c in 2 s (all within 2.5 s of arrival), d in 3 s:
    # d leaves; e then waits behind 300 tokens, 3 s: it leaves as well.
    assert s.expire(now, drain_tps=100.0) == [d, e]
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    assert s.num_waiting_tokens == 300
    assert d.finish_reason == "queue_timeout"
    # At 200 tokens/s everyone left starts within 1 s.
    assert s.expire(now, drain_tps=200.0) == []
    # A preempted request is never refused: it counts ahead of the rest, and the rest go.
    c.first_scheduled_time = now  # c ran before and was preempted: its client has tokens
    assert s.expire(now + 1.6, drain_tps=100.0) == [b]  # b would start 2.6 s after arrival; c stays
    assert [r.request_id for r in s.waiting] == ["a", "c"]
    # A stalled queue (0.0: nothing prefilled lately) starts no one behind its head: a new
    # arrival goes at once; the head waits for its deadline.
    f = req("f", 10, 4, clock)
    s.add(f)
    assert s.expire(f.arrival_time, drain_tps=0.0) == [f]
    assert [r.request_id for r in s.waiting] == ["a", "c"]


@pytest.mark.unit
def test_without_a_deadline_nothing_expires():
    s, clock = make("stall_free")
    r = req("a", 4, 4, clock)
    r.arrival_time = -1e9
    s.add(r)
    assert s.expire(clock.t) == []


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["stall_free", "dynamic", "static"])
def test_a_prompt_only_request_samples_nothing_and_leaves_after_its_prefill(policy):
    """max_tokens 0 (a prompt only scored): its last chunk completes it without sampling, advance
    hands it back once with no token, and it holds no KV after; the others are unaffected."""
    s, clock = make(policy, mbp=16 if policy != "dynamic" else 64)
    a, b = req("a", 30, 0, clock), req("b", 5, 3, clock)
    s.add(a)
    s.add(b)
    passes = []
    while s.has_unfinished():
        out = step(s)
        passes.append({seq.request.request_id: (seq.num_tokens, seq.samples) for seq in out.seqs})
    a_chunks = [p["a"] for p in passes if "a" in p]
    assert sum(n for n, _ in a_chunks) == 30 and not any(samples for _, samples in a_chunks)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [] and a.token_times == []
    assert len(b.output_token_ids) == 3
    assert s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.process
def test_the_scheduler_path_imports_no_torch() -> None:
    """Every module of replicas/scheduling (the scheduler, the block manager, the pass-time model,
    the load figures) is what the simulator and the router reuse: none may load torch."""
    import subprocess
    import sys

    from pathlib import Path

    import replicas.scheduling
    names = sorted(p.stem for p in Path(replicas.scheduling.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert {"scheduler", "kv_cache", "pass_time", "admission"} <= set(names)
    code = ("import sys, replicas.request, " + ", ".join(f"replicas.scheduling.{n}" for n in names) + "; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
def test_a_short_prompt_behind_a_long_one_starts_at_once_and_no_budget_is_lost():
    s, clock = make("stall_free", mbp=16, mbt=512)
    long = req("long", 100, 2, clock)
    s.add(long)
    assert tokens(step(s)) == {"long": 16}  # alone: the whole budget
    short = req("short", 6, 5, clock)
    s.add(short)
    # The long prompt in progress leaves half the pass to the queue: the short one starts now,
    # and the 2 tokens it does not need go back to the long one.
    assert tokens(step(s)) == {"long": 10, "short": 6}
    assert tokens(step(s)) == {"short": 1, "long": 15}  # short decodes; nothing waits
    # A waiting request that cannot start (the running cap) leaves its share to the long prompt.
    s.config = s.config.replace(max_num_seqs=2)
    s.add(req("third", 4, 2, clock))
    assert tokens(step(s)) == {"short": 1, "long": 15}


@pytest.mark.unit
def test_only_whole_prompts_jump_ahead_of_one_in_progress():
    s, clock = make("stall_free", mbp=16, mbt=512)
    a, b = req("a", 40, 2, clock), req("b", 40, 2, clock)
    s.add(a)
    s.add(b)
    # b waits but does not fit whole in the queue's share: a takes the whole pass, twice.
    assert tokens(step(s)) == {"a": 16}
    assert tokens(step(s)) == {"a": 16}
    assert tokens(step(s)) == {"a": 8, "b": 8}  # a finishes: b starts as before, cut to fit
    c = req("c", 3, 2, clock)
    s.add(c)
    # b in progress takes its half first, c fits whole in the rest, the last 4 go back to b.
    assert tokens(step(s)) == {"a": 1, "b": 12, "c": 3}


@pytest.mark.unit
def test_the_load_record_is_built_once_from_the_counts_and_the_replicas_intake():
    """The engine publishes the scheduler's counts; the replica builds its ReplicaLoad from them in
    one call: prompts it accepted that the counts do not show yet count as waiting."""
    s, clock = make("stall_free", mbp=8)
    s.add(req("a", 6, 4, clock))
    s.add(req("b", 10, 4, clock))
    step(s)  # a's 6 prompt tokens (and its first token) and 2 of b's 10: both running
    counts = s.counts()
    assert (counts.running_tokens, counts.waiting_tokens, counts.num_running, counts.num_waiting) == (17, 0, 2, 0)
    load = counts.report(intake_tokens=30, intake_requests=2, queue_bound_tokens=100, drain_tps=5.0, prefill_tps=9.0)
    assert (load.running_tokens, load.waiting_tokens, load.num_running, load.num_waiting) == (17, 30, 2, 2)
    assert (load.queue_bound_tokens, load.drain_tps, load.prefill_tps) == (100, 5.0, 9.0)
    assert load.total_blocks == counts.total_blocks == 64 and load.free_blocks == counts.free_blocks < 64
    quiet = counts.report(intake_tokens=0)  # nothing accepted beyond what the scheduler shows
    assert (quiet.waiting_tokens, quiet.num_waiting, quiet.queue_bound_tokens) == (0, 0, None)
    assert s.load() == quiet  # the simulator's record: the counts alone
