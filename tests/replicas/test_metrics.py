"""Engine metrics move by exactly what the engine did (prometheus_client backend, no Ray)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from replicas import Engine, EngineConfig, SamplingParams
from replicas.serving.metrics import EngineMetrics, PrometheusBackend

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
    req = eng.add_request([5, 6], SamplingParams(max_tokens=50))
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


def test_the_ray_histogram_bound_once_records_what_observe_records():
    """The Ray backend's many-values path (`_ray_observer`: the tags resolved once per pass)
    hands Ray's record the same values and tags as `observe` does, value by value."""
    from ray.serve.metrics import Histogram

    from replicas.serving.metrics import RayBackend

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[float, dict[str, str]]] = []

        def record(self, value: float, tags: dict[str, str]) -> None:
            self.calls.append((value, dict(tags)))

    metric = RayBackend().histogram("stallfree_test_gaps_seconds", "test", [0.01, 0.1, 1.0], ["model"])
    ray_metric = metric._bind.args[0]  # the Ray histogram the backend made
    assert isinstance(ray_metric, Histogram)
    ray_metric._metric = Recorder()
    values = [0.003, 0.05, 0.05, 2.0]
    for v in values:
        ray_metric.observe(v, tags={"model": "m"})
    by_observe = list(ray_metric._metric.calls)
    ray_metric._metric.calls.clear()
    metric.record_many(values, {"model": "m"})
    assert ray_metric._metric.calls == by_observe and len(by_observe) == 4
    assert by_observe[0][1]["model"] == "m"
