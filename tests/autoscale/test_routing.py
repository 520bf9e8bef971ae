"""A request goes to the replica with the least predicted token load after adding it, counting
tokens routed but not yet reported, never to a replica without KV room while another has it;
equal replicas share a burst exactly evenly."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from autoscale.load import ReplicaLoad
from autoscale.routing import (RequestCost, choose_by_ttft, choose_replica, kv_headroom, power_of_two,
                               prefill_rate, request_cost,
                               round_robin)

pytestmark = pytest.mark.unit


def load(rid: str, running: int = 0, waiting: int = 0, free_blocks: int = 1000, total: int = 1000,
         block: int = 16) -> ReplicaLoad:
    return ReplicaLoad(rid, running_tokens=running, waiting_tokens=waiting, free_blocks=free_blocks,
                       total_blocks=total, block_size=block)


def test_least_loaded_first():
    loads = {"a": load("a", running=900), "b": load("b", running=100, waiting=200), "c": load("c", running=500)}
    assert choose_replica(10, 10, loads, {}, rng=random.Random(0)) == ["b", "c", "a"]


def test_in_flight_tokens_change_the_choice():
    loads = {"a": load("a", running=100), "b": load("b", running=300)}
    # 400 tokens routed to a and not yet reported make a the busier one: 500 vs 300.
    assert choose_replica(10, 10, loads, {"a": 400}, rng=random.Random(0))[0] == "b"
    assert choose_replica(10, 10, loads, {"a": 150}, rng=random.Random(0))[0] == "a"


def test_kv_headroom_excludes_a_full_replica_when_another_fits():
    # a is idle in tokens but its free KV (2 blocks * 16 = 32 tokens) cannot hold 100.
    loads = {"a": load("a", free_blocks=2), "b": load("b", running=5000, free_blocks=500)}
    assert choose_replica(60, 100, loads, {}, rng=random.Random(0)) == ["b", "a"]
    # Waiting prompts and unreported in-flight requests use headroom too.
    loads = {"a": load("a", waiting=7950, free_blocks=500), "b": load("b", running=9000, free_blocks=500)}
    assert kv_headroom(loads["a"]) == 50
    assert choose_replica(60, 100, loads, {}, rng=random.Random(0))[0] == "b"
    assert choose_replica(60, 100, {"b": loads["b"]}, {"b": 10}, in_flight_kv={"b": 7950},
                          candidates=["b", "c"], rng=random.Random(0))[0] == "c"


def test_when_nothing_fits_still_ranks_everyone_by_load():
    loads = {"a": load("a", running=50, free_blocks=1), "b": load("b", running=10, free_blocks=1)}
    assert choose_replica(10, 10_000, loads, {}, rng=random.Random(0)) == ["b", "a"]


def test_missing_report_counts_as_empty():
    loads = {"a": load("a", running=10)}
    assert choose_replica(5, 5, loads, {}, candidates=["a", "new"], rng=random.Random(0)) == ["new", "a"]
    # Its in-flight tokens still count (the local view when no report exists).
    assert choose_replica(5, 5, loads, {"new": 20}, candidates=["a", "new"], rng=random.Random(0))[0] == "a"


def test_burst_of_equal_requests_spreads_exactly_evenly():
    replicas = ["r0", "r1", "r2", "r3"]
    loads = {r: load(r) for r in replicas}
    in_flight: Counter[str] = Counter()
    rng = random.Random(7)
    for _ in range(100):
        best = choose_replica(64, 128, loads, in_flight, rng=rng)[0]
        in_flight[best] += 64
    assert {r: n // 64 for r, n in in_flight.items()} == {r: 25 for r in replicas}


def test_ties_are_broken_fairly():
    loads = {r: load(r, running=100) for r in "abcd"}
    firsts = Counter(choose_replica(1, 1, loads, {}, rng=random.Random(i))[0] for i in range(4000))
    assert set(firsts) == set("abcd")
    assert all(800 < n < 1200 for n in firsts.values()), firsts


def test_request_cost_from_call_shapes():
    ids = list(range(40))
    assert request_cost([ids, {"max_tokens": 20}], {}) == RequestCost(40, 60)
    assert request_cost([], {"prompt_token_ids": ids, "params": {"max_tokens": 5}}) == RequestCost(40, 45)

    class Params:
        max_tokens = 7

    assert request_cost([ids], {"sampling_params": Params()}) == RequestCost(40, 47)
    assert request_cost(["x" * 40], {}, default_max_tokens=16) == RequestCost(10, 26)
    assert request_cost([], {}) == RequestCost(0, 0)  # model_info(), check_health()
    assert request_cost([ids, {"max_tokens": "many"}], {}) == RequestCost(40, 40)
    # n samples: one prompt's blocks, n answers of KV.
    assert request_cost([ids, {"max_tokens": 20, "n": 3}], {}) == RequestCost(40, 100)
    # A batch of prompts: their tokens, and n answers for each.
    assert request_cost([[ids, ids[:10]], {"max_tokens": 20, "n": 2}], {}) == RequestCost(50, 130)


def test_power_of_two_and_round_robin():
    rng = random.Random(3)
    picks = Counter()
    for _ in range(2000):
        pair = power_of_two(["a", "b", "c"], {"a": 9, "b": 0, "c": 5}, rng)
        assert len(pair) == 2 and pair[0] != pair[1]
        picks[pair[0]] += 1
    assert picks["a"] == 0 and picks["b"] > picks["c"] > 0  # a only wins against nothing
    assert power_of_two(["x"], {}, rng) == ["x"]
    assert [round_robin(["a", "b", "c"], t)[0] for t in range(5)] == ["a", "b", "c", "a", "b"]
    assert round_robin([], 3) == []


# ---- predicted time to first token ---------------------------------------------------------


def ttft_load(waiting: int, prefill_tps: float = 0.0, drain_tps: float = 0.0, running: int = 0,
              free_blocks: int = 1000) -> ReplicaLoad:
    return ReplicaLoad(running_tokens=running, waiting_tokens=waiting, free_blocks=free_blocks,
                       total_blocks=1000, block_size=16, prefill_tps=prefill_tps, drain_tps=drain_tps)


def test_ttft_ranks_by_prompt_backlog_over_prefill_rate() -> None:
    loads = {"a": ttft_load(4000, prefill_tps=2000),   # (4000 + 100) / 2000 = 2.05 s
             "b": ttft_load(1000, prefill_tps=500),    # (1000 + 100) / 500 = 2.2 s
             "c": ttft_load(3000, prefill_tps=4000, running=50_000)}  # 0.775 s: busy streams don't delay
    assert choose_by_ttft(100, 200, loads, {}) == ["c", "a", "b"]
    # token_load would have put c last (its running streams hold 50k KV tokens)
    assert choose_replica(100, 200, loads, {})[-1] == "c"


def test_ttft_counts_unreported_prompts_and_filters_by_kv() -> None:
    loads = {"a": ttft_load(0, prefill_tps=1000), "b": ttft_load(500, prefill_tps=1000),
             "c": ttft_load(0, prefill_tps=1000, free_blocks=1)}  # 16 free KV tokens
    assert choose_by_ttft(100, 200, loads, {"a": 1000}) == ["b", "a", "c"]


def test_ttft_uses_the_drain_rate_or_the_median_rate_when_no_model_reports() -> None:
    loads = {"a": ttft_load(1000, drain_tps=100),        # 11 s
             "b": ttft_load(1000, prefill_tps=1000),     # 1.1 s
             "c": ttft_load(1500, prefill_tps=3000),     # 0.53 s
             "d": ttft_load(1000)}                       # no rate: the median (1000) -> 1.1 s
    ranked = choose_by_ttft(100, 0, loads, {}, rng=random.Random(0))
    assert ranked[0] == "c" and ranked[-1] == "a" and set(ranked[1:3]) == {"b", "d"}
    assert prefill_rate(None) == 0.0


def test_ttft_with_no_rates_at_all_is_prompt_backlog() -> None:
    loads = {"a": ttft_load(300), "b": ttft_load(200)}
    assert choose_by_ttft(10, 0, loads, {}, candidates=["a", "b", "new"]) == ["new", "b", "a"]


def test_ttft_prefers_a_replica_whose_queue_bound_admits_the_prompt() -> None:
    fast = dataclasses.replace(ttft_load(500, prefill_tps=10_000), queue_bound_tokens=1000)
    slow = dataclasses.replace(ttft_load(500, prefill_tps=1000), queue_bound_tokens=4000)
    # 500 + 800 > 1000: the fast replica would answer 429, so the slower one that admits wins.
    assert choose_by_ttft(800, 0, {"fast": fast, "slow": slow}, {}) == ["slow", "fast"]
    assert choose_by_ttft(400, 0, {"fast": fast, "slow": slow}, {}) == ["fast", "slow"]
    # A stalled queue (bound 0) admits only while empty; no bound reported (None) admits.
    stalled = dataclasses.replace(ttft_load(0, prefill_tps=10_000), queue_bound_tokens=0)
    unknown = ttft_load(500, prefill_tps=1000)
    assert unknown.queue_bound_tokens is None
    assert choose_by_ttft(400, 0, {"stalled": stalled, "unknown": unknown}, {}) == ["stalled", "unknown"]
    assert choose_by_ttft(400, 0, {"stalled": stalled, "unknown": unknown},
                          {"stalled": 100}) == ["unknown", "stalled"]  # one routed there already


# ---- prefix affinity ---------------------------------------------------------------------

def cached(rid: str, prompts: list[list[int]], running: int = 0, block: int = 16) -> ReplicaLoad:
    """A replica whose prefix cache holds the full blocks of `prompts` (its reported sketch)."""
    from replicas.scheduling.prefix_hash import PrefixSketch, block_hashes

    hashes = [h for p in prompts for h in block_hashes(p, block)]
    return dataclasses.replace(load(rid, running=running), prefix_sketch=PrefixSketch.of(hashes, 1000))


def test_a_conversations_next_turn_goes_where_its_history_is_cached():
    from autoscale.routing import choose_by_prefix, prompt_block_hashes, sketch_block_size

    turn1 = list(range(100, 420))  # 20 blocks
    turn2 = turn1 + list(range(500, 560))
    loads = {"a": cached("a", [], running=100), "b": cached("b", [turn1], running=1500),
             "c": cached("c", [turn1[:64]], running=0)}
    hashes = prompt_block_hashes(turn2, sketch_block_size(loads))
    assert len(hashes) == len(turn2) // 16
    # b holds all 20 blocks and is 1500 tokens above the least loaded: within the bound of 10%
    # of its 16000-token KV capacity.
    assert choose_by_prefix(380, 400, loads, {}, prompt_hashes=hashes, max_imbalance=0.1,
                            rng=random.Random(0)) == ["b", "c", "a"]
    # A tighter bound: b is too busy; c (4 blocks, load 0) is the best hit within it.
    assert choose_by_prefix(380, 400, loads, {}, prompt_hashes=hashes, max_imbalance=0.05,
                            rng=random.Random(0)) == ["c", "a", "b"]
    # Tokens in flight count against the bound too: 600 unreported tokens put b over 1600.
    assert choose_by_prefix(380, 400, loads, {"b": 600}, prompt_hashes=hashes, max_imbalance=0.1,
                            rng=random.Random(0))[0] == "c"
    # No hit anywhere: exactly the token-load order.
    other = prompt_block_hashes(list(range(900, 1300)), sketch_block_size(loads))
    assert choose_by_prefix(380, 400, loads, {}, prompt_hashes=other, rng=random.Random(0)) == \
        choose_replica(380, 400, loads, {}, rng=random.Random(0))


def test_prefix_affinity_never_picks_a_replica_without_kv_room():
    from autoscale.routing import choose_by_prefix, prompt_block_hashes, sketch_block_size

    turn1 = list(range(100, 420))
    full = dataclasses.replace(cached("b", [turn1]), free_blocks=1)
    loads = {"a": cached("a", []), "b": full}
    hashes = prompt_block_hashes(turn1 + [7] * 30, sketch_block_size(loads))
    assert choose_by_prefix(350, 400, loads, {}, prompt_hashes=hashes, rng=random.Random(0))[0] == "a"
    # Text prompts (no ids) and replicas without sketches give no hashes: plain token-load.
    assert prompt_block_hashes("some text", sketch_block_size(loads)) == []
    assert prompt_block_hashes(turn1, sketch_block_size({"x": load("x")})) == []


# ---- bounded cost: a sample of the candidates ---------------------------------------------

def fleet(n: int, seed: int = 0, **kw) -> dict[str, ReplicaLoad]:
    rng = random.Random(seed)
    return {f"r{i:04d}": load(f"r{i:04d}", running=rng.randrange(10_000), **kw) for i in range(n)}


def test_a_fleet_no_larger_than_the_sample_is_ranked_whole_as_before():
    loads = fleet(12)
    for seed in range(5):
        full = choose_replica(10, 10, loads, {"r0003": 500}, rng=random.Random(seed), sample_size=None)
        assert choose_replica(10, 10, loads, {"r0003": 500}, rng=random.Random(seed), sample_size=16) == full
        assert len(full) == 12 and choose_by_ttft(10, 10, loads, {}, rng=random.Random(seed), sample_size=12) == \
            choose_by_ttft(10, 10, loads, {}, rng=random.Random(seed), sample_size=None)


def test_a_large_fleet_ranks_a_seeded_sample_best_first():
    loads = fleet(1000)
    ranked = choose_replica(10, 10, loads, {}, rng=random.Random(1), sample_size=16)
    assert len(ranked) == len(set(ranked)) == 16
    assert [loads[r].running_tokens for r in ranked] == sorted(loads[r].running_tokens for r in ranked)
    assert choose_replica(10, 10, loads, {}, rng=random.Random(1), sample_size=16) == ranked  # seeded: repeatable
    assert choose_replica(10, 10, loads, {}, rng=random.Random(2), sample_size=16) != ranked


def test_the_sampled_choice_is_near_the_least_loaded():
    # The best of 16 uniform draws sits at quantile 1/17 (5.9%) of the fleet on average.
    loads = fleet(1000, seed=3)
    order = sorted(loads, key=lambda r: loads[r].running_tokens)
    quantile = {r: i / len(order) for i, r in enumerate(order)}
    rng = random.Random(4)
    firsts = [choose_replica(10, 10, loads, {}, rng=rng)[0] for _ in range(2000)]
    mean = sum(quantile[r] for r in firsts) / len(firsts)
    assert 0.045 < mean < 0.075, mean
    assert max(quantile[r] for r in firsts) < 0.4


def test_a_replica_without_kv_room_never_wins_over_one_with_whatever_the_sample():
    loads = fleet(1000, free_blocks=1)  # 16 free KV tokens each
    loads["r0777"] = load("r0777", running=9_999, free_blocks=900)  # the only one with room
    for seed in range(20):
        ranked = choose_replica(10, 100, loads, {}, rng=random.Random(seed))
        assert ranked[0] == "r0777" and len(ranked) in (16, 17)
    # Nothing fits anywhere: the sample, least loaded first (the request is still routed).
    del loads["r0777"]
    ranked = choose_replica(10, 100, loads, {}, rng=random.Random(0))
    assert len(ranked) == 16 and ranked == sorted(ranked, key=lambda r: loads[r].running_tokens)


def test_ttft_sample_prefers_the_replica_whose_queue_admits_fleet_wide():
    full = {f"q{i}": dataclasses.replace(ttft_load(900, prefill_tps=1000), queue_bound_tokens=1000)
            for i in range(500)}
    full["open"] = dataclasses.replace(ttft_load(900, prefill_tps=10), queue_bound_tokens=10_000)
    for seed in range(10):
        assert choose_by_ttft(200, 0, full, {}, rng=random.Random(seed))[0] == "open"


def test_include_is_always_ranked_besides_the_sample():
    loads = fleet(1000)
    loads["r0500"] = load("r0500", running=0)
    for seed in range(10):
        ranked = choose_replica(10, 10, loads, {}, rng=random.Random(seed), include=["r0500"])
        assert ranked[0] == "r0500"


def test_prefix_affinity_in_a_large_fleet_comes_from_the_hint():
    from autoscale.routing import choose_by_prefix, prompt_block_hashes, sketch_block_size

    prompt = list(range(100, 420))
    loads = fleet(1000)
    loads["r0042"] = cached("r0042", [prompt], running=500)
    loads = {k: v if k == "r0042" else cached(k, [], running=v.running_tokens) for k, v in loads.items()}
    hashes = prompt_block_hashes(prompt, sketch_block_size(loads))
    firsts = {choose_by_prefix(330, 400, loads, {}, prompt_hashes=hashes, rng=random.Random(s),
                               affinity=["r0042"])[0] for s in range(10)}
    assert firsts == {"r0042"}
    # Without the hint the holder is looked at only when the draw picks it (16 in 1,000).
    blind = [choose_by_prefix(330, 400, loads, {}, prompt_hashes=hashes, rng=random.Random(s))[0]
             for s in range(10)]
    assert blind.count("r0042") <= 2


def test_prefix_winner_is_the_longest_hit_ties_to_token_load_order_hint_or_not():
    from autoscale.routing import prefix_winner, prompt_block_hashes, sketch_block_size

    system = list(range(10_000, 10_000 + 16 * 8))  # 8 blocks every replica holds
    mine = system + list(range(500, 500 + 16 * 6))  # 14 blocks: this conversation's history
    loads = {"a": cached("a", [system]), "b": cached("b", [system]), "h": cached("h", [mine]),
             "x": cached("x", [])}
    hashes = prompt_block_hashes(mine + [1] * 40, sketch_block_size(loads))
    for eligible in (["a", "b", "h", "x"], ["h", "a", "b", "x"], ["x", "b", "a", "h"]):
        for affinity in ([], ["h"], ["a"], ["a", "h"], ["h", "b"]):
            assert prefix_winner(eligible, affinity, loads, hashes) == "h", (eligible, affinity)
    # Without h: a tie at the shared 8 blocks goes to the earlier replica, hinted or not.
    for affinity in ([], ["a"], ["b"], ["b", "a"]):
        assert prefix_winner(["x", "b", "a"], affinity, loads, hashes) == "b", affinity
        assert prefix_winner(["a", "b"], affinity, loads, hashes) == "a", affinity
    assert prefix_winner(["x"], ["x"], loads, hashes) is None
    assert prefix_winner(["a", "b"], [], loads, prompt_block_hashes(list(range(900, 1300)), sketch_block_size(loads))) is None
