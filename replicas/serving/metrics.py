"""Engine metrics with names a vLLM user recognises, under our `stallfree_` prefix.

`EngineMetrics` is an engine observer: after every iteration it records what the pass did.
The metric objects come from a backend (`metric_backends`): Ray's metrics inside a replica
(exported with Ray's `ray_` prefix on the node's metrics export port), or a prometheus_client
registry (tests, the controller's endpoint, anything outside Serve).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replicas.scheduling.histogram import edge_subset
from replicas.serving.metric_backends import Backend

if TYPE_CHECKING:  # light at run time: the Serve controller (autoscale.policy) imports this
    from replicas.engine import Engine, IterationStats
    from replicas.scheduling.batch import SchedulerOutput

PREFIX = "stallfree_"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# The TBT histogram's buckets are bin edges of the controller's TBT histogram
# (`replicas.scheduling.histogram`, bins of ratio 1.02): every 24th edge from 1 ms to 80 s, 24 buckets of
# ratio 1.02^24 (1.61). A bucket `le` one of them counts exactly what `LogHistogram.count_le` of
# that edge counts, so /metrics and the controller's window bin a gap the same way.
TBT_BUCKETS = edge_subset(1e-3, 80.0, every=24)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0, 2.0)
HISTOGRAM_REFRESH_S = 5.0  # while passes run, every histogram is flushed at least this often


class EngineMetrics:
    """Records per-iteration and per-request engine metrics (an `Engine` observer).

    Each pass's per-token values are gathered, then recorded with one call per metric and pass
    (`record_many`). Recording stays on the loop thread: a background recorder was measured slower
    (bench_overhead: 3.6 ms against 3.0 ms of overhead at 256 decodes; GIL contention).
    """

    def __init__(self, backend: Backend, model: str, tbt_slo_s: float | None = None) -> None:
        self.tags = {"model_name": model}
        self.tbt_slo_s = tbt_slo_s
        t = ("model_name",)
        p = PREFIX
        h = backend.histogram
        self.ttft = h(p + "time_to_first_token_seconds", "Time to first token (arrival to first token).", LATENCY_BUCKETS, t)
        self.itl = h(p + "inter_token_latency_seconds", "Time between consecutive tokens of a request (TBT).", TBT_BUCKETS, t)
        self.e2e = h(p + "e2e_request_latency_seconds", "Arrival to last token of finished requests.", LATENCY_BUCKETS, t)
        self.queue = h(p + "request_queue_time_seconds", "Arrival to first scheduled forward pass.", LATENCY_BUCKETS, t)
        self.iter_time = h(p + "iteration_duration_seconds", "Wall time of one forward pass + sampling.", LATENCY_BUCKETS, t)
        self.iter_tokens = h(p + "iteration_tokens", "Tokens in one forward pass, by phase.", TOKEN_BUCKETS, (*t, "phase"))
        g = backend.gauge
        self.running = g(p + "num_requests_running", "Requests in the running batch.", t)
        self.waiting = g(p + "num_requests_waiting", "Requests waiting to be admitted.", t)
        self.kv_usage = g(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", t)
        self.token_load = g(p + "token_load", "Tokens held by running requests plus waiting prompt tokens.", t)
        self.budget = g(p + "prefill_budget_tokens", "Prefill tokens the TBT-SLO budget allowed the last "
                        "pass that had decodes.", t)
        self.pass_target = g(p + "slo_pass_target_seconds", "Pass time the TBT-SLO budget aimed the last "
                             "pass with decodes at (tbt_slo_ms x budget_margin, lowered by the model's "
                             "recent overruns and the KV cap).", t)
        self.fallback = g(p + "slo_budget_fallback", "1 while the pass-time model is not trusted and the "
                          "fixed prefill budget applies.", t)
        self.pred_error = h(p + "pass_time_prediction_error", "Relative error of the predicted pass time "
                            "(|predicted - actual| / actual).", ERROR_BUCKETS, t)
        self.histograms = (self.ttft, self.itl, self.e2e, self.queue, self.iter_time, self.iter_tokens,
                           self.pred_error)
        self._histograms_flushed_at = 0.0  # on the engine's clock (IterationStats.start)
        c = backend.counter
        self.finished = c(p + "request_success_total", "Finished requests by finish reason.", (*t, "finished_reason"))
        self.preemptions = c(p + "num_preemptions_total", "Requests preempted (KV ran out; recomputed later).", t)
        self.stalls = c(p + "generation_stalls_total", "Passes in which a running request got no token, "
                        "or that took longer than the TBT SLO.", (*t, "cause"))
        self.slo_tokens = c(p + "tbt_slo_tokens_total", "Generated tokens by whether their gap met the TBT SLO.",
                            (*t, "within_slo"))
        self.gen_tokens = c(p + "generation_tokens_total", "Generated tokens.", t)
        self.prompt_tokens = c(p + "prompt_tokens_total", "Prompt tokens computed (recompute included).", t)
        self.prefix_queries = c(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                                "cache at admission.", t)
        self.prefix_hits = c(p + "prefix_cache_hits_total", "Prompt tokens found in the prefix cache "
                             "(not computed again).", t)
        self.cached_blocks = g(p + "prefix_cache_blocks", "KV blocks registered in the prefix cache "
                               "(referenced or reclaimable).", t)
        self._prefix_seen = (0, 0)  # the block manager's (queries, hits) counters last recorded
        self.admission_held = c(p + "slo_admission_held_total", "Passes in which the next waiting request was held "
                                "back: its decodes beside the running ones were predicted over the "
                                "TBT SLO (stall_free with the SLO budget).", t)
        self._held_seen = 0
        self.compiles = g(p + "compiles", "Graphs the model runner compiled since start, warm-up included "
                          "(a rise while serving: a pass shape warm-up missed, seconds of stall).", (*t, "phase"))
        self.path = g(p + "runner_path", "1 for the forward path the model runner runs: flex+graphs, flex, "
                      "sdpa, or 'sdpa (fallback)' after the flex path failed to start.", (*t, "path"))
        self._compiles_seen: tuple[int, int] | None = None

    def on_iteration(self, stats: IterationStats, batch: SchedulerOutput, engine: Engine) -> None:
        tags = self.tags
        if stats.start - self._histograms_flushed_at >= HISTOGRAM_REFRESH_S:
            self._histograms_flushed_at = stats.start
            self.flush_histograms()  # those no pass records into stay exported too
        if engine.runner.compiles != self._compiles_seen:
            self.record_runner(engine.runner)
        self.iter_time.record(stats.duration, tags)
        if stats.num_prefill_tokens:
            self.iter_tokens.record(stats.num_prefill_tokens, {**tags, "phase": "prefill"})
            self.prompt_tokens.record(stats.num_prefill_tokens, tags)
        if stats.num_decode_tokens:
            self.iter_tokens.record(stats.num_decode_tokens, {**tags, "phase": "decode"})
        if stats.num_preempted:
            self.preemptions.record(stats.num_preempted, tags)
        self._record_prefix_cache(engine.blocks)
        held = engine.slo_admission.held if engine.slo_admission is not None else 0
        if held != self._held_seen:
            self.admission_held.record(held - self._held_seen, tags)
            self._held_seen = held
        if stats.num_stalled:
            self.stalls.record(1, {**tags, "cause": "skipped"})
        if stats.predicted_s is not None and stats.duration > 0:
            self.pred_error.record(abs(stats.predicted_s - stats.duration) / stats.duration, tags)
        if stats.prefill_budget is not None:
            self.budget.record(stats.prefill_budget, tags)
        if stats.pass_target_s is not None:
            self.pass_target.record(stats.pass_target_s, tags)
        if stats.prefill_budget is not None or stats.budget_fallback:
            self.fallback.record(1.0 if stats.budget_fallback else 0.0, tags)
        slo = self.tbt_slo_s
        if slo is not None and stats.duration > slo:
            self.stalls.record(1, {**tags, "cause": "slow_iteration"})
        samples = engine.last_pass  # gathered once, by the engine's postprocess
        gaps = samples.gaps
        e2e: list[float] = []
        for req in samples.finished:
            if req.token_times:  # none for a prompt only scored (max_tokens 0)
                e2e.append(req.token_times[-1] - req.arrival_time)
            self.finished.record(1, {**tags, "finished_reason": req.finish_reason or "unknown"})
        for metric, values in ((self.ttft, samples.ttft), (self.queue, samples.queue), (self.itl, gaps),
                               (self.e2e, e2e)):
            if values:
                metric.record_many(values, tags)
        if gaps and slo is not None:
            within = sum(map(float(slo).__ge__, gaps))  # gaps within the SLO
            if within:
                self.slo_tokens.record(within, {**tags, "within_slo": "true"})
            if within < len(gaps):
                self.slo_tokens.record(len(gaps) - within, {**tags, "within_slo": "false"})
        if samples.ttft or gaps:
            self.gen_tokens.record(len(samples.ttft) + len(gaps), tags)
        self.record_load(engine.last_load)

    def _record_prefix_cache(self, blocks: Any) -> None:
        queries, hits = blocks.query_tokens, blocks.hit_tokens
        seen_q, seen_h = self._prefix_seen
        if queries != seen_q:
            self.prefix_queries.record(queries - seen_q, self.tags)
            if hits != seen_h:
                self.prefix_hits.record(hits - seen_h, self.tags)
            self._prefix_seen = (queries, hits)

    def on_abort(self, request: Any) -> None:
        """Count the request by how it ended (aborted, or past the queue deadline)."""
        self.finished.record(1, {**self.tags, "finished_reason": request.finish_reason or "abort"})

    def on_idle(self, engine: Engine) -> None:
        """The loop has nothing to run: gauges read the (empty) load instead of the last pass's,
        the runner's are set again (Ray stops exporting a gauge not set for a while), and the
        histograms export what they hold once HISTOGRAM_REFRESH_S passed since they last did:
        the loop tells it idle on going idle and every few seconds after (the tick that exports
        the last values), and one request at a time goes idle after each, where exporting every
        histogram (hundreds of Ray gauge sets) would cost the replica more than its HTTP work."""
        self.record_load(engine.last_load)
        self.record_runner(engine.runner)
        now = engine.scheduler.clock()
        if now - self._histograms_flushed_at >= HISTOGRAM_REFRESH_S:
            self._histograms_flushed_at = now
            self.flush_histograms()

    def flush_histograms(self) -> None:
        """Every histogram exports what it holds (`Metric.flush`)."""
        for histogram in self.histograms:
            histogram.flush()

    def record_runner(self, runner: Any) -> None:
        """Which forward path runs, and the graphs compiled at warm-up and while serving."""
        tags = self.tags
        total, after = self._compiles_seen = runner.compiles
        self.path.record(1, {**tags, "path": runner.path})
        self.compiles.record(total - after, {**tags, "phase": "warm_up"})
        self.compiles.record(after, {**tags, "phase": "serving"})

    def record_load(self, load: Any) -> None:
        tags = self.tags
        self.running.record(load.num_running, tags)
        self.waiting.record(load.num_waiting, tags)
        self.kv_usage.record(load.kv_usage, tags)
        self.token_load.record(load.running_tokens + load.waiting_tokens, tags)
        self.cached_blocks.record(load.cached_blocks, tags)
