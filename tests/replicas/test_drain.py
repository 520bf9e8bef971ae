"""The engine measures its own drain rate: a backlog lasts from the first prompt waiting for its
first token until none waits, the rate is `admission.drain_rate` over its passes, recomputed at
most every DRAIN_REFRESH_S, and the engine's queue deadline reads the same measure the replica
reports (no rate handed down from the replica)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.scheduling.drain import DRAIN_REFRESH_S, DrainMeter, newest
from replicas.loading.models import load_model


@dataclass
class Pass:
    start: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int = 0
    prefill_budget: int | None = None
    queue_held: bool = False


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.unit
def test_a_backlog_is_dated_from_when_it_formed_and_ends_when_nothing_waits() -> None:
    clock = Clock()
    meter = DrainMeter([], 256, clock)
    meter.note_backlog(False)
    assert meter.backlog_since is None
    clock.t = 1.0
    meter.note_backlog(True)
    clock.t = 1.4
    meter.note_backlog(True)
    assert meter.backlog_since == 1.0
    meter.note_backlog(False)
    assert meter.backlog_since is None


@pytest.mark.unit
def test_the_rate_is_what_the_backlog_achieved_and_is_cached_between_refreshes() -> None:
    clock = Clock()
    passes = [Pass(t / 10, 0.1, 50) for t in range(10)]  # 50 tokens every 0.1 s: 500 tokens/s
    meter = DrainMeter(passes, 256, clock)
    meter.note_backlog(True)
    clock.t = 1.0
    assert meter.rate() == pytest.approx(500.0)
    passes.append(Pass(1.0, 0.1, 200))
    clock.t = 1.0 + DRAIN_REFRESH_S / 2
    assert meter.rate() == pytest.approx(500.0)  # cached
    clock.t = 1.1
    assert meter.rate() == pytest.approx(700 / 1.1)
    meter.reset()
    assert meter.backlog_since is None
    clock.t = 10.0
    assert meter.rate() is None  # no recent pass, no backlog: nothing to go by


@pytest.mark.unit
def test_newest_reads_the_tail_in_order() -> None:
    assert newest([1, 2, 3, 4], 2) == [3, 4] and newest([1], 5) == [1] and newest([], 3) == []


@pytest.mark.engine
def test_the_engine_notes_its_backlog_until_every_prompt_has_its_first_token() -> None:
    eng = Engine(*load_model("embedded:tiny"), EngineConfig(max_batch_prefill_tokens=16, max_batch_total_tokens=1024))
    assert eng.drain.backlog_since is None
    eng.add_request(list(range(5, 45)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    formed = eng.drain.backlog_since
    assert formed is not None
    eng.step()  # 16 of 40 prompt tokens: running, still no token
    assert eng.scheduler.running and not eng.scheduler.waiting and eng.drain.backlog_since == formed
    while not eng.requests[next(iter(eng.requests))].output_token_ids:
        eng.step()
    assert eng.drain.backlog_since is None  # its first token is out: nothing waits
    eng.drain.reset()  # past the cached rate (taken before the first pass: nothing to go by)
    assert eng.drain_rate() > 0  # measured from the passes it ran
    while eng.has_unfinished():
        eng.step()
    assert eng.drain.backlog_since is None
