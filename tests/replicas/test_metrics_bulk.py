"""A histogram's values recorded in bulk (a pass's TBT gaps at once) leave /metrics exactly as
one `observe` per value does: the same series, the same bucket counts and count, the same sum
up to float rounding (prometheus_client backend, no Ray, no engine)."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from replicas.serving.metric_backends import PrometheusBackend, bucket_counts
from replicas.serving.metrics import LATENCY_BUCKETS, PREFIX, TBT_BUCKETS, EngineMetrics

pytestmark = pytest.mark.unit


def _samples(reg: CollectorRegistry) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in reg.collect() for s in m.samples if not s.name.endswith("_created")}


def test_bulk_gives_the_series_and_counts_one_observe_each_gives():
    rng = random.Random(5)
    # A pass's gaps: most equal (the running decodes all got their last token together), a few
    # not, some exactly on a bound, one past the last finite bound.
    passes = [[0.004] * 200 + [rng.uniform(0.001, 0.2) for _ in range(50)] + list(TBT_BUCKETS[:3]) + [500.0]
              for _ in range(4)]
    bulk_reg, one_reg = CollectorRegistry(), CollectorRegistry()
    bulk, one = EngineMetrics(PrometheusBackend(bulk_reg), "m"), EngineMetrics(PrometheusBackend(one_reg), "m")
    for gaps in passes:
        bulk.itl.record_many(gaps, bulk.tags)
        bulk.ttft.record_many(gaps[:7], bulk.tags)
        for g in gaps:
            one.itl.record(g, one.tags)
        for g in gaps[:7]:
            one.ttft.record(g, one.tags)
    a, b = _samples(bulk_reg), _samples(one_reg)
    assert a.keys() == b.keys()
    for key, value in b.items():
        if key[0].endswith("_sum"):
            assert math.isclose(a[key], value, rel_tol=1e-12)
        else:
            assert a[key] == value, key
    name = PREFIX + "inter_token_latency_seconds"
    assert a[(name + "_count", (("model_name", "m"),))] == 4 * 254
    assert a[(name + "_bucket", (("le", "+Inf"), ("model_name", "m")))] == 4 * 254
    assert generate_latest(bulk_reg).count(b"\n") == generate_latest(one_reg).count(b"\n")


def test_bucket_counts_put_a_value_at_the_first_bound_not_below_it():
    bounds = [*LATENCY_BUCKETS, math.inf]
    counts = bucket_counts(bounds, [0.001, 0.001, 0.0011, 0.0025, 99.0, 1e9, math.nan])
    assert counts == {0: 2, 1: 2, bounds.index(math.inf): 2}  # NaN: no bucket, as observe
