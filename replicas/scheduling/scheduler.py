"""Iteration-level scheduler: one interface, three policies, the same token budgets.

Design note. There is no "prefill phase" or "decode phase", only how many tokens each
request still has to run through the model (`num_tokens_to_compute`): a decoding request
has one, a prefilling request has a prompt chunk. Every call to `schedule()` picks, for
the next single forward pass, which requests run and how many tokens each:

- stall_free (Sarathi-Serve): every running decode first, then prompt chunks of one or
  more requests in what is left of `max_batch_prefill_tokens` (the last chunk cut to fit).
  Invariant: a running request that is decoding is never skipped, unless it was preempted.
- dynamic (TGI): admit waiting requests whose whole prompt fits MBP and the KV cache and
  prefill them in a pass of their own; decodes wait for that pass (the generation stall).
- static: request-level batching. When nothing runs, admit a batch whose full
  prompt + max_tokens fit the KV cache, prefill it (MBP per pass), decode it until every
  member has finished, and only then admit again.

KV blocks are allocated as tokens are scheduled. When a decode needs a block and none is
free, the least urgent, latest running request is preempted (blocks freed, recomputed
later) instead of failing. With prefix caching, a request is admitted with the cached blocks
of its leading tokens (`BlockManager.cached_prefix`): only the tokens after them are charged,
against the prefill budget (compute) and the free blocks (KV memory), and only they run. Waiting requests are ordered by priority class (lower is more
urgent), aged so nothing starves, FCFS inside a class.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from replicas.config import EngineConfig
from replicas.scheduling.kv_cache import BlockManager
from replicas.protocol import ReplicaLoad
from replicas.request import Request, RequestStatus
from replicas.scheduling.batch import DecodeSeq, QueueCounts, ScheduledSeq, SchedulerOutput


# Under stall_free, while prompts wait to start, the prompts already prefilling leave this share
# of a pass's prompt budget to waiting prompts that fit in it whole (what they leave goes back).
QUEUE_SHARE = 0.5


def watermark_blocks(num_blocks: int, kv_watermark: float) -> int:
    """The KV blocks admission keeps free while requests run, so running decodes rarely preempt."""
    return max(1, int(num_blocks * kv_watermark))


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.perf_counter, *,
                 prefill_budget: Callable[[list[ScheduledSeq], Request, int], int] | None = None,
                 may_admit: Callable[[int, int, Request], bool] | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.clock = clock
        # Both queues stay sorted by `urgency` (most urgent first); see its docstring.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Kept as the queues change, so a load report is O(1): tokens still to compute of the
        # waiting requests, and tokens (prompt + output) of the running ones.
        self.num_waiting_tokens = 0
        self.num_running_tokens = 0
        # Keep a little KV headroom when admitting, so running decodes rarely preempt.
        self.watermark_blocks = watermark_blocks(block_manager.num_blocks, config.kv_watermark)
        # stall_free: the prefill tokens of a pass, given its decodes, the request whose chunk
        # comes next and the fixed budget's ceiling (the engine's SLO budget). None: the ceiling.
        self.prefill_budget = prefill_budget
        # Under stall_free, (running requests, their tokens, a waiting request) -> whether it may
        # start now (the engine's SLO admission). None: whenever KV and max_num_seqs allow.
        self.may_admit = may_admit

    # ---- queue management -------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._insert_waiting(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Evict a request that finished (or was aborted) and free its blocks; with a pass still
        in flight for it (the overlapped loop), its blocks are freed once that pass lands."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.num_running_tokens -= request.num_tokens
        elif not request.is_finished:
            self.waiting.remove(request)
            self.num_waiting_tokens -= request.num_tokens_to_compute
        request.status = status
        request.finish_time = self.clock()
        if not request.num_inflight:
            self.blocks.free(request.request_id)

    def advance(self, batch: SchedulerOutput, sampled: list[int], now: float) -> list[Request]:
        """The pass in `batch` ran: `launched`, then `landed` (the synchronous loop's one step)."""
        self.launched(batch)
        return self.landed(batch, sampled, now)

    def launched(self, batch: SchedulerOutput) -> None:
        """The pass in `batch` was handed to the device: every scheduled sequence advances by its
        tokens, and those that sample get a token in flight (`Request.num_inflight`), so the next
        `schedule()` sees them as the device will (their KV computed, one more token to run)."""
        for seq in batch.decodes:
            req = seq.request
            req.num_computed_tokens += 1
            req.num_inflight += 1
        num_sampled = len(batch.decodes)
        for seq in batch.prefills:
            req = seq.request
            req.num_computed_tokens += seq.num_tokens
            if seq.samples:
                req.num_inflight += 1
                num_sampled += 1
        self.num_running_tokens += num_sampled

    def landed(self, batch: SchedulerOutput, sampled: list[int], now: float) -> list[Request]:
        """The launched pass in `batch` finished: those that sample get their token (`sampled`, in
        batch order) stamped at `now`. A request that finished meanwhile (a stop found in the pass
        before, an abort) drops its token: never streamed, counted or cached.

        Returns the requests that got a token, and those whose prompt is now computed and that
        generate nothing (max_tokens 0, no token: they are done), in batch order; stop checks are
        the caller's (the engine checks stop strings and EOS, the simulator only max_tokens).
        """
        got: list[Request] = []
        tokens = iter(sampled)  # the decodes' first: zip takes one per decode and no more
        finished = RequestStatus.FINISHED_STOPPED
        caching, bs = self.blocks.enable_caching, self.blocks.block_size
        filled: list[ScheduledSeq] = []  # decodes whose token completed a block (prefix caching)
        for seq, token in zip(batch.decodes, tokens):
            req = seq.request
            req.num_inflight -= 1
            if req.status >= finished:
                self._dropped(req, seq)
                continue
            req.output_token_ids.append(token)
            req.token_times.append(now)
            got.append(req)
            if caching and (seq.start + 1) % bs == 0:
                filled.append(seq)
        for seq in batch.prefills:
            req = seq.request
            token = next(tokens) if seq.samples else None
            if seq.samples:
                req.num_inflight -= 1
            if req.status >= finished:
                self._dropped(req, seq)
                continue
            if token is not None:
                req.output_token_ids.append(token)
                req.token_times.append(now)
            if seq.completes:
                got.append(req)
        if caching:
            # Blocks join the prefix cache once the pass that wrote their KV has landed (a pass
            # that fails leaves nothing cached): a chunk's full blocks, and a decode's block when
            # its token filled it (its input may have been in flight).
            for seq in batch.prefills:
                if seq.request.status == RequestStatus.RUNNING:
                    self.blocks.cache_computed(seq.request, seq.start + seq.num_tokens)
            for seq in filled:
                if seq.request.status == RequestStatus.RUNNING:
                    self.blocks.cache_computed(seq.request, seq.start + 1)
        return got

    def abandon(self, batch: SchedulerOutput) -> None:
        """A launched pass failed: its tokens never land (the caller aborts its requests). Its
        in-flight counts go, and the finished requests that waited for it free their blocks (none
        of its blocks joined the prefix cache: they join when a pass lands)."""
        for seq in batch.seqs:
            req = seq.request
            if seq.samples:
                req.num_inflight -= 1
            if req.is_finished and not req.num_inflight:
                self.blocks.free(req.request_id)

    def _dropped(self, req: Request, seq: ScheduledSeq) -> None:
        """A finished request's pass landed: what it computed is undone (its logprobs entry, the
        KV position) and, with nothing more in flight, its blocks are freed."""
        if seq.samples and req.params.logprobs is not None and len(req.output_logprobs) > len(req.output_token_ids):
            req.output_logprobs.pop()
        req.num_computed_tokens = seq.start
        if not req.num_inflight:
            self.blocks.free(req.request_id)

    def counts(self) -> QueueCounts:
        """Queue and KV counts now, O(1)."""
        b = self.blocks
        return QueueCounts(self.num_running_tokens, self.num_waiting_tokens, len(self.running), len(self.waiting),
                           b.num_free, b.num_blocks, b.block_size, b.usage, b.hit_rate, b.num_cached)

    def load(self) -> ReplicaLoad:
        """A load record of the scheduler's counts alone (a replica reports `QueueCounts.report`
        with its intake and rates; the simulator's replicas report this)."""
        return self.counts().report()

    def _insert_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.urgency)
        self.num_waiting_tokens += request.num_tokens_to_compute

    def expire(self, now: float, drain_tps: float | None = None) -> list[Request]:
        """Finish the waiting requests that will not be scheduled within `queue_timeout_s` of
        arrival: those past the deadline, and, given the rate the queue drains (`drain_tps`,
        prompt tokens per second; None or 0: unknown), those whose predicted start (the tokens
        waiting ahead of them, drained at that rate) already lies past it. Refused now, not at
        the deadline: the answer is the same, and the client hears it seconds sooner.

        A preempted request (scheduled before, its client already has tokens) never expires, nor
        does another choice of a request whose choice 0 was scheduled (its stream has started).
        """
        timeout = self.config.queue_timeout_s
        if timeout is None or not self.waiting:
            return []
        expired = []
        ahead = 0  # tokens to compute of the requests before this one (most urgent first)
        for r in self.waiting:
            fresh = r.first_scheduled_time is None and (
                r.first_choice is None or r.first_choice.first_scheduled_time is None)
            if drain_tps is None or not ahead:
                start = now
            else:  # a stalled queue (0.0) starts no one behind its head
                start = now + ahead / drain_tps if drain_tps > 0 else float("inf")
            if fresh and start - r.arrival_time > timeout:
                expired.append(r)  # it leaves: the ones behind it do not wait for it
            else:
                ahead += r.num_tokens_to_compute
        for req in expired:
            self.finish(req, RequestStatus.FINISHED_QUEUE_TIMEOUT)
        return expired

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def urgency(self, request: Request) -> tuple[float, float]:
        """Sort key, smaller first: aged priority class, then arrival (FCFS).

        A request's aged class at time t is priority - (t - arrival) / aging_s. Every request
        ages at the same rate, so ordering by priority + arrival / aging_s is the same order
        at every t: the key never changes and the queues stay sorted without re-sorting.
        """
        return (request.priority + request.arrival_time / self.config.priority_aging_s,
                request.arrival_time)

    # ---- the decision ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        policy = self.config.policy
        if policy == "stall_free":
            self._schedule_stall_free(out)
        elif policy == "dynamic":
            self._schedule_dynamic(out)
        else:
            self._schedule_static(out)
        for seq in out.prefills:  # a decoding request was first scheduled for its prompt
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        return out

    def _schedule_stall_free(self, out: SchedulerOutput) -> None:
        self.schedule_prefills(out, self._schedule_decodes(out))

    def schedule_prefills(self, out: SchedulerOutput, prefilling: list[Request]) -> None:
        """Stall_free's prompt chunks after the pass's decodes (`out.decodes`, counted against
        the budget); `prefilling`: the running requests still prefilling, most urgent first.
        The simulator calls it directly when it plays the decodes in closed form."""
        budget = self.config.max_batch_prefill_tokens - len(out.decodes)
        if self.prefill_budget is not None and out.decodes and budget > 0:  # no decodes: no gap to protect
            nxt = prefilling[0] if prefilling else self.waiting[0] if self.waiting else None
            if nxt is not None:
                budget = self.prefill_budget(out.decodes, nxt, budget)
        # Prompts already started continue before new ones are admitted, leaving the running
        # decodes the same headroom admission keeps. While prompts wait, those in progress take
        # at most 1 - QUEUE_SHARE of the budget first: a waiting prompt that fits whole in the
        # rest prefills now instead of after a long prompt's last chunk. Only whole ones jump
        # ahead (no pile of half-done prompts), and what they leave goes back to the long one.
        reserve = self.watermark_blocks if out.decodes else 0
        shared = bool(self.waiting)  # the prompts in progress leave the queue its share
        held = budget - int(budget * QUEUE_SHARE) if shared else budget
        cut = False  # a prompt in progress does not finish this pass
        for req in prefilling:
            n = self._schedule_chunk(out, req, held, reserve=reserve) if held > 0 else 0
            held -= n
            budget -= n
            cut = cut or n < req.num_tokens_to_compute
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._waits_for_parent(req):
                break
            # A preempted request, or another choice of a started one, has a stream running.
            started = req.num_preemptions > 0 or req.first_choice is not None
            if not started and self.may_admit is not None and not self.may_admit(
                    len(self.running), self.num_running_tokens, req):
                out.head_held = True
                break
            prefix = self.blocks.cached_prefix(req)
            n = self._fit(req, budget, self.watermark_blocks if self.running else 0, prefix)
            if n <= 0 or (cut and n < req.num_tokens_to_compute - len(prefix) * self.blocks.block_size):
                break  # strict order: the most urgent request waits for room
            self._admit(req, prefix)
            budget -= self._schedule_chunk(out, req, n, reserve=0)
        if shared and budget > 0 and prefilling:  # what the queue did not take goes back to them
            self._extend_chunks(out, prefilling, budget, reserve)

    def _extend_chunks(self, out: SchedulerOutput, prefilling: list[Request], budget: int,
                       reserve: int) -> None:
        """Grow the chunks of prompts in progress (or give one to those without) by up to
        `budget` tokens in all, most urgent first."""
        index = {id(s.request): i for i, s in enumerate(out.prefills)}
        for req in prefilling:
            if budget <= 0:
                return
            i = index.get(id(req))
            if i is None:
                budget -= self._schedule_chunk(out, req, budget, reserve=reserve)
                continue
            seq = out.prefills[i]
            total = self._fit(req, seq.num_tokens + budget, reserve)
            if total > seq.num_tokens:
                ok = self.blocks.allocate(req.request_id, req.num_computed_tokens + total)
                assert ok, "a fitted chunk must allocate"
                out.prefills[i] = ScheduledSeq(req, seq.start, total)
                budget -= total - seq.num_tokens

    def _schedule_dynamic(self, out: SchedulerOutput) -> None:
        budget = self.config.max_batch_prefill_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._waits_for_parent(req):
                break
            prefix = self.blocks.cached_prefix(req)
            n = req.num_tokens_to_compute - len(prefix) * self.blocks.block_size
            # A recompute after preemption may exceed MBP; it is admitted in a pass of its own.
            alone_ok = not out.prefills and req.num_preemptions > 0
            reserve = self.watermark_blocks if self.running or out.prefills else 0
            if (n > budget and not alone_ok) or self._fit(req, n, reserve, prefix) < n:
                break
            self._admit(req, prefix)
            budget -= self._schedule_chunk(out, req, n, reserve=0)
        if out.prefills:  # the decodes wait for a pass of their own
            out.num_stalled = sum(1 for r in self.running if not r.is_prefilling)
        else:
            self._schedule_decodes(out)

    def _schedule_static(self, out: SchedulerOutput) -> None:
        if not self.running:
            # Reserve each member's whole prompt + max_tokens up front, as padded static
            # batches do, so a static batch never preempts.
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                total = max(req.max_total_tokens, req.num_tokens)
                prefix = self.blocks.cached_prefix(req)
                if not self.blocks.can_allocate(req.request_id, total, prefix=prefix):
                    break
                self._admit(req, prefix)
                self.blocks.allocate(req.request_id, total)
        prefilling = [r for r in self.running if r.is_prefilling]
        if prefilling:  # members already decoding wait for the batch's prompts
            out.num_stalled = len(self.running) - len(prefilling)
            budget = self.config.max_batch_prefill_tokens
            for req in prefilling:
                if budget <= 0:
                    break
                budget -= self._schedule_chunk(out, req, budget, reserve=0)
        else:
            self._schedule_decodes(out)

    # ---- helpers ---------------------------------------------------------------------

    def _schedule_decodes(self, out: SchedulerOutput) -> list[Request]:
        """One token for every decoding request, most urgent first; preempt on KV shortage.

        Returns the running requests that are still prefilling, most urgent first.
        """
        running, allocate, decodes = self.running, self.blocks.allocate, out.decodes
        bs = self.blocks.block_size
        new, seq_cls = object.__new__, DecodeSeq
        prefilling: list[Request] = []
        # A preemption removes the tail of `running`, which this walk has not reached (or the
        # request it is at, the last one): the iterator simply stops sooner.
        for req in running:  # per running request per pass: `is_prefilling` inlined
            inflight = req.num_inflight
            n_out = len(req.output_token_ids) + inflight
            num_tokens = len(req.prompt_token_ids) + n_out
            computed = req.num_computed_tokens
            if not n_out or num_tokens - computed > 1:
                prefilling.append(req)
                continue
            if inflight and n_out >= req.max_output:
                continue  # its last token is in flight: it finishes when that pass lands
            # Its table covers the `computed` tokens whose KV is written: the token at `computed`
            # needs a block only when it begins one (once a block_size passes).
            if computed % bs == 0 and num_tokens > computed:
                while not allocate(req.request_id, num_tokens):
                    victim = running[-1]  # least urgent, latest; never one already scheduled
                    self._preempt(victim, out)
                    if victim is req:
                        break
                else:
                    decodes.append(ScheduledSeq.decode(req, computed))
                continue
            seq = new(seq_cls)  # `ScheduledSeq.decode` inlined
            seq.request, seq.start = req, computed
            decodes.append(seq)
        if out.preempted:  # a preempted request left `running`
            prefilling = [r for r in prefilling if r.status == RequestStatus.RUNNING]
        return prefilling

    def _schedule_chunk(self, out: SchedulerOutput, req: Request, limit: int, reserve: int) -> int:
        """Schedule up to `limit` of the request's remaining tokens as one chunk."""
        n = self._fit(req, limit, reserve)
        if n <= 0:
            return 0
        ok = self.blocks.allocate(req.request_id, req.num_computed_tokens + n)
        assert ok, "a fitted chunk must allocate"
        out.prefills.append(ScheduledSeq(req, req.num_computed_tokens, n))
        return n

    def _fit(self, req: Request, limit: int, reserve: int, prefix: list[int] | None = None) -> int:
        """Largest chunk <= limit whose KV fits in the free blocks minus `reserve`. `prefix`: the
        cached blocks a waiting request would be admitted with (they are not charged; the idle
        ones among them leave the free pool)."""
        bs, blocks = self.blocks.block_size, self.blocks
        if prefix:
            have = computed = len(prefix) * bs
            free = blocks.num_free - blocks.num_idle(prefix)
        else:
            have, computed = len(blocks.block_table(req.request_id)) * bs, req.num_computed_tokens
            free = blocks.num_free
        room = have + max(0, free - reserve) * bs - computed
        return max(0, min(limit, req.num_tokens - computed, room))

    def _waits_for_parent(self, req: Request) -> bool:
        """A forked sample waits while the first sample of its prompt prefills (running), then
        finds the prompt's blocks cached. It does not wait for a parent that is itself waiting
        (preempted, it may queue behind its forks), nor when nothing would be shared (caching
        off, prompt logprobs); static batches do not wait: each member computes its own.
        A request preempted while a pass of it was in flight waits for that pass to land (its
        token is part of what it recomputes)."""
        if req.num_inflight:
            return True
        parent = req.forked_from
        return (parent is not None and self.blocks.enable_caching and parent.status == RequestStatus.RUNNING
                and not parent.output_token_ids and req.params.prompt_logprobs is None)

    def _admit(self, req: Request, prefix: list[int]) -> None:
        """Waiting -> running, with the cached blocks of its prefix (they count as computed)."""
        self.waiting.remove(req)
        self.num_waiting_tokens -= req.num_tokens_to_compute
        hit = len(prefix) * self.blocks.block_size
        if req.num_preemptions == 0:  # the client's prompt, once (a recompute is not a query)
            self.blocks.count_lookup(req.num_prompt_tokens, hit)
        if prefix:
            ok = self.blocks.allocate(req.request_id, hit, prefix)
            assert ok, "a fitted prefix must allocate"
            req.num_computed_tokens = hit
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit
        bisect.insort(self.running, req, key=self.urgency)
        self.num_running_tokens += req.num_tokens
        req.status = RequestStatus.RUNNING

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_running_tokens -= req.num_tokens
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._insert_waiting(req)
        out.preempted.append(req)
        out.prefills = [s for s in out.prefills if s.request is not req]
