"""The cost model reproduces the roofline's textbook numbers, and the calibration fit recovers
the coefficients that generated a set of iteration timings."""

from __future__ import annotations

import numpy as np
import pytest

from loadtests.sim import capacity
from loadtests.sim.capacity import Criteria
from loadtests.sim.costmodel import CostModel, fit, fit_error, kv_capacity_tokens, load_profiles
from loadtests.sim.deploy import replica_spec
from loadtests.sim.simulator import SimConfig
from loadtests.sim.traffic import make_trace

pytestmark = pytest.mark.unit


def test_profiles_cite_a_source_for_every_entry():
    prof = load_profiles()
    for section in ("gpus", "models", "workloads"):
        for name, entry in prof[section].items():
            assert entry.get("source"), f"{section}/{name} has no source"
    assert prof["efficiency"]["source"]


def test_mistral_decode_at_batch_one_is_weight_bandwidth_bound():
    m = CostModel.from_profile("A100-80GB", "mistral-7b")
    prof = load_profiles()
    weights_at_peak = 7.24e9 * 2 / prof["gpus"]["A100-80GB"]["hbm_bytes_per_s"]
    assert weights_at_peak == pytest.approx(7.1e-3, rel=0.01)  # ~7 ms: 14.5 GB at 2 TB/s
    t = m.iteration_time(prefill=0, decode=1, context=1, num_seqs=1, pairs=1)
    assert m.memory_s(1) > m.compute_s(0, 1, 1)
    assert t == pytest.approx(m.overhead_s + weights_at_peak / prof["efficiency"]["memory"], rel=1e-3)


def test_mistral_prefill_of_4096_tokens_is_compute_bound():
    m = CostModel.from_profile("A100-80GB", "mistral-7b")
    pairs = 4096 * 4097 // 2  # causal: the i-th prompt token attends i keys
    assert m.compute_s(4096, 0, pairs) > 5 * m.memory_s(4096)
    flops = 2 * 7.24e9 * 4096 + 4 * 32 * 4096 * pairs
    assert m.iteration_time(4096, 0, 4096, 1, pairs) == pytest.approx(m.overhead_s + flops / (312e12 * 0.6), rel=1e-6)


def test_tensor_parallel_adds_all_reduce_and_splits_weights():
    one = CostModel.from_profile("H100-SXM", "llama-70b", tp=1)
    four = CostModel.from_profile("H100-SXM", "llama-70b", tp=4)
    assert four.weights_s == pytest.approx(one.weights_s / 4)
    assert four.comm_per_token_s > 0 and one.comm_per_token_s == 0
    assert kv_capacity_tokens("H100-SXM", "llama-70b", tp=4) > 0
    with pytest.raises(ValueError):
        kv_capacity_tokens("A100-80GB", "llama-70b", tp=1)  # 141 GB of weights on one 80 GB part


def synthetic(n: int = 400, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 512, n) * (rng.random(n) < 0.6)
    d = rng.integers(0, 64, n)
    d[(p == 0) & (d == 0)] = 1
    c = d * rng.integers(50, 1500, n) + p * rng.integers(1, 3, n)
    s = d + (p > 0) * rng.integers(1, 4, n)  # decodes plus one to three prompt chunks
    return np.column_stack([p, d, c, s, np.zeros(n), np.zeros(n)]).astype(float)  # pairs, padded: not recorded


def test_fit_recovers_linear_coefficients_within_one_percent():
    truth = CostModel(overhead_s=0.012, per_seq_s=2e-4, per_prefill_token_s=6e-4, per_decode_token_s=3e-3,
                      per_kv_token_s=4e-6, form="sum")
    x = synthetic()
    got = fit(x, truth.predict(x), "sum")
    for name in ("overhead_s", "per_seq_s", "per_prefill_token_s", "per_decode_token_s", "per_kv_token_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.01), name
    # With 2% timing noise the predictions stay within the noise.
    y = truth.predict(x) * (1 + 0.02 * np.random.default_rng(1).standard_normal(len(x)))
    assert fit_error(fit(x, y, "sum"), x, y)["rel_err_p50"] < 0.02


def test_fit_recovers_roofline_coefficients_within_one_percent():
    truth = CostModel(overhead_s=0.003, per_prefill_token_s=8e-5, per_decode_token_s=8e-5, weights_s=0.009,
                      per_kv_token_s=8e-8, form="max")
    x = synthetic(seed=2)
    x[:, 2] *= 8  # long contexts, so both branches bind somewhere
    y = truth.predict(x)
    bound = truth.compute_s(x[:, 0], x[:, 1]) >= truth.memory_s(x[:, 2])
    assert 0.1 < bound.mean() < 0.9
    got = fit(x, y, "max")
    for name in ("overhead_s", "per_prefill_token_s", "per_decode_token_s", "weights_s", "per_kv_token_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.01), name


def test_capacity_bisection_brackets_the_threshold(monkeypatch):
    threshold = 2.34
    tried = []

    def fake_point(cfg, trace, rate, crit, early_stop=True):
        tried.append(rate)
        return {"rate": rate, "passed": rate <= threshold}

    monkeypatch.setattr(capacity, "run_point", fake_point)
    res = capacity.find_capacity(None, None, Criteria(0.1), start_rate=1.0, rel_tol=0.03)
    assert res["capacity_rps"] <= threshold < res["upper_bound_rps"]
    assert (res["upper_bound_rps"] - res["capacity_rps"]) / res["upper_bound_rps"] <= 0.03
    assert tried[:3] == [1.0, 2.0, 4.0]  # doubling until the first failure, then bisection


def test_stall_free_holds_a_strict_slo_at_a_rate_where_dynamic_stalls():
    unit = make_trace("sharegpt", "poisson", n=120, rate=1.0, seed=5)
    points = {}
    for policy, mbp in (("dynamic", 8192), ("stall_free", 512)):
        cfg = SimConfig(replica_spec("A100-80GB", "mistral-7b", policy, mbp), 1, router="round_robin")
        points[policy] = capacity.run_point(cfg, unit, 1.5, Criteria(0.1))
    assert not points["dynamic"]["passed"] and points["dynamic"]["tbt_bucket_p99_s"] > 0.1
    assert points["stall_free"]["passed"] and points["stall_free"]["tbt_bucket_p99_s"] < 0.06
