"""A node relay forwards at most one report per replica per flush: the newest load, with every TBT
gap that came in since the last flush, none lost and none counted twice."""

from __future__ import annotations

import pytest

from autoscale.relay import ReportRelay, relay_name
from replicas.histogram import LogHistogram
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.unit


def load(tokens: int, gaps: list[float]) -> ReplicaLoad:
    return ReplicaLoad(running_tokens=tokens, tbt_histogram=LogHistogram.of(gaps) or None)


def test_newest_load_wins_and_gaps_add_up():
    relay = ReportRelay()
    relay.add("a", load(100, [0.01, 0.02]))
    relay.add("a", load(200, []))
    relay.add("b", load(50, [0.5]))
    relay.add("a", load(300, [0.03]))
    assert len(relay) == 2
    batch = dict(relay.take())
    assert batch["a"].running_tokens == 300 and batch["a"].tbt_histogram == LogHistogram.of([0.01, 0.02, 0.03])
    assert batch["b"].tbt_histogram.count == 1
    assert relay.take() == [] and len(relay) == 0


def test_discard_and_the_reply_is_the_controllers_last_period():
    relay = ReportRelay()
    assert relay.add("a", load(1, [0.1])) == 0.0
    relay.interval_s = 0.2
    assert relay.add("b", load(1, [])) == 0.2
    relay.discard("a")
    assert [r for r, _ in relay.take()] == ["b"]
    assert relay_name("ctl", "node1") == "ctl.relay.node1"
