"""Routing choices as pure functions of a load view: token-load, predicted TTFT, prefix
affinity, power-of-two, round-robin.

`choose_replica` is the policy the Serve router runs; the other two are the baselines it is
compared against (Serve's default is power-of-two on ongoing-request counts). The simulator
calls the same functions, so a routing experiment there measures exactly what Serve runs.

Token-load ranking. For each candidate replica r:

    predicted(r) = reported token load(r) + tokens routed to r not yet in a report + request

Replicas whose KV cache cannot hold the request (prompt + max_tokens) are ranked after every
replica that can; a replica we have no report for counts as empty with unknown (unbounded)
headroom, so a fresh replica takes traffic at once. Equal predictions are ordered at random, so
a burst of equal requests spreads evenly instead of piling onto the first replica in the list.

Bounded cost. A decision ranks a random sample of `sample_size` candidates (power of d choices;
16 by default, see `RouterTuning`), not the fleet: its cost does not grow with the fleet. A
fleet no larger than the sample is ranked whole, exactly as a full ranking. The KV filter holds
fleet-wide: when no sampled replica has room, the rest are scanned for one that has (`_rank`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoscale.router_tuning import RouterTuning
from replicas.scheduling.admission import admits
from replicas.scheduling.prefix_hash import block_hashes
from replicas.protocol import ReplicaLoad

CHARS_PER_TOKEN = 4  # a text prompt's token estimate when the caller did not tokenize
# The defaults are the router's (RouterTuning): one source for both.
SAMPLE_SIZE = RouterTuning.sample_size
DEFAULT_PREFIX_IMBALANCE = RouterTuning.prefix_imbalance


@dataclass(frozen=True)
class RequestCost:
    """What one request adds: `tokens` to the token load, `kv_tokens` of KV it may need."""

    tokens: int
    kv_tokens: int


def request_cost(args: Sequence[Any], kwargs: Mapping[str, Any], default_max_tokens: int = 0) -> RequestCost:
    """Estimate a handle call's cost from its arguments, tolerating any call shape.

    Expected shape (the replica's `generate(prompt_token_ids, params, ...)`): the prompt as the
    first positional argument or `prompt_token_ids=` (a list of ids, or a string, estimated at
    4 characters per token), and sampling params as the second positional argument or
    `params=` / `sampling_params=` (a dict or an object with `max_tokens` and optionally `n`). Anything else, e.g.
    `model_info()`, costs zero tokens.
    """
    prompt = prompt_of(args, kwargs)
    num_prompts = 1
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple)):
        tokens, num_prompts = sum(len(p) for p in prompt), len(prompt)  # a batch of prompts
    elif isinstance(prompt, (list, tuple)):
        tokens = len(prompt)
    elif isinstance(prompt, str):
        tokens = math.ceil(len(prompt) / CHARS_PER_TOKEN)
    else:
        tokens = 0
    params = kwargs.get("params", kwargs.get("sampling_params", args[1] if len(args) > 1 else None))
    if isinstance(params, Mapping):
        max_tokens = params.get("max_tokens")
    else:
        max_tokens = getattr(params, "max_tokens", None)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = default_max_tokens
    n = params.get("n", 1) if isinstance(params, Mapping) else getattr(params, "n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        n = 1
    # n samples share their prompt's KV blocks (a fork through the prefix cache); each generates.
    return RequestCost(tokens, tokens + num_prompts * n * max_tokens if tokens else 0)


def prompt_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The prompt of a `generate(prompt_token_ids, params, ...)` handle call, if it has one."""
    return kwargs.get("prompt_token_ids", kwargs.get("prompt", args[0] if args else None))


def sketch_block_size(loads: Mapping[str, ReplicaLoad]) -> int | None:
    """The block size the replicas' prefix sketches name blocks by; None without a sketch or
    when replicas disagree. O(replicas): the router asks once per snapshot, not per request."""
    sizes = {load.block_size for load in loads.values() if load.prefix_sketch is not None}
    return sizes.pop() if len(sizes) == 1 else None


def prompt_block_hashes(prompt: Any, block_size: int | None) -> list[int]:
    """The prompt's block hashes as the replicas name their cached blocks (`sketch_block_size`),
    for `choose_by_prefix`; empty without token ids or a block size."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple)):
        prompt = prompt[0]  # a batch goes to one replica: its first prompt stands for it
    if block_size is None or not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], int):
        return []
    return block_hashes(prompt, block_size)


def predicted_load(load: ReplicaLoad | None, in_flight_tokens: int = 0) -> int:
    """Token load a replica will have once the tokens routed to it show up in its report."""
    return (load.token_load if load is not None else 0) + in_flight_tokens


def kv_headroom(load: ReplicaLoad | None, in_flight_kv_tokens: int = 0) -> float:
    """KV tokens still free after the queued prompts and unreported requests take theirs.

    Unknown (no report, or a report without a KV size) is unbounded: never excluded.
    """
    if load is None or load.total_blocks <= 0:
        return math.inf
    return load.free_kv_tokens - load.waiting_tokens - in_flight_kv_tokens


def sample_candidates(candidates: Sequence[str], sample_size: int | None, rng: random.Random,
                      include: Sequence[str] = ()) -> list[str]:
    """The replicas one decision ranks: `sample_size` candidates drawn uniformly without
    replacement, plus `include` (candidates the caller wants looked at whatever the draw, e.g.
    where the prompt's prefix went). Every candidate when `sample_size` is None or not smaller
    than their number, with no draw, so a small fleet is ranked whole as before."""
    if sample_size is None or len(candidates) <= sample_size:
        return list(candidates)
    pool = rng.sample(candidates, sample_size)
    pool += [r for r in dict.fromkeys(include) if r not in pool]
    return pool


def _rank(pool: list[str], candidates: Sequence[str], key: Callable[[str], tuple[int, float]],
          rng: random.Random) -> list[str]:
    """`pool` best first by `key` = (penalty, score), lower better, equal keys in random order.

    A penalty above 0 marks a replica that fails a filter (no KV room, a queue that would
    refuse). When the best of the pool has one and `candidates` has replicas the pool did not
    draw, those are scanned from a random start for the least penalty (stopping at the first
    with none) and the find goes first: a sample never makes a replica that fails a filter win
    over one that passes it. The scan costs O(candidates) only when almost every replica fails.
    """
    keys = {r: (*key(r), rng.random()) for r in pool}
    ranked = sorted(keys, key=keys.__getitem__)
    penalty = keys[ranked[0]][0] if ranked else 0
    if penalty == 0 or len(keys) >= len(candidates):
        return ranked
    start, found = rng.randrange(len(candidates)), None
    for i in range(len(candidates)):
        r = candidates[(start + i) % len(candidates)]
        if r in keys:
            continue
        p = key(r)[0]
        if p < penalty:
            penalty, found = p, r
            if p == 0:
                break
    return ranked if found is None else [found] + ranked


def _all_candidates(candidates: Sequence[str] | None, loads: Mapping[str, ReplicaLoad],
                    in_flight: Mapping[str, int]) -> Sequence[str]:
    if candidates is not None:
        return candidates
    return [*loads, *(r for r in in_flight if r not in loads)]


def choose_replica(request_tokens: int, request_kv_tokens: int, loads: Mapping[str, ReplicaLoad],
                   in_flight: Mapping[str, int], *, candidates: Sequence[str] | None = None,
                   in_flight_kv: Mapping[str, int] | None = None, rng: random.Random | None = None,
                   sample_size: int | None = SAMPLE_SIZE, include: Sequence[str] = ()) -> list[str]:
    """Rank a sample of the candidates, best first, by predicted token load after adding this
    request (see `sample_candidates`: `sample_size` None ranks them all).

    `in_flight[r]`: tokens routed to r that r's report does not reflect yet (KV needs of those in
    `in_flight_kv`, default the same numbers). `candidates` defaults to every replica named in
    `loads` or `in_flight`. Replicas without KV headroom for `request_kv_tokens` come last
    (still ranked, so the request is never refused while any replica exists), and one without
    never wins over one with, sampled or not (`_rank`).
    """
    candidates = _all_candidates(candidates, loads, in_flight)
    in_flight_kv = in_flight if in_flight_kv is None else in_flight_kv
    rng = rng or random.Random()

    def key(replica: str) -> tuple[int, float]:
        load = loads.get(replica)
        fits = kv_headroom(load, in_flight_kv.get(replica, 0)) >= request_kv_tokens
        return (0 if fits else 1, predicted_load(load, in_flight.get(replica, 0)) + request_tokens)

    return _rank(sample_candidates(candidates, sample_size, rng, include), candidates, key, rng)


def prefill_rate(load: ReplicaLoad | None) -> float:
    """Prompt tokens per second a replica prefills: its pass-time model's rate, else its
    measured drain rate; 0 when it has reported neither."""
    if load is None:
        return 0.0
    return load.prefill_tps or load.drain_tps


def choose_by_ttft(request_tokens: int, request_kv_tokens: int, loads: Mapping[str, ReplicaLoad],
                   in_flight: Mapping[str, int], *, candidates: Sequence[str] | None = None,
                   in_flight_kv: Mapping[str, int] | None = None, rng: random.Random | None = None,
                   sample_size: int | None = SAMPLE_SIZE) -> list[str]:
    """Rank a sample of the candidates (as `choose_replica`), best first, by predicted time to
    first token of this request:

        (waiting prompt tokens + tokens routed there not yet reported + this prompt) / prefill rate

    Under stall_free a new prompt waits for the prompts queued ahead of it, not for the running
    streams (their KV is what token load counts), and a faster replica drains its queue sooner.
    A replica with no known rate gets the median of the sample's known ones (all unknown:
    1 token/s, i.e. plain prompt backlog). KV headroom filters as in `choose_replica`, then
    whether the replica's queue bound (`queue_bound_tokens`) admits the prompt on top of its
    backlog (one that would answer 429 comes after every one that would not); ties are random.
    """
    candidates = _all_candidates(candidates, loads, in_flight)
    in_flight_kv = in_flight if in_flight_kv is None else in_flight_kv
    rng = rng or random.Random()
    pool = sample_candidates(candidates, sample_size, rng)
    known = sorted(r for r in (prefill_rate(loads.get(c)) for c in pool) if r > 0)
    default = known[len(known) // 2] if known else 1.0

    def key(replica: str) -> tuple[int, float]:
        load = loads.get(replica)
        fits = kv_headroom(load, in_flight_kv.get(replica, 0)) >= request_kv_tokens
        queued = (load.waiting_tokens if load is not None else 0) + in_flight.get(replica, 0)
        bound = load.queue_bound_tokens if load is not None else None
        ok = bound is None or admits(queued, request_tokens, bound)
        return (2 * (not fits) + (not ok), (queued + request_tokens) / (prefill_rate(load) or default))

    return _rank(pool, candidates, key, rng)


def prefix_winner(eligible: Sequence[str], affinity: Sequence[str], loads: Mapping[str, ReplicaLoad],
                  prompt_hashes: Sequence[int]) -> str | None:
    """The replica among `eligible` (in token-load order) whose reported sketch holds the most
    leading blocks of the prompt, ties to the earlier one; None when none holds any.

    Exact, at a few sketch probes a replica: in order, a replica can only take the lead with
    more blocks than the leader, so one probe of the next block rules most out. The hinted
    replicas (`affinity`) come last, so the usual winner (the hint, holding the longest prefix)
    is asked only for the blocks it needs to win, not for its whole hit.
    """
    order = {r: i for i, r in enumerate(eligible)}
    best, first = 0, None
    n = len(prompt_hashes)
    hinted = [r for r in eligible if r in affinity]
    for r in eligible:
        sketch = loads[r].prefix_sketch if r in loads else None
        if sketch is None or r in affinity or best >= n or not sketch.matched_blocks(prompt_hashes[best:best + 1]):
            continue
        hit = sketch.matched_blocks(prompt_hashes)
        if hit > best:
            best, first = hit, r
    for i, r in enumerate(hinted):
        sketch = loads[r].prefix_sketch if r in loads else None
        if sketch is None:
            continue
        if i < len(hinted) - 1:  # another hint follows: it needs this one's exact hit
            hit = sketch.matched_blocks(prompt_hashes)
            if hit > best or (hit == best > 0 and first is not None and order[r] < order[first]):
                best, first = hit, r
            continue
        need = 1 if first is None else best + (order[r] > order[first])
        if need <= n and sketch.matched_blocks(prompt_hashes[:need]) == need:
            first = r
    return first


def choose_by_prefix(request_tokens: int, request_kv_tokens: int, loads: Mapping[str, ReplicaLoad],
                     in_flight: Mapping[str, int], *, prompt_hashes: Sequence[int] = (),
                     max_imbalance: float = DEFAULT_PREFIX_IMBALANCE,
                     candidates: Sequence[str] | None = None,
                     in_flight_kv: Mapping[str, int] | None = None, rng: random.Random | None = None,
                     sample_size: int | None = SAMPLE_SIZE, affinity: Sequence[str] = ()) -> list[str]:
    """Rank candidates, best first: the replica holding the longest cached prefix of the prompt
    (its reported `prefix_sketch`, asked with `prompt_hashes`), unless its predicted token load
    is above the least loaded replica's (among those that fit) by more than `max_imbalance` of
    that replica's KV capacity; then the token-load order of `choose_replica`.

    The replicas looked at are `choose_replica`'s sample plus `affinity`: candidates likely to
    hold the prefix (the router remembers where it sent prompts, `PrefixHints`), so a decision
    asks a bounded number of sketches; "least loaded" is the least loaded of those.

    The bound is the trade-off made explicit: a cache hit saves the hit's prefill, while piling
    every conversation onto one replica costs everyone's TBT there. A share of KV capacity
    rather than a token count, so one setting fits a CPU replica of 8k KV tokens and a GPU one
    of 500k. With no hit anywhere (or `max_imbalance` 0 and unequal loads) this is exactly
    `choose_replica`.
    """
    ranked = choose_replica(request_tokens, request_kv_tokens, loads, in_flight, candidates=candidates,
                            in_flight_kv=in_flight_kv, rng=rng, sample_size=sample_size, include=affinity)
    if not ranked or not prompt_hashes:
        return ranked
    in_flight_kv = in_flight if in_flight_kv is None else in_flight_kv

    def fits(r: str) -> bool:
        return kv_headroom(loads.get(r), in_flight_kv.get(r, 0)) >= request_kv_tokens

    def load_of(r: str) -> int:
        return predicted_load(loads.get(r), in_flight.get(r, 0))

    fitting = [r for r in ranked if fits(r)]
    if not fitting:
        return ranked
    least = fitting[0]  # ranked puts the least loaded replica that fits first
    reported = loads.get(least)
    capacity = reported.total_blocks * reported.block_size if reported is not None else 0
    bound = load_of(least) + max_imbalance * capacity
    first = prefix_winner([r for r in fitting if load_of(r) <= bound], affinity, loads, prompt_hashes)
    if first is None:
        return ranked
    return [first] + [r for r in ranked if r != first]


def power_of_two(candidates: Sequence[str], queue_lens: Mapping[str, float],
                 rng: random.Random | None = None) -> list[str]:
    """Serve's default idea: sample two replicas, the shorter queue (ongoing requests) first."""
    rng = rng or random.Random()
    if len(candidates) <= 1:
        return list(candidates)
    pair = rng.sample(list(candidates), 2)  # random order, so equal queues split evenly
    return sorted(pair, key=lambda r: queue_lens.get(r, 0))


def round_robin(candidates: Sequence[str], turn: int) -> list[str]:
    """Rotate through candidates: the caller increments `turn` once per request."""
    if not candidates:
        return []
    start = turn % len(candidates)
    return list(candidates[start:]) + list(candidates[:start])
