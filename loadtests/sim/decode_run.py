"""Decode-only passes in closed form: what `schedule()` + `advance()` would do, at O(1) a pass.

While a replica has no waiting request and every running request is decoding, the scheduler's
next pass is fully determined: every running request decodes one token, in the same order, and
the batch changes only when something new arrives, a request finishes, or the KV cache runs out
(preemption). A `DecodeRun` plays those passes without touching the requests: each pass's
features follow from the run's start (context grows by the batch size a pass, the longest
sequence by one), the KV blocks are allocated at the very passes and in the very order the
scheduler would allocate them (a request crosses a block boundary every `block_size` passes),
and the running-token count the load report reads is kept. The requests' own state (tokens,
token times, computed tokens) is brought up to date in one go by `apply()`, with list copies.

A pass may run this way only if no request reaches max_tokens at its end and its new blocks
are free; otherwise the simulator applies the run and calls the real scheduler for that pass.
The results equal the pass-by-pass simulation exactly (tests/loadtests/test_sim_decode_run.py).
"""

from __future__ import annotations

from replicas.histogram import LogHistogram, bin_index
from replicas.kv_cache import BlockManager
from replicas.request import Request


class DecodeRun:
    """Passes that decode exactly `reqs` (the scheduler's running list, in its order)."""

    __slots__ = ("reqs", "blocks", "num_seqs", "passes", "ends", "last_end", "prev", "context0", "max_start0",
                 "left", "buckets")

    def __init__(self, reqs: list[Request], blocks: BlockManager) -> None:
        self.reqs = list(reqs)
        self.blocks = blocks
        self.num_seqs = n = len(reqs)
        self.passes = 0  # passes started in this run
        self.ends: list[float] = []  # end times of the passes done and not yet applied to `reqs`
        self.last_end: float | None = None  # end of the run's latest pass done
        self.prev = [r.token_times[-1] for r in reqs]  # each request's last token before the run
        starts = [r.num_computed_tokens for r in reqs]
        self.context0 = sum(starts) + n  # batch_features' context at the run's first pass
        self.max_start0 = max(starts)
        # Passes until the first request gets its last token (that pass is not the run's).
        self.left = min(r.params.max_tokens - len(r.output_token_ids) for r in reqs)
        # Pass j allocates (as `_schedule_decodes` does) a block for each request whose table no
        # longer covers its tokens: request i first at pass j0 = table capacity - tokens + 1,
        # then every block_size passes. Buckets by j0 mod block_size, each in running order.
        bs = blocks.block_size
        self.buckets: list[list[tuple[int, str, int]]] = [[] for _ in range(bs)]
        for r in reqs:
            tokens = r.num_tokens
            j0 = len(blocks.block_table(r.request_id)) * bs - tokens + 1
            assert j0 >= 0, "a decoding request's computed tokens have their blocks"
            if j0 < self.left:
                self.buckets[j0 % bs].append((j0, r.request_id, tokens))

    def start_pass(self) -> tuple[int, int, int, int, int, int] | None:
        """Start the next pass if it is a pure decode pass that finishes no one and whose new
        blocks are free: allocate them and return its features (as `batch_features`); else None."""
        j = self.passes
        if j + 1 >= self.left:
            return None
        bucket = self.buckets[j % len(self.buckets)]
        if bucket:
            due = [(rid, tokens) for j0, rid, tokens in bucket if j0 <= j]
            if len(due) > self.blocks.num_free:
                return None  # the scheduler would preempt
            allocate = self.blocks.allocate
            for rid, tokens in due:
                allocate(rid, tokens + j)
        self.passes = j + 1
        n = self.num_seqs
        context = self.context0 + n * j
        return 0, n, context, n, context, n * (self.max_start0 + j + 1)

    def end_pass(self, now: float, gaps: LogHistogram | None) -> None:
        """The pass ended at `now`; its TBT gaps (one per request) are counted in `gaps`."""
        if gaps is not None:
            if self.last_end is None:
                gaps.add_many([now - p for p in self.prev])
            else:  # every request's previous token came at the previous pass's end
                b = bin_index(now - self.last_end)
                gaps.counts[b] = gaps.counts.get(b, 0) + self.num_seqs
                gaps.count += self.num_seqs
        self.ends.append(now)
        self.last_end = now

    def apply(self) -> None:
        """Bring every request up to date with the passes done: what `Scheduler.advance` did."""
        ends = self.ends
        m = len(ends)
        if not m:
            return
        zeros = [0] * m  # no token values in a simulation
        for r in self.reqs:
            r.num_computed_tokens += m
            r.output_token_ids += zeros
            r.token_times += ends
        self.ends = []
