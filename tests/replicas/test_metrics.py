"""Engine metrics move by exactly what the engine did (prometheus_client backend, no Ray)."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from replicas import Engine, EngineConfig, SamplingParams
from replicas.serving.metric_backends import PrometheusBackend
from replicas.serving.metrics import EngineMetrics

pytestmark = pytest.mark.engine


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if v is None else v


def test_counts_follow_the_engine():
    reg = CollectorRegistry()
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(policy="dynamic", max_batch_prefill_tokens=64,
                                                                max_batch_total_tokens=512))
    eng.observers.append(EngineMetrics(PrometheusBackend(reg), "m", tbt_slo_s=10.0))
    outs = eng.generate([[5, 6, 7], [8, 9], list(range(10, 40))],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in outs)
    p = "stallfree_"
    assert value(reg, p + "request_success_total", finished_reason="length") == 3
    assert value(reg, p + "time_to_first_token_seconds_count") == 3
    assert value(reg, p + "request_queue_time_seconds_count") == 3
    assert value(reg, p + "e2e_request_latency_seconds_count") == 3
    assert value(reg, p + "inter_token_latency_seconds_count") == 3 * 5
    assert value(reg, p + "generation_tokens_total") == 18
    assert value(reg, p + "prompt_tokens_total") == 3 + 2 + 30
    assert value(reg, p + "iteration_duration_seconds_count") == len(eng.iterations)
    assert value(reg, p + "iteration_tokens_sum", phase="prefill") == 35
    assert value(reg, p + "iteration_tokens_sum", phase="decode") == 15
    assert value(reg, p + "tbt_slo_tokens_total", within_slo="true") == 15  # a 10 s SLO: all within
    assert value(reg, p + "num_requests_running") == 0 and value(reg, p + "kv_cache_usage_perc") == 0
    # Aborts are counted too.
    req = eng.add_request([5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort(req.request_id)
    assert value(reg, p + "request_success_total", finished_reason="abort") == 1


def test_stalls_are_counted_under_dynamic():
    reg = CollectorRegistry()
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(policy="dynamic", max_batch_prefill_tokens=64,
                                                                max_batch_total_tokens=512))
    eng.observers.append(EngineMetrics(PrometheusBackend(reg), "m", tbt_slo_s=1e-9))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng.add_request([5, 6, 7], params)
    eng.step()
    eng.step()
    eng.add_request(list(range(5, 60)), params)  # its admission pass stalls the first stream
    while eng.has_unfinished():
        eng.step()
    assert value(reg, "stallfree_generation_stalls_total", cause="skipped") == 1
    assert value(reg, "stallfree_generation_stalls_total", cause="slow_iteration") == len(eng.iterations)
    assert value(reg, "stallfree_tbt_slo_tokens_total", within_slo="false") == 14


def test_gauges_read_zero_once_the_last_request_is_aborted_and_the_loop_idles(wait_until):
    from replicas.serving.async_engine import AsyncEngine

    reg = CollectorRegistry()
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_total_tokens=512))
    eng.observers.append(EngineMetrics(PrometheusBackend(reg), "m"))
    loop = AsyncEngine(eng)
    try:
        async def run() -> None:
            stream = await loop.add_request([[5, 6, 7]], SamplingParams(max_tokens=500, ignore_eos=True), "a")
            await anext(stream)  # it runs: the gauges show it
            assert value(reg, "stallfree_num_requests_running") == 1
            assert value(reg, "stallfree_kv_cache_usage_perc") > 0  # how far it got varies
            await stream.aclose()  # the caller leaves: the request is aborted between passes

        import asyncio
        asyncio.run(run())
        wait_until(lambda: value(reg, "stallfree_kv_cache_usage_perc") == 0, interval_s=0.01,
                   what="the aborted request's KV cache freed")
        assert value(reg, "stallfree_num_requests_running") == 0
        assert value(reg, "stallfree_num_requests_waiting") == 0
        assert value(reg, "stallfree_token_load") == 0
        assert value(reg, "stallfree_request_success_total", finished_reason="abort") == 1
    finally:
        loop.shutdown()


def test_a_prompt_only_scored_request_counts_as_finished_with_no_token_latency():
    reg = CollectorRegistry()
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig(max_batch_prefill_tokens=16,
                                                                max_batch_total_tokens=512))
    eng.observers.append(EngineMetrics(PrometheusBackend(reg), "m"))
    eng.generate([list(range(5, 45)), [5, 6, 7]], [SamplingParams(max_tokens=0, prompt_logprobs=1),
                                                   SamplingParams(max_tokens=2, ignore_eos=True)])
    p = "stallfree_"
    assert value(reg, p + "request_success_total", finished_reason="length") == 2
    assert value(reg, p + "time_to_first_token_seconds_count") == 1
    assert value(reg, p + "e2e_request_latency_seconds_count") == 1
    assert value(reg, p + "generation_tokens_total") == 2
    assert value(reg, p + "prompt_tokens_total") == 43


def test_the_runner_path_and_compiles_are_set_again_while_idle():
    """Ray stops exporting a gauge nobody sets: the runner's path and compile counts are set at
    the first pass and again on every idle tick, like the load gauges."""
    reg = CollectorRegistry()
    eng = Engine.from_pretrained("embedded:tiny", EngineConfig())
    metrics = EngineMetrics(PrometheusBackend(reg), "m")
    eng.observers.append(metrics)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert value(reg, "stallfree_runner_path", path="sdpa") == 1
    assert reg.get_sample_value("stallfree_compiles", {"model_name": "m", "phase": "serving"}) == 0
    sets = []
    metrics.path.record = lambda v, t: sets.append((v, t["path"]))
    metrics.on_idle(eng)
    metrics.on_idle(eng)
    assert sets == [(1, "sdpa"), (1, "sdpa")]
    assert reg.get_sample_value("stallfree_compiles", {"model_name": "m", "phase": "warm_up"}) == 0


def test_histograms_are_flushed_when_the_loop_idles_and_every_few_seconds_of_passes():
    """A histogram counted in process (Ray's backend) is exported at each flush: every histogram
    is flushed by the first pass, or idle tick, at least HISTOGRAM_REFRESH_S (on the engine's
    clock) after the last flush, so none vanishes from Ray's export while quiet, and a loop that
    goes idle after every request does not export them all after every request."""
    from replicas.serving.metrics import HISTOGRAM_REFRESH_S

    eng = Engine.from_pretrained("embedded:tiny", EngineConfig())
    metrics = EngineMetrics(PrometheusBackend(CollectorRegistry()), "m")
    eng.observers.append(metrics)
    flushed: list[int] = []
    for i, histogram in enumerate(metrics.histograms):
        histogram.flush = lambda i=i: flushed.append(i)  # type: ignore[method-assign]
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    first = eng.iterations[0].start
    assert sorted(flushed) == list(range(len(metrics.histograms)))  # the first pass: none flushed before
    flushed.clear()
    eng.generate([[5, 6, 8]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert eng.iterations[-1].start - first < HISTOGRAM_REFRESH_S and flushed == []  # too soon
    metrics._histograms_flushed_at -= HISTOGRAM_REFRESH_S  # as if 5 s of passes went by
    eng.generate([[5, 6, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert sorted(flushed) == list(range(len(metrics.histograms)))
    flushed.clear()
    metrics.on_idle(eng)
    assert flushed == []  # idle just after the flush: the next idle tick exports
    metrics._histograms_flushed_at -= HISTOGRAM_REFRESH_S  # the idle tick 5 s on
    metrics.on_idle(eng)
    assert sorted(flushed) == list(range(len(metrics.histograms)))
    flushed.clear()
    metrics.on_idle(eng)
    assert flushed == []


class FakeGauge:
    """A gauge that keeps every value it was set to, by its tags (the le label included)."""

    made: dict[str, FakeGauge] = {}

    def __init__(self, name: str, doc: str, tags: tuple[str, ...]) -> None:
        self.name, self.tag_keys, self.values = name, tags, {}
        FakeGauge.made[name] = self

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys)
        self.values[tuple(sorted(tags.items()))] = value


def test_a_gauge_histogram_exports_a_prometheus_histograms_samples_at_its_flushes():
    """Counted in process, exported as gauges: `_bucket` (cumulative, +Inf included), `_sum`,
    `_count`, each tag set apart; set when `flush_s` has passed since the last export, or on
    `flush()`, every series each time (Ray drops a gauge not set for a while); the same numbers
    prometheus_client's own histogram gives for the same values."""
    from replicas.serving.metric_backends import GaugeHistogram

    now = [0.0]
    FakeGauge.made.clear()
    h = GaugeHistogram(FakeGauge, "gaps_seconds", "doc", [0.01, 0.1, 1.0], ["model"], clock=lambda: now[0],
                       flush_s=1.0)
    bucket, total, count = (FakeGauge.made["gaps_seconds" + k] for k in ("_bucket", "_sum", "_count"))
    assert bucket.tag_keys == ("model", "le") and total.tag_keys == count.tag_keys == ("model",)
    h.record_many([0.003, 0.05, 0.05, 2.0], {"model": "a"})
    assert bucket.values == {}  # not yet: within flush_s of the start
    now[0] = 1.5
    h.record(0.01, {"model": "a"})  # on a bound: counted in it, as Prometheus counts
    le = lambda m, x: (("le", x), ("model", m))  # noqa: E731
    a = dict(bucket.values)
    assert a == {le("a", "0.01"): 2, le("a", "0.1"): 4, le("a", "1.0"): 4, le("a", "+Inf"): 5}
    assert total.values[(("model", "a"),)] == pytest.approx(2.113) and count.values[(("model", "a"),)] == 5
    # prometheus_client's own histogram of the same values agrees bucket by bucket
    reg = CollectorRegistry()
    ph = prometheus_client.Histogram("gaps_seconds", "doc", ["model"], buckets=[0.01, 0.1, 1.0], registry=reg)
    for v in (0.003, 0.05, 0.05, 2.0, 0.01):
        ph.labels(model="a").observe(v)
    assert {x: reg.get_sample_value("gaps_seconds_bucket", {"model": "a", "le": x})
            for x in ("0.01", "0.1", "1.0", "+Inf")} == {x: a[le("a", x)] for x in ("0.01", "0.1", "1.0", "+Inf")}
    h.record_many([0.5], {"model": "b"})  # another series: set at the next flush, a's set again
    bucket.values.clear()
    h.flush()
    assert bucket.values == {**a, le("b", "0.01"): 0, le("b", "0.1"): 0, le("b", "1.0"): 1, le("b", "+Inf"): 1}
    h.record_many([], {"model": "c"})
    h.flush()
    assert count.values == {(("model", "a"),): 5, (("model", "b"),): 1}  # nothing recorded for c


def test_the_ray_backends_histogram_sets_ray_gauges_of_its_counts():
    """Inside a replica a histogram is a `GaugeHistogram` over Ray Serve gauges: Ray's agent then
    sees a few series per export, not one record per observation."""
    from ray.serve.metrics import Gauge

    from replicas.serving.metric_backends import GaugeHistogram, RayBackend

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[float, dict[str, str]]] = []

        def record(self, value: float, tags: dict[str, str]) -> None:
            self.calls.append((value, dict(tags)))

    metric = RayBackend().histogram("stallfree_test_gaps_seconds", "test", [0.01, 0.1, 1.0], ["model"])
    assert isinstance(metric, GaugeHistogram)
    ray_bucket = metric._bucket._gauge
    assert isinstance(ray_bucket, Gauge)
    ray_bucket._metric = Recorder()
    metric.record_many([0.003, 0.05, 0.05, 2.0], {"model": "m"})
    metric.flush()
    got = {c[1]["le"]: c[0] for c in ray_bucket._metric.calls}
    assert got == {"0.01": 1, "0.1": 3, "1.0": 3, "+Inf": 4}
    assert all(c[1]["model"] == "m" for c in ray_bucket._metric.calls)




def test_a_ray_gauge_sets_an_unchanged_value_again_only_once_rays_export_period_passed():
    """A histogram's flush sets hundreds of cumulative counts, most as they were: each costs Ray
    ~10 us, and Ray exports a gauge's last value once a period anyway. An equal value is skipped
    until `refresh_s` (Ray's export period, at least 1 s) has passed, so a quiet series is still
    set before Ray's agent would drop it (two periods); a changed value or another tag set is
    always set."""
    from replicas.serving.metric_backends import _RayGauge, export_period_s

    calls: list[tuple[float, dict[str, str]]] = []

    class Recorder:
        def record(self, value: float, tags: dict[str, str]) -> None:
            calls.append((value, dict(tags)))

    now = [0.0]
    g = _RayGauge("stallfree_test_dedupe", "test", ("model",), clock=lambda: now[0], refresh_s=10.0)
    g._gauge._metric = Recorder()
    for t, value, model in [(0.0, 1, "a"), (1.0, 1, "a"), (2.0, 2, "a"), (3.0, 2, "b"), (9.0, 2, "a"),
                            (12.5, 2, "a"), (13.0, 2, "a"), (13.5, 2, "b")]:
        now[0] = t
        g.set(value, {"model": model})
    assert [(v, tags["model"]) for v, tags in calls] == [(1, "a"), (2, "a"), (2, "b"), (2, "a"), (2, "b")]
    assert export_period_s() >= 1.0
    assert _RayGauge("stallfree_test_dedupe_default", "test", ("model",)).refresh_s == export_period_s()
