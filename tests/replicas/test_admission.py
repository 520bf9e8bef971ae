"""Token admission is one rule wherever it runs: an empty queue takes anything, otherwise the
queue stays within a bound that is what drains within the deadline (at most max_queued_tokens),
and a refusal's Retry-After is the excess over the measured drain rate."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from replicas.scheduling.admission import (MAX_RETRY_AFTER_S, MIN_BACKLOG_S, QUEUE_FILL, STALLED_RETRY_AFTER_S,
                                QueueView, admits, door_decision, drain_rate, queue_bound,
                                retry_after_s)

pytestmark = pytest.mark.unit


@dataclass
class Pass:
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    prefill_budget: int | None = None
    queue_held: bool = False


def test_admits_empty_queue_always_and_otherwise_within_the_bound() -> None:
    assert admits(0, 10_000, 64)
    assert admits(24, 40, 64)
    assert not admits(25, 40, 64)


def test_drain_rate_with_a_backlog_is_the_achieved_prefill_rate() -> None:
    # 10 passes of 0.1 s, back to back, 50 prefill tokens each: 500 tokens/s.
    passes = [Pass(t / 10, 0.1, 50, 4) for t in range(10)]
    assert abs(drain_rate(passes, 256, backlog_since=0.0, now=1.0) - 500.0) < 1e-6


def test_drain_rate_without_a_backlog_counts_the_budget_left_after_decodes() -> None:
    passes = [Pass(t / 10, 0.1, 0, 56) for t in range(10)]  # decodes only: 200 left per pass
    assert abs(drain_rate(passes, 256, backlog_since=None, now=1.0) - 2000.0) < 1e-6
    assert drain_rate(passes, 256, backlog_since=0.0, now=1.0) == 0.0  # a blocked queue drains nothing


def test_a_full_pass_costs_what_prefilling_passes_cost_per_token() -> None:
    """Quick decode-only passes do not promise a quick prefill: with passes that prefilled in the
    window, a full budget is priced at their per-token time (a burst admitted on the decode-only
    promise waited past its deadline)."""
    decodes = [Pass(t / 10, 0.02, 0, 20) for t in range(8)]  # 20 ms with 20 decodes
    prefill = [Pass(0.8 + t / 10, 0.2, 80, 20) for t in range(2)]  # 200 ms with 80 prompt tokens
    rate = drain_rate(decodes + prefill, 256, backlog_since=None, now=1.0)
    per_token = 0.4 / 200  # the prefilling passes: 400 ms for 200 tokens
    assert rate is not None and abs(rate - (256 - 20) / (256 * per_token)) < 1e-6
    assert rate < (256 - 20) / 0.02 / 10  # a tenth of what the decode-only passes promised


def test_under_a_tbt_slo_a_full_pass_is_the_prompt_budget_the_slo_gave() -> None:
    """With many streams decoding the SLO leaves a pass few prompt tokens: the capacity is priced
    with those, not with the fixed budget (a burst admitted on the fixed one waited past its
    deadline)."""
    passes = [Pass(t / 10, 0.1, 30, 60, prefill_budget=30) for t in range(10)]
    rate = drain_rate(passes, 512, backlog_since=None, now=1.0)
    per_token = 1.0 / 900  # 10 passes of 90 tokens in 1 s
    assert rate is not None and abs(rate - 30 / (90 * per_token)) < 1e-6  # 300 tokens/s
    fixed = drain_rate([Pass(t / 10, 0.1, 30, 60) for t in range(10)], 512, backlog_since=None, now=1.0)
    assert fixed is not None and abs(fixed - 452 / (512 * per_token)) < 1e-6 and rate < fixed / 2


def test_drain_rate_only_reads_the_recent_window() -> None:
    passes = [Pass(0.0, 0.1, 1000, 0), Pass(9.5, 0.1, 100, 0)]
    assert abs(drain_rate(passes, 256, backlog_since=0.0, now=10.0, window_s=2.0) - 50.0) < 1e-6
    assert drain_rate(passes, 256, backlog_since=0.0, now=20.0) == 0.0  # nothing ran, queue waits: stalled
    assert drain_rate(passes, 256, backlog_since=None, now=20.0) is None  # idle: nothing to go by


def test_drain_rate_of_a_backlog_counts_only_the_time_since_it_formed() -> None:
    # A quiet replica decoding (8 decodes a pass, 20 passes over 2 s), then a burst queues at
    # t = 2.0: the quiet passes before it are not held against the burst.
    quiet = [Pass(t / 10, 0.05, 0, 8) for t in range(20)]
    burst = [Pass(2.0 + t / 10, 0.05, 256, 8) for t in range(8)]  # 256 prompt tokens a 0.1 s
    now = 2.8
    assert abs(drain_rate(quiet + burst, 256, backlog_since=2.0, now=now) - 8 * 256 / 0.8) < 1e-6
    # Young (under MIN_BACKLOG_S): judged by the recent passes' capacity, not by what it achieved
    # so far (nothing yet: the burst's first pass has not run).
    young = drain_rate(quiet, 256, backlog_since=1.95, now=2.0)
    assert young is not None and abs(young - (256 - 8) / 0.05) < 1e-6
    # The same backlog once old enough, still with nothing prefilled: stalled.
    assert drain_rate(quiet, 256, backlog_since=2.0 - MIN_BACKLOG_S, now=2.0) == 0.0
    # A young backlog on an idle replica: nothing measured.
    assert drain_rate([], 256, backlog_since=1.9, now=2.0) is None


def test_a_long_pass_in_progress_is_not_a_stalled_queue() -> None:
    """A whole long prompt prefilling in one pass (dynamic, seconds on a CPU) while another waits:
    the backlog is judged by the passes completed before that one began, not as stalled."""
    before = [Pass(t / 10, 0.1, 50, 4) for t in range(10)]  # 500 prompt tokens/s until t = 1.0
    # The long pass began at t = 1.0; a request has waited since t = 1.2; now t = 3.5.
    assert drain_rate(before, 256, backlog_since=1.2, now=3.5) == 0.0  # without knowing: "stalled"
    young = drain_rate(before, 256, backlog_since=1.2, now=3.5, running_since=1.0)
    # The capacity of the passes before: the budget left after 4 decodes, at their per-token time.
    assert young is not None and abs(young - (256 - 4) / (256 * 0.1 / 54)) < 1e-6
    # A backlog that formed before the long pass began, aged through completed passes, is judged
    # by what those achieved, up to when the long pass began.
    aged = drain_rate(before, 256, backlog_since=0.2, now=3.5, running_since=1.0)
    assert aged is not None and abs(aged - 500.0) < 1e-6
    # Passes keep completing with nothing prefilled (blocked on KV): still a stall.
    blocked = [Pass(1.0 + t / 10, 0.1, 0, 8) for t in range(20)]
    assert drain_rate(before + blocked, 256, backlog_since=1.2, now=3.05, running_since=3.0) == 0.0


def test_a_queue_whose_head_the_slo_holds_back_drains_nothing() -> None:
    """SLO admission held the head in the newest pass: no one starts until a stream ends, so
    the rate is 0.0 however young the backlog and whatever the passes prefilled (chunks of
    prompts already started); without a backlog the hold means nothing."""
    passes = [Pass(t / 10, 0.1, 50, 8, queue_held=t == 3) for t in range(9)] + [Pass(0.9, 0.1, 50, 8, queue_held=True)]
    assert drain_rate(passes, 256, backlog_since=0.95, now=1.0) == 0.0
    assert drain_rate(passes, 256, backlog_since=0.0, now=1.0) == 0.0
    passes[-1].queue_held = False
    # Held lately, the queue empty or young: the rate achieved (500 tokens/s), not the capacity.
    assert abs(drain_rate(passes, 256, backlog_since=0.95, now=1.0) - 500.0) < 1e-6
    assert abs(drain_rate(passes, 256, backlog_since=None, now=1.0) - 500.0) < 1e-6
    passes[3].queue_held = False
    # Not held: the capacity, 248 prompt tokens in a 256-token pass at 0.1 s per 58 tokens.
    assert abs(drain_rate(passes, 256, backlog_since=None, now=1.0) - 248 * 58 / 25.6) < 1e-6


def test_queue_bound_is_what_drains_within_the_deadline_capped() -> None:
    assert queue_bound(32_768, 1000.0, None) == 32_768  # no deadline: the cap
    assert queue_bound(32_768, 1000.0, 10.0) == int(1000 * 10 * QUEUE_FILL) == 2500
    assert queue_bound(2048, 1000.0, 10.0) == 2048  # never above the cap
    assert queue_bound(32_768, 4.0, 10.0) == 10  # a slow queue takes what drains in time
    assert queue_bound(32_768, None, 10.0) == 32_768  # nothing measured yet: the cap
    assert queue_bound(32_768, 0.0, 10.0) == 0  # a stalled queue: only an empty one admits
    assert admits(0, 500, 0) and not admits(1, 1, 0)


def test_retry_after_is_the_excess_over_the_drain_rate_in_whole_seconds() -> None:
    assert retry_after_s(2500, 1000.0) == 3
    assert retry_after_s(1, 1000.0) == 1
    assert retry_after_s(10**9, 1.0) == MAX_RETRY_AFTER_S
    assert retry_after_s(100, 0.0) == retry_after_s(100, None) == STALLED_RETRY_AFTER_S


def test_door_sums_the_replicas_queues() -> None:
    views = [QueueView(100, 300, 100.0), QueueView(250, 300, 50.0)]  # 350 of 600 queued
    ok = door_decision(250, views)
    assert ok.admitted and (ok.queued_tokens, ok.bound_tokens) == (350, 600)
    refused = door_decision(251, views, unreflected_tokens=100)  # 450 + 251 - 600 = 101 over
    assert not refused.admitted and refused.retry_after_s == 1  # 101 tokens at 150 tok/s
    far = door_decision(1000, views, unreflected_tokens=200)  # 1550 - 600 = 950 over: 7 s
    assert far.retry_after_s == 7


def test_door_without_a_view_admits_and_an_empty_cluster_takes_a_long_prompt() -> None:
    assert door_decision(10**6, []).admitted
    assert door_decision(10**6, [QueueView(0, 300, 10.0)]).admitted
