"""A replica's decoding requests in closed form: what `schedule()` + `advance()` do to them, at
O(1) a pass instead of O(batch).

Every pass decodes one token of every running request that is decoding (stall_free never skips
one; dynamic and static only in a pass without prompts), so those requests need no per-pass
work until one of them finishes: a `DecodeSet` holds them and plays their side of each pass from
aggregates. The pass's decode features follow from sums kept as requests join and leave
(context grows by the set's size a pass, the longest sequence by one); KV blocks are allocated
at the very passes and in the very order `_schedule_decodes` allocates them (a request crosses a
block boundary every `block_size` passes); the running-token count a load report reads is kept;
the TBT gaps of a pass are one value for every request that decoded in the previous pass too.
A request's own state (tokens, token times, computed tokens) is brought up to date with list
copies when it leaves the set: when it finishes, or when the set dissolves.

Prompts stay with the real scheduler: under stall_free (without the SLO hooks, which read the
decodes themselves) `Scheduler.schedule_prefills` picks the pass's chunks after the set's
decodes, exactly as `schedule()` would, and a request whose prompt completes joins the set.
The set dissolves (every request applied) where the scheduler would preempt, and, for the
other policies, whenever a prompt is waiting or prefilling; `schedule()` then runs that pass.
The results equal the pass-by-pass simulation exactly (tests/loadtests/test_sim_decode_run.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from replicas.scheduling.histogram import LogHistogram, bin_index
from replicas.request import Request
from replicas.scheduling.batch import SchedulerOutput
from replicas.scheduling.scheduler import Scheduler

TRIM_PASSES = 1024  # pass end times kept before every member is brought up to date


class Member:
    """A request in the set: up to date as of pass `base`; at pass j its computed tokens are
    `start + j` and its tokens `start + 1 + j`; it needs its first new block at pass
    `next_block`, then one every `block_size` passes."""

    __slots__ = ("req", "rid", "key", "base", "start", "next_block", "finish")

    def __init__(self, req: Request, key: tuple[float, float], base: int, next_block: int) -> None:
        self.req, self.rid, self.key, self.base = req, req.request_id, key, base
        self.start = req.num_computed_tokens - base
        self.next_block = next_block
        self.finish = base + req.params.max_tokens - len(req.output_token_ids) - 1  # its last token's pass


class DecodeSet:
    """The running requests that decode; `prefilling` holds the other running ones, in order."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.sch, self.blocks = scheduler, scheduler.blocks
        self.bs = scheduler.blocks.block_size
        self.members: dict[str, Member] = {}
        self.passes = 0  # index of the next pass
        self.ends: list[float] = []  # end time of each pass from `ends_base` on
        self.ends_base = 0
        self.last_end: float | None = None
        self.context = 0  # sum of the members' computed tokens before the next pass
        self.max_start: int | None = None  # max of the members' `start`
        # The members that take a block at every pass j with j % bs == k, in running order (and
        # their request ids, for the block manager); a member waits in `first_block` until its
        # first such pass.
        self.buckets: list[list[Member]] = [[] for _ in range(self.bs)]
        self.bucket_ids: list[list[str]] = [[] for _ in range(self.bs)]
        self.first_block: dict[int, list[Member]] = {}
        self.finishing: dict[int, list[Member]] = {}  # pass -> members that get their last token then
        self.joined: list[Member] = []  # members whose first pass in the set is the next one
        self.prefilling: list[Request] = []
        for req in scheduler.running:
            if req.is_prefilling:
                self.prefilling.append(req)
            else:
                self.join(req)

    @property
    def size(self) -> int:
        return len(self.members)

    # ---- membership ---------------------------------------------------------------------------

    def join(self, req: Request) -> None:
        """A running request that decodes (up to date now) joins before the next pass."""
        j = self.passes
        table = len(self.blocks.block_table(req.request_id))
        m = Member(req, self.sch.urgency(req), j, table * self.bs - req.num_tokens + 1 + j)
        assert m.next_block >= j, "a decoding request's computed tokens have their blocks"
        self.members[req.request_id] = m
        self.context += req.num_computed_tokens
        if self.max_start is None or m.start > self.max_start:
            self.max_start = m.start
        self.first_block.setdefault(m.next_block, []).append(m)
        bisect.insort(self.finishing.setdefault(m.finish, []), m, key=_key)
        self.joined.append(m)

    def _leave(self, m: Member) -> None:
        """`m` (up to date) leaves the set."""
        del self.members[m.req.request_id]
        self.context -= m.req.num_computed_tokens
        if m.next_block >= self.passes:  # its first block is still ahead
            self.first_block[m.next_block].remove(m)
        else:
            k = m.next_block % self.bs
            i = self.buckets[k].index(m)
            del self.buckets[k][i], self.bucket_ids[k][i]
        if m.start == self.max_start:
            self.max_start = max((x.start for x in self.members.values()), default=None)

    def _apply(self, m: Member) -> None:
        """Bring `m`'s request up to date with the passes done: what `Scheduler.advance` did."""
        k = self.passes - m.base
        if k:
            req = m.req
            req.num_computed_tokens += k
            req.output_token_ids += [0] * k  # no token values in a simulation
            req.token_times += self.ends[m.base - self.ends_base:]
            m.base = self.passes

    def apply_all(self) -> None:
        for m in self.members.values():
            self._apply(m)
        self.ends, self.ends_base = [], self.passes

    # ---- one pass -----------------------------------------------------------------------------

    def start_pass(self) -> tuple[list, tuple[int, int, int, int, int, int]] | None:
        """Allocate the pass's decode blocks and, under stall_free, let the scheduler pick its
        prompt chunks; returns (the chunks, the decode features (P, D, C, S, A, X) as
        `batch_features` counts them), or None where the scheduler would preempt."""
        j = self.passes
        k = j % self.bs
        first = self.first_block.pop(j, None)
        if first:  # from now on in their bucket (a set the scheduler would preempt is dropped whole)
            bucket, ids = self.buckets[k], self.bucket_ids[k]
            for m in first:
                i = bisect.bisect_right(bucket, m.key, key=_key)
                bucket.insert(i, m)
                ids.insert(i, m.rid)
        # Every member of the bucket crosses a block boundary this pass: a block each, in running order.
        ids = self.bucket_ids[k]
        if ids and not self.blocks.append_blocks(ids):
            return None
        n = len(self.members)
        prefills: list = []
        sch = self.sch
        if self.prefilling or sch.waiting:
            out = SchedulerOutput(decodes=[None] * n)  # only counted: the budget, the KV reserve
            sch.schedule_prefills(out, self.prefilling)
            prefills = out.prefills
            now = sch.clock()
            for seq in prefills:
                req = seq.request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                if seq.start == 0:  # admitted by this pass
                    bisect.insort(self.prefilling, req, key=sch.urgency)
        context = self.context + n
        padded = n * (self.max_start + j + 1) if n else 0
        return prefills, (0, n, context, n, context, padded)

    def end_pass(self, now: float, gaps: LogHistogram | None) -> list[Request]:
        """The pass ended at `now`: every member got a token (its gap counted in `gaps`); returns
        the requests that got their last one, up to date and out of the set, in running order."""
        n = len(self.members)
        if gaps is not None and n:
            same = n
            if self.joined:
                count_gaps(gaps, [now - m.req.token_times[-1] for m in self.joined])
                same -= len(self.joined)
                self.joined = []
            if same:  # every other member's previous token came at the previous pass
                b = bin_index(now - self.last_end)
                counts = gaps.counts
                counts[b] = counts.get(b, 0) + same
                gaps.count += same
        elif self.joined:
            self.joined = []
        self.ends.append(now)
        self.last_end = now
        self.context += n
        self.passes += 1
        done = self.finishing.pop(self.passes - 1, None)
        if done:
            for m in done:
                self._apply(m)
                self._leave(m)
        if len(self.ends) > TRIM_PASSES:
            self.apply_all()
        return [m.req for m in done] if done else []


def _key(m: Member) -> tuple[float, float]:
    return m.key


def count_gaps(hist: LogHistogram, gaps: Sequence[float], times: int = 1) -> None:
    """Count each of `gaps` `times` times in `hist`, binning each run of equal values once (the
    gaps of one pass are mostly one value: every decode's previous token came at the last pass)."""
    counts = hist.counts
    last, b = None, 0
    for g in gaps:
        if g != last:
            last, b = g, bin_index(g)
        counts[b] = counts.get(b, 0) + times
    hist.count += len(gaps) * times
