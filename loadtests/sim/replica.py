"""One simulated replica: the engine's real Scheduler and BlockManager, a cost model for the pass.

`start_iteration` is the engine's `schedule()` call; instead of running the model, the cost model
says how long the pass takes. `finish_iteration` is the engine's postprocess at the pass's end
time, through the same `Scheduler.advance` the engine uses: every scheduled sequence advances by
its tokens, those that sample get one output token stamped at that time, and a request that
reached max_tokens finishes with FINISHED_LENGTH (ignore_eos: the simulator has no token
values). Its latencies are read off its token times when it finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoscale.load import LogHistogram, ReplicaLoad, TbtWindow
from loadtests.sim.costmodel import CostModel, batch_features
from loadtests.sim.decode_run import DecodeSet, count_gaps
from loadtests.sim.metrics import Recorder
from replicas.config import EngineConfig
from replicas.scheduling.kv_cache import BlockManager
from replicas.scheduling.pass_time import PassShape, PassTimeModel, SloBudget, seed_shapes, slo_hooks
from replicas.protocol import InvalidRequestError, Limits
from replicas.request import Request, RequestStatus
from replicas.scheduling.batch import ScheduledSeq, SchedulerOutput
from replicas.scheduling.scheduler import Scheduler

FINISHED = RequestStatus.FINISHED_LENGTH
# `SimReplica.batch` while a pass of the `DecodeSet` is in flight (its decodes are the set's,
# its prompt chunks `SimReplica.set_prefills`, a prefill-only SchedulerOutput).
DECODE_SET_PASS = SchedulerOutput()


class SimClock:
    """The simulated time every replica's scheduler reads (priority aging, timestamps)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of a deployment runs: engine budgets, KV size, the pass's cost."""

    engine: EngineConfig
    num_blocks: int
    cost: CostModel
    max_model_len: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.engine.block_size

    @property
    def devices(self) -> int:
        """GPUs one replica holds (its tensor-parallel ranks): what the fleet costs per replica."""
        return self.engine.tensor_parallel_size

    @property
    def limits(self) -> Limits:
        """The engine's request limits for this replica (`Engine.limits`)."""
        return Limits(self.max_model_len, self.kv_capacity_tokens,
                      self.engine.max_batch_prefill_tokens, self.engine.policy)

    def rejects(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why the engine would refuse this request (None: accepted): the field the refusal
        names ("max_tokens": over the context or KV capacity; "prompt": over dynamic's MBP)."""
        try:
            self.limits.check(prompt_len, max_tokens)
        except InvalidRequestError as exc:
            return exc.param or "invalid"
        return None


def profile_passes(cost: CostModel, ceiling: int) -> list[tuple[PassShape, float]]:
    """The engine's start-up profile (`pass_time.seed_shapes`), timed by the cost model: each
    shape's prefill pass and two decode passes."""
    out = []
    for n, k in seed_shapes(ceiling):
        pairs = k * n * (n + 1) // 2
        out.append((PassShape(n * k, 0, k, n * k, pairs), cost.iteration_time(n * k, 0, n * k, k, pairs, 0)))
        for step in (1, 2):
            ctx = k * (n + step)
            out.append((PassShape(0, k, k, ctx, ctx), cost.iteration_time(0, k, ctx, k, ctx, k * (n + step))))
    return out


class SimReplica:
    """A replica's scheduler state plus the simulator's bookkeeping around it."""

    def __init__(self, replica_id: str, spec: ReplicaSpec, clock: SimClock, recorder: Recorder,
                 on_finish: Callable[[SimReplica, Request, float], None], tbt_window: TbtWindow | None = None,
                 log_iterations: bool = False, decode_runs: bool = True) -> None:
        self.replica_id = replica_id
        self.spec = spec
        self.blocks = BlockManager(spec.num_blocks, spec.engine.block_size, spec.engine.enable_prefix_caching)
        self.scheduler = Scheduler(spec.engine, self.blocks, clock)
        self.cost = spec.cost
        # What the engine's pass-time model reports: the marginal cost of a prompt token.
        per_token = spec.cost.per_prefill_token_s + spec.cost.per_kv_token_s
        self.prefill_tps = 1.0 / per_token if per_token > 0 else 0.0
        # With a TBT SLO, the engine's own SLO budget: its pass-time model learns this replica's
        # cost model online from a start-up profile and every pass, as it learns a real machine.
        self.pass_time: PassTimeModel | None = None
        self.slo_budget: SloBudget | None = None
        cfg = spec.engine
        if cfg.tbt_slo_ms is not None and cfg.policy == "stall_free" and cfg.slo_budget:
            self.pass_time = PassTimeModel(error_floor_s=cfg.slo_pass_target_s)
            for shape, seconds in profile_passes(spec.cost, cfg.max_batch_prefill_tokens):
                self.pass_time.observe(shape, seconds)
            self.pass_time.freeze_seed()
            self.slo_budget, self.scheduler.may_admit = slo_hooks(cfg, self.pass_time, self.blocks,
                                                                  self.scheduler.watermark_blocks)
            self.scheduler.prefill_budget = self.slo_budget
        self.rec = recorder
        self.on_finish = on_finish
        self.batch: SchedulerOutput | None = None  # the pass in flight
        # The decoding requests in closed form (`DecodeSet`); off: every pass through schedule().
        # Not with prefix caching: a decode that fills a block registers it in the cache.
        self.decode_runs = decode_runs and not spec.engine.enable_prefix_caching
        # The set plays passes with prompt chunks too under stall_free without the SLO hooks
        # (they read the decodes); otherwise only passes that decode and nothing else.
        self.hybrid = (cfg.policy == "stall_free" and self.scheduler.prefill_budget is None
                       and self.scheduler.may_admit is None)
        self.decodes: DecodeSet | None = None
        self.set_prefills: SchedulerOutput | None = None  # the chunks of the set's pass in flight
        self.prompt_left = False  # the last full pass cut a prompt: some running request prefills
        self.num_requests = 0  # routed here and not finished (Serve's ongoing requests)
        self.num_iterations = 0
        self.num_run_passes = 0  # of them, passes the decode set played
        self.busy_s = 0.0
        self.last_report: ReplicaLoad | None = None
        self.last_report_t = float("-inf")
        self.last_report_tokens = 0
        # TBT gaps for the scaling decision: pending until the next report, then added to the
        # fleet's window as the controller adds them to the deployment's (autoscale.load.TbtWindow:
        # histograms in 1 s slices; one window for the fleet, shared by its replicas).
        self.window = tbt_window
        self.pending_tbt: LogHistogram | None = LogHistogram() if tbt_window is not None else None
        self.log: list[tuple[float, float, int, int, int, int]] | None = [] if log_iterations else None
        self.draining = False
        self.start_t = 0.0
        self.ready_t = 0.0
        self.stop_t: float | None = None

    @property
    def busy(self) -> bool:
        return self.batch is not None

    def add(self, req: Request) -> None:
        self.scheduler.add(req)
        self.num_requests += 1

    # ---- one pass -------------------------------------------------------------------------------

    def start_iteration(self, now: float) -> float | None:
        """Schedule the next pass at `now`; returns when it ends (None: nothing to run)."""
        if self.slo_budget is not None:
            self.slo_budget.reset()
        ds = self.decodes
        if ds is not None and self.hybrid:  # the set plays every pass it can: the common case
            started = ds.start_pass()
        else:
            started = self._decode_set_pass() if self.decode_runs else None
        if started is not None:
            prefills, f = started
            if prefills:  # the chunks' features added to the decodes' (as batch_features counts them)
                chunks = SchedulerOutput(prefills=prefills)
                p, d, c, s, a, x = batch_features(chunks)
                f = (f[0] + p, f[1] + d, f[2] + c, f[3] + s, f[4] + a, f[5] + x)
            elif not f[1]:
                return None
            else:
                chunks = None
            batch = DECODE_SET_PASS
            self.set_prefills = chunks
            self.num_run_passes += 1
        else:
            self.sync()
            batch = self.scheduler.schedule()
            if not batch.decodes and not batch.prefills:
                return None
            f = batch_features(batch)
        dur = self.cost.iteration_time(*f)
        if self.pass_time is not None:
            shape = PassShape(f[0], f[1], f[3], f[2], f[4])
            self.pass_time.observe(shape, dur, self.pass_time.predict(shape))
        if self.log is not None:
            self.log.append((now, dur, f[0], f[1], f[2], f[3]))
        self.batch = batch
        self.num_iterations += 1
        self.busy_s += dur
        return now + dur

    def _decode_set_pass(self) -> tuple[list[ScheduledSeq], tuple[int, ...]] | None:
        """Start the next pass with the decode set (its chunks and decode features), or None:
        schedule() runs it."""
        sch, ds = self.scheduler, self.decodes
        decode_only = not self.hybrid  # this policy's prompts stop the decodes: the set only plays pure decode passes
        if ds is None:
            if decode_only and (not sch.running or sch.waiting or self.prompt_left):
                return None
            ds = DecodeSet(sch)
            if decode_only and ds.prefilling:
                return None
            self.decodes = ds
        elif decode_only and (sch.waiting or ds.prefilling):
            return None
        return ds.start_pass()

    def sync(self) -> None:
        """Dissolve the decode set, if any: every request in it is brought up to date."""
        if self.decodes is not None:
            self.decodes.apply_all()
            self.decodes = None

    def finish_iteration(self, now: float) -> None:
        """The engine's postprocess at the pass's end time `now`."""
        batch, self.batch = self.batch, None
        sch = self.scheduler
        if batch is DECODE_SET_PASS:
            ds, chunks = self.decodes, self.set_prefills
            got = sch.advance(chunks, [0] * sum(1 for q in chunks.prefills if q.samples), now) if chunks else None
            sch.num_running_tokens += len(ds.members)  # every member decoded a token
            for req in ds.end_pass(now, self.pending_tbt):  # members that got their last token
                sch.finish(req, FINISHED)
                self._finished(req, now)
            if got is None:
                return
            for req in self._postprocess(got, now):  # prompts completed: they decode from now on
                ds.prefilling.remove(req)
                if req.status == RequestStatus.RUNNING:
                    ds.join(req)
            for seq in chunks.prefills:  # a recomputed (preempted) request left its last token: it decodes it
                if not seq.completes and not seq.request.is_prefilling:
                    ds.prefilling.remove(seq.request)
                    ds.join(seq.request)
            return
        # A prompt cut by this pass is still prefilling: the next pass cannot start a decode set
        # (unless the set plays prompts too).
        self.prompt_left = any(not s.completes for s in batch.prefills)
        sampled = [0] * sum(1 for s in batch.seqs if s.samples)  # no token values in a simulation
        self._postprocess(sch.advance(batch, sampled, now), now)

    def _postprocess(self, got: list[Request], now: float) -> list[Request]:
        """Stamp the requests that got a token at `now` (first token, TBT gap), finish those at
        max_tokens; returns `got`."""
        rec, pending = self.rec, self.pending_tbt
        gaps: list[float] = []
        for req in got:
            times = req.token_times
            if len(times) == 1:  # first token
                i = int(req.request_id)
                rec.ttft[i] = now - req.arrival_time
                rec.sched_delay[i] = delay = req.first_scheduled_time - req.arrival_time
                if delay > rec.late_start_s:
                    rec.num_late_start += 1
            elif pending is not None:  # the scaler's TBT window wants gaps as they happen
                gaps.append(now - times[-2])
            if len(req.output_token_ids) >= req.params.max_tokens:
                self.scheduler.finish(req, FINISHED)
                self._finished(req, now)
        if gaps:
            count_gaps(pending, gaps)
        return got

    def _finished(self, req: Request, now: float) -> None:
        rec = self.rec
        i = int(req.request_id)
        times = req.token_times
        n = len(times)
        rec.e2e[i] = now - req.arrival_time
        if n > 1:
            t = np.array(times, dtype=np.float64)  # the dtype given: no pass to find it
            gaps = t[1:] - t[:-1]
            rec.add_gaps(gaps)
            rec.max_gap[i] = float(gaps.max())
            rec.mean_gap[i] = (times[-1] - times[0]) / (n - 1)  # TPOT
        rec.preemptions[i] = req.num_preemptions
        rec.num_finished += 1
        rec.output_tokens += n
        rec.prompt_tokens += req.num_prompt_tokens
        if now > rec.last_finish:
            rec.last_finish = now
        self.num_requests -= 1
        self.on_finish(self, req, now)

    # ---- load reports -------------------------------------------------------------------------

    def report(self, now: float) -> ReplicaLoad:
        """The load report a replica pushes: its scheduler's load (as in the engine), with the
        histogram of the TBT gaps new since the last report."""
        tbt: LogHistogram | None = None
        if self.pending_tbt is not None:
            tbt, self.pending_tbt = self.pending_tbt, LogHistogram()
            self.window.add(tbt, now)
        load = self.scheduler.counts().report(prefill_tps=self.prefill_tps)
        # A fresh record no one holds yet, completed in place as the reporter completes its copy
        # (`dataclasses.replace` would build it a second time).
        object.__setattr__(load, "replica_id", self.replica_id)
        object.__setattr__(load, "tbt_histogram", tbt or None)
        object.__setattr__(load, "timestamp", now)
        self.last_report, self.last_report_t = load, now
        self.last_report_tokens = load.token_load
        return load
