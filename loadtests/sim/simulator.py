"""Discrete-event cluster simulator around the real scheduler, router and scaling decision.

Events, in time order: request arrivals (from the trace), "pass ends on replica r" (from the cost
model), "replica r is ready" (start-up delay), scaling ticks and stop checks. A replica runs
`schedule()` only when it has work: at the end of each pass, or when a request reaches an idle
replica. Routing happens at arrival over the ready, non-draining replicas. After a pass a replica
reports its load when the LoadReporter would (`autoscale.load.ReportThrottle`: every 100 ms, or
sooner after a jump of max(256 tokens, 25%)), and once more when it goes idle.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from autoscale.demand import DemandLog
from autoscale.load import ReplicaLoad, ReportThrottle, TbtWindow
from autoscale.routing import RequestCost
from autoscale.scaling import ScalingConfig
from loadtests.sim.metrics import Recorder
from loadtests.sim.replica import ReplicaSpec, SimClock, SimReplica
from loadtests.sim.routers import Router, make_router
from loadtests.sim.scaler import Autoscaler
from loadtests.sim.traffic import Trace
from replicas.scheduling.admission import admits, queue_bound
from replicas.config import ReplicaOptions
from replicas.request import Request, SamplingParams

ITER_END, READY, SCALE, CHECK, REPORT = 0, 1, 2, 3, 4
INF = math.inf


@dataclass(frozen=True)
class SimConfig:
    spec: ReplicaSpec
    num_replicas: int = 1  # at start (the autoscaler may change it)
    router: str = "token_load"
    tbt_slo_s: float = 0.1
    ttft_slo_s: float = 2.0
    report: ReportThrottle = ReportThrottle()  # the LoadReporter's rule and defaults
    scaling: ScalingConfig | None = None
    scaling_interval_s: float = 1.0
    startup_s: float = 60.0
    seed: int = 0
    log_iterations: bool = False
    # Decode-only passes in closed form (`decode_run.DecodeRun`); False: every pass through
    # schedule() and advance(), the reference the closed form must equal exactly.
    decode_runs: bool = True
    # Load shedding as a replica does it (`replicas.scheduling.admission`): with `shed`, a prompt the chosen
    # replica's queue bound cannot take (max_queued_tokens, and what the replica prefills within
    # queue_timeout_s at its modelled prompt rate; None: no deadline) is refused at arrival.
    shed: bool = False
    queue_timeout_s: float | None = None
    max_queued_tokens: int = ReplicaOptions().max_queued_tokens
    # Seconds from a replica's report to its router seeing it: production's path (a node relay's
    # flush, a hub's at fleet size, the shared routing view, the router's refresh) is up to
    # ~0.3 s. 0: at once.
    report_delay_s: float = 0.0

    def describe(self) -> dict[str, Any]:
        e = self.spec.engine
        d = {"policy": e.policy, "max_batch_prefill_tokens": e.max_batch_prefill_tokens,
             "kv_capacity_tokens": self.spec.kv_capacity_tokens, "max_num_seqs": e.max_num_seqs,
             "block_size": e.block_size, "cost_model": self.spec.cost.name, "num_replicas": self.num_replicas,
             "router": self.router, "tbt_slo_s": self.tbt_slo_s, "ttft_slo_s": self.ttft_slo_s,
             "startup_s": self.startup_s, "seed": self.seed, "shed": self.shed,
             "queue_timeout_s": self.queue_timeout_s, "max_queued_tokens": self.max_queued_tokens,
             "report_delay_s": self.report_delay_s, "devices_per_replica": self.spec.devices}
        if self.scaling is not None:
            d["scaling"] = self.scaling.to_dict()
        return d


@dataclass
class SimResult:
    summary: dict[str, Any]
    config: dict[str, Any]
    trace: dict[str, Any]
    wall_s: float
    stopped: str | None = None  # why the run was cut short (a stop predicate fired)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    scaling: list[tuple[float, int, int, int, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Simulator:
    """Runs one trace through a cluster of `SimReplica`s."""

    def __init__(self, cfg: SimConfig, trace: Trace, router: Router | None = None) -> None:
        self.cfg = cfg
        self.trace = trace
        self.clock = SimClock()
        self.rec = Recorder(len(trace), cfg.tbt_slo_s, cfg.ttft_slo_s)
        self.router = router or make_router(cfg.router, cfg.seed)
        self.scaler = (Autoscaler(cfg.scaling, cfg.tbt_slo_s, cfg.scaling_interval_s, cfg.startup_s)
                       if cfg.scaling is not None else None)
        # Tokens (prompt + max_tokens) of the requests admitted and refused: the demand signal.
        self.demand = DemandLog(cfg.scaling.window_s if cfg.scaling is not None else 60.0)
        # The fleet's TBT window, as the controller keeps one per deployment (gaps of replicas
        # gone since stay until they age out); the replicas add their reports' histograms to it.
        self.tbt = TbtWindow(cfg.scaling.window_s) if cfg.scaling is not None else None
        self.replicas: list[SimReplica] = []  # provisioned: starting, ready or draining
        self.retired: list[SimReplica] = []
        self.routable: list[SimReplica] = []  # ready and not draining
        self.pending: list[SimReplica] = []  # asked for, still starting
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._ids = 0
        self._params: dict[int, SamplingParams] = {}
        self._reports = self.router.needs_reports or self.scaler is not None
        for _ in range(cfg.num_replicas):
            self._provision(0.0, ready=True)

    # ---- replicas -------------------------------------------------------------------------------

    def _provision(self, now: float, ready: bool) -> SimReplica:
        r = SimReplica(f"r{self._ids}", self.cfg.spec, self.clock, self.rec, self._on_finish, self.tbt,
                       self.cfg.log_iterations, self.cfg.decode_runs)
        self._ids += 1
        r.start_t = now
        self.replicas.append(r)
        if ready:
            r.ready_t = now
            self.routable.append(r)
        else:
            self.pending.append(r)
            self._push(now + self.cfg.startup_s, READY, r)
        return r

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def _kick(self, r: SimReplica, now: float) -> None:
        """Start a pass on an idle replica if it has work."""
        if r.batch is None and r.scheduler.has_unfinished():
            end = r.start_iteration(now)
            if end is not None:
                self._push(end, ITER_END, r)

    def _maybe_report(self, r: SimReplica, now: float, force: bool = False) -> None:
        if r.stop_t is not None:  # released: it reports no more
            return
        prev = r.last_report_tokens
        change = r.scheduler.num_running_tokens + r.scheduler.num_waiting_tokens - prev
        if not force and not self.cfg.report.due(now - r.last_report_t, change, prev):
            return
        self._to_router(r, r.report(now), now)

    def _to_router(self, r: SimReplica, load: ReplicaLoad, now: float) -> None:
        """A report to the router, at once or `report_delay_s` later."""
        if self.cfg.report_delay_s:
            self._push(now + self.cfg.report_delay_s, REPORT, (r, load))
        else:
            self.router.reported(r, load, now)

    def _on_finish(self, r: SimReplica, req: Request, now: float) -> None:
        self.router.completed(req.request_id, now)
        if r.draining and r.num_requests == 0:
            self._retire(r, now)

    def _retire(self, r: SimReplica, now: float) -> None:
        r.stop_t = now
        self.replicas.remove(r)
        self.retired.append(r)
        self.router.removed(r)

    def _scale_to(self, desired: int, now: float) -> None:
        have = len(self.routable) + len(self.pending)
        for _ in range(desired - have):
            self._provision(now, ready=False)
        for _ in range(have - desired):
            if self.pending:  # cancel a replica still starting first: it holds no requests
                self._retire(self.pending.pop(), now)
                continue
            if len(self.routable) <= 1:
                break
            victim = min(self.routable, key=lambda x: (x.num_requests, x.replica_id))
            victim.draining = True
            self.routable.remove(victim)
            if victim.num_requests == 0:
                self._retire(victim, now)

    # ---- the loop -------------------------------------------------------------------------------

    def run(self, progress: bool = False, stop: Callable[[Simulator, float], str | None] | None = None,
            stop_every_s: float = 1.0, desc: str = "sim") -> SimResult:
        """Simulate the whole trace; `stop(sim, now)` may end it early by returning a reason."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        self._prime(stop is not None, stop_every_s)
        bar = tqdm(total=len(self.trace), desc=desc, unit="req", disable=not progress, mininterval=0.5, leave=False)
        gc_was = gc.isenabled()
        gc.disable()  # the loop allocates many short-lived objects and no cycles
        try:
            stopped = self._loop(stop, stop_every_s, bar if progress else None)
        finally:
            if gc_was:
                gc.enable()
            bar.update(self.rec.num_finished - bar.n)
            bar.close()
        return self._result(stopped, wall0, cpu0)

    def _prime(self, checks: bool, stop_every_s: float) -> None:
        """The recorder learns the trace; the first scaling tick and stop check are queued."""
        rec, trace = self.rec, self.trace
        rec.arrival = trace.arrival_s.tolist()
        rec.prompt_len, rec.output_len = trace.prompt_len.tolist(), trace.output_len.tolist()
        rec.first_arrival = rec.arrival[0] if len(trace) else 0.0
        rec.late_start_s = 2.0
        if self.scaler is not None:
            self._push(self.scaler.interval_s, SCALE, None)
        if checks:
            self._push(stop_every_s, CHECK, None)

    def _loop(self, stop: Callable[[Simulator, float], str | None] | None, stop_every_s: float,
              bar: tqdm | None) -> str | None:
        """Events and arrivals in time order (an event first on a tie); the stop reason or None."""
        rec, clock, heap, pop = self.rec, self.clock, self._heap, heapq.heappop
        arrivals, plens, olens = list(rec.arrival), rec.prompt_len, rec.output_len
        n = len(arrivals)
        i, events = 0, 0
        while True:
            ta = arrivals[i] if i < n else INF
            if heap and heap[0][0] <= ta:
                t, _, kind, obj = pop(heap)
                clock.t = t
                if kind == ITER_END:
                    self._pass_ended(obj, t)
                elif kind == READY:
                    if obj in self.pending:  # not cancelled meanwhile
                        self.pending.remove(obj)
                        obj.ready_t = t
                        self.routable.append(obj)
                elif kind == SCALE:
                    self._scale_tick(t)
                    if i < n or any(r.scheduler.has_unfinished() for r in self.replicas):
                        self._push(t + self.scaler.interval_s, SCALE, None)
                elif kind == REPORT:
                    r, load = obj
                    if r.stop_t is None:  # a replica released meanwhile is gone from the router
                        self.router.reported(r, load, t)
                elif kind == CHECK:
                    stopped = stop(self, t)
                    if stopped:
                        return stopped
                    if i < n or heap:
                        self._push(t + stop_every_s, CHECK, None)
                events += 1
                if bar is not None and events % 4096 == 0 and rec.num_finished > bar.n:
                    bar.update(rec.num_finished - bar.n)
                continue
            if i >= n:
                return None
            clock.t = ta
            self._arrive(i, ta, plens[i], olens[i])
            i += 1

    def _pass_ended(self, r: SimReplica, t: float) -> None:
        """Finish `r`'s pass, report if due, and start its next pass (or report it idle)."""
        r.finish_iteration(t)
        if self._reports and r.stop_t is None:  # the due check inline: it runs after every pass
            sch = r.scheduler
            prev = r.last_report_tokens
            if self.cfg.report.due(t - r.last_report_t, sch.num_running_tokens + sch.num_waiting_tokens - prev, prev):
                self._to_router(r, r.report(t), t)
        if r.scheduler.has_unfinished():
            end = r.start_iteration(t)
            if end is not None:
                self._push(end, ITER_END, r)
            elif self._reports:
                self._maybe_report(r, t, force=True)
        elif self._reports:
            self._maybe_report(r, t, force=True)

    def _arrive(self, i: int, ta: float, plen: int, olen: int) -> None:
        """Request `i` arrives: refused outright, or routed and its replica kicked if idle."""
        if self.cfg.spec.rejects(plen, olen):
            self.rec.rejected[i] = True
            return
        sp = self._params.get(olen)
        if sp is None:
            sp = self._params[olen] = SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True)
        # The scheduler reads only the prompt's length (tests/loadtests/test_sim.py checks it),
        # so a range stands in for token ids at no memory cost; its own range per request, so the
        # prefix cache (when a spec turns it on) finds no prefix shared by chance.
        ids = self.trace.token_ids[i] if self.trace.token_ids is not None else range(i << 32, (i << 32) + plen)
        req = Request(str(i), ids, sp, 0, ta)
        cost = RequestCost(plen, plen + olen)
        r = self.router.choose(cost, self.routable, ta, ids)
        demand = self.demand if self.scaler is not None else None  # only the scaler reads it
        if self.cfg.shed and not admits(r.scheduler.num_waiting_tokens, plen, queue_bound(
                self.cfg.max_queued_tokens, r.prefill_tps, self.cfg.queue_timeout_s)):
            self.rec.rejected[i] = True
            if demand is not None:
                demand.add(ta, refused=plen + olen)
            return
        if demand is not None:
            demand.add(ta, served=plen + olen)
        r.add(req)
        self.router.routed(req.request_id, r, cost, ta)
        if r.batch is None:
            self._kick(r, ta)

    def _result(self, stopped: str | None, wall0: float, cpu0: float) -> SimResult:
        """Close every replica's lifetime at the last event and summarise the run."""
        end_t = self.clock.t
        for r in self.replicas:
            r.sync()
            if r.stop_t is None:
                r.stop_t = max(end_t, r.start_t)
        everyone = self.retired + self.replicas
        replica_s = sum(r.stop_t - r.start_t for r in everyone)
        summary = self.rec.summary(replica_seconds=replica_s)
        summary["device_seconds"] = replica_s * self.cfg.spec.devices  # a TP replica holds tp GPUs
        summary["iterations"] = sum(r.num_iterations for r in everyone)
        summary["decode_run_passes"] = sum(r.num_run_passes for r in everyone)
        summary["max_replicas"] = max((p[2] for p in self.scaler.trace.points), default=self.cfg.num_replicas) \
            if self.scaler else self.cfg.num_replicas
        per_replica = [{"id": r.replica_id, "iterations": r.num_iterations, "busy_s": r.busy_s,
                        "start_t": r.start_t, "stop_t": r.stop_t} for r in everyone]
        summary["sim_cpu_s"] = time.process_time() - cpu0
        return SimResult(summary, self.cfg.describe(), self.trace.summary(), time.perf_counter() - wall0, stopped,
                         per_replica, list(self.scaler.trace.points) if self.scaler else [])

    def _scale_tick(self, now: float) -> None:
        ready = list(self.routable)
        desired, _ = self.scaler.decide(ready, len(self.pending), now, self.demand, self.tbt)
        if desired != len(ready) + len(self.pending):
            self._scale_to(desired, now)

    # ---- for stop predicates -------------------------------------------------------------------

    def unstarted_late(self, now: float, late_s: float) -> int:
        """Requests not yet given their first token whose scheduling delay already exceeds `late_s`."""
        k = 0
        for r in self.replicas:
            for queue in (r.scheduler.waiting, r.scheduler.running):
                for req in queue:
                    if req.output_token_ids:
                        continue
                    first = now if req.first_scheduled_time is None else req.first_scheduled_time
                    if first - req.arrival_time > late_s:
                        k += 1
        return k


def simulate(cfg: SimConfig, trace: Trace, progress: bool = False, **kw: Any) -> SimResult:
    return Simulator(cfg, trace).run(progress=progress, **kw)
