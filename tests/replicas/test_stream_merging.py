"""A stream interval's merging (`outputs.merged_due`): a running stream's delta goes out at the
pass end nearest its due time, so its chunks come about an interval apart: not nearly two
intervals apart when passes are steadily a little shorter than the interval."""

from __future__ import annotations

import random

import pytest

from replicas.outputs import merged_due

pytestmark = pytest.mark.unit

MS = 1e-3


def chunk_gaps(landings: list[float], interval: float) -> list[float]:
    """The gaps between a stream's chunks when it gets a token at every landing (the first sent
    at the first landing), as the engine's postprocess decides them."""
    sent = last = landings[0]
    gaps = []
    for now in landings[1:]:
        if sent <= merged_due(now, last, interval):
            gaps.append(now - sent)
            sent = now
        last = now
    return gaps


def every(cadence: float, n: int = 200) -> list[float]:
    return [i * cadence for i in range(n)]


@pytest.mark.parametrize("cadence_ms, gap_ms", [
    (45, 45),  # held until due, the chunk would wait for the next pass: 90 ms apart
    (40, 40),  # (80)
    (30, 60),  # 60 overshoots by 10, 30 would fall short by 20: the nearer
    (10, 50),
    (7, 49),   # 49 is nearer 50 than 56
    (60, 60),  # passes longer than the interval: every pass
])
def test_chunks_go_at_the_pass_nearest_the_interval(cadence_ms, gap_ms) -> None:
    gaps = chunk_gaps(every(cadence_ms * MS), 50 * MS)
    assert gaps and all(g == pytest.approx(gap_ms * MS) for g in gaps)


def test_uneven_passes_keep_chunks_nearer_the_interval_than_holding_them_until_due() -> None:
    """Passes of 1-45 ms, each independent of the last (the worst case for taking the next pass
    to be as long as the last one): the chunks come an interval apart on average, where held
    until due they come an interval plus half a pass apart, and their tail is shorter."""
    rng = random.Random(0)
    interval = 50 * MS
    landings = [0.0]
    for _ in range(5000):
        landings.append(landings[-1] + rng.uniform(1, 45) * MS)
    gaps = chunk_gaps(landings, interval)
    longest_pass = max(b - a for a, b in zip(landings, landings[1:]))
    assert all(interval / 2 - 1e-12 <= g <= interval + longest_pass + 1e-12 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert 0.95 * interval <= mean <= 1.05 * interval  # one chunk an interval
    # Held until due, the same passes give gaps up to the interval plus a whole pass.
    held = []
    sent = landings[0]
    for now in landings[1:]:
        if sent <= now - interval:
            held.append(now - sent)
            sent = now
    assert sum(held) / len(held) > 1.2 * interval
    for q in (0.9, 0.99):
        assert sorted(gaps)[int(q * len(gaps))] < sorted(held)[int(q * len(held))] - 5 * MS


def test_no_interval_is_every_pass() -> None:
    assert chunk_gaps(every(3 * MS, 20), 0.0) == pytest.approx([3 * MS] * 19)
    assert merged_due(5.0, float("-inf"), 0.0) == 5.0

