"""/metrics' TBT histogram is the controller's, in Prometheus's form: its buckets are bin edges of
`replicas.scheduling.histogram`, so each cumulative bucket counts exactly what `LogHistogram.count_le` of its
edge counts over the same gaps (prometheus_client backend, no Ray, no engine)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from replicas.scheduling.histogram import EDGES, GAMMA, LogHistogram
from replicas.serving.metric_backends import PrometheusBackend
from replicas.serving.metrics import PREFIX, TBT_BUCKETS, EngineMetrics

pytestmark = pytest.mark.unit


def test_buckets_are_every_24th_bin_edge_from_1_ms_to_80_s():
    assert all(e in EDGES for e in TBT_BUCKETS) and len(TBT_BUCKETS) == 24
    assert TBT_BUCKETS[0] / GAMMA < 1e-3 <= TBT_BUCKETS[0] and TBT_BUCKETS[-1] <= 80.0
    index = [EDGES.index(e) for e in TBT_BUCKETS]
    assert {b - a for a, b in zip(index, index[1:])} == {24}


def test_prometheus_buckets_count_what_the_histogram_counts():
    rng = random.Random(3)
    gaps = [rng.lognormvariate(-3.7, 0.8) for _ in range(5000)] + list(TBT_BUCKETS[:5]) + [500.0]
    reg = CollectorRegistry()
    metrics = EngineMetrics(PrometheusBackend(reg), "m")
    metrics.itl.record_many(gaps, metrics.tags)
    hist = LogHistogram.of(gaps)
    name = PREFIX + "inter_token_latency_seconds"
    for edge in TBT_BUCKETS:
        bucket = reg.get_sample_value(name + "_bucket", {"model_name": "m", "le": str(edge)})
        assert bucket == hist.count_le(edge) == sum(1 for g in gaps if g <= edge)
    assert reg.get_sample_value(name + "_bucket", {"model_name": "m", "le": "+Inf"}) == hist.count == len(gaps)
