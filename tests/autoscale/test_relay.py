"""A node relay forwards at most one report per replica per flush: the newest load, and every TBT
gap that came in since the last flush merged per deployment, none lost and none counted twice."""

from __future__ import annotations

import pytest

from autoscale.controller import DEFAULT_MAX_REPORTS_PER_S, LoadBook
from autoscale.relay import ReportRelay, hub_index, hub_name, relay_name
from replicas.scheduling.histogram import LogHistogram
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.unit


def load(tokens: int, gaps: list[float]) -> ReplicaLoad:
    return ReplicaLoad(running_tokens=tokens, tbt_histogram=LogHistogram.of(gaps) or None)


def test_newest_load_wins_and_gaps_add_up_per_deployment():
    relay = ReportRelay()
    first = load(100, [0.01, 0.02])
    relay.add("app#D#a", first)
    relay.add("app#D#a", load(200, []))
    relay.add("app#D#b", load(50, [0.5]))
    relay.add("app#D#a", load(300, [0.03]))
    relay.add("app#E#c", load(7, [0.2, 0.2]))
    loads, tbt, calls, _ = relay.take()
    loads = dict(loads)
    assert {r: x.running_tokens for r, x in loads.items()} == {"app#D#a": 300, "app#D#b": 50, "app#E#c": 7}
    assert all(x.tbt_histogram is None and x.replica_id == r for r, x in loads.items())
    assert tbt == {"app#D": LogHistogram.of([0.01, 0.02, 0.03, 0.5]), "app#E": LogHistogram.of([0.2, 0.2])}
    assert first.tbt_histogram == LogHistogram.of([0.01, 0.02])  # the sender's histogram is not merged into
    assert calls == 1 and relay.take() == ([], {}, 1, []) and len(relay) == 0


def test_a_report_overtaken_by_a_later_one_adds_only_its_gaps():
    """A replica's reports come by datagram and, once a heartbeat, by actor call: a call may land
    after a later datagram. The newest load (by its timestamp) is kept; every gap still counts."""
    relay = ReportRelay()
    relay.add("app#D#a", ReplicaLoad(running_tokens=300, tbt_histogram=LogHistogram.of([0.03]), timestamp=2.0))
    relay.add("app#D#a", ReplicaLoad(running_tokens=100, tbt_histogram=LogHistogram.of([0.01]), timestamp=1.0))
    loads, tbt, _, _ = relay.take()
    assert [(r, x.running_tokens) for r, x in loads] == [("app#D#a", 300)]
    assert tbt == {"app#D": LogHistogram.of([0.01, 0.03])}


def test_the_controller_keeps_the_same_through_a_relay():
    """A relay's batch gives the controller the loads and the TBT window that the same reports
    sent one by one give."""
    reports = [("app#D#a", load(100, [0.01, 0.02])), ("app#D#b", load(50, [0.5])), ("app#D#a", load(300, [0.03])),
               ("app#E#c", load(7, [0.2, 0.2]))]
    direct, relayed, relay = LoadBook(clock=lambda: 10.0), LoadBook(clock=lambda: 10.0), ReportRelay()
    for replica_id, x in reports:
        direct.report(replica_id, x)
        relay.add(replica_id, x)
    relayed.report_many(*relay.take())
    for book_a, book_b in ((direct.snapshot(), relayed.snapshot()), (direct.snapshot(["app#E#c"]),
                                                                     relayed.snapshot(["app#E#c"]))):
        assert book_a == book_b
    assert relayed.snapshot(["app#E#c"]).num_tbt_samples == 2 and relayed.snapshot().num_tbt_samples == 6


def test_discard_keeps_the_gaps_and_the_reply_is_the_controllers_last_period():
    relay = ReportRelay()
    assert relay.add("app#D#a", load(1, [0.1])) == 0.0
    relay.interval_s = 0.2
    assert relay.add("app#D#b", load(1, [])) == 0.2
    relay.discard("app#D#a")
    loads, tbt, _, _ = relay.take()
    assert [r for r, _ in loads] == ["app#D#b"] and tbt == {"app#D": LogHistogram.of([0.1])}
    assert relay_name("ctl", "node1") == "ctl.relay.node1" and hub_name("ctl", 2) == "ctl.relay.hub2"


def test_a_hub_merges_node_relays_flushes_as_the_controller_would_take_them():
    """Two node relays' flushes through a hub: the newest load per replica, the gaps per
    deployment summed, the flushes counted; the controller's book ends as with no hub."""
    node_a, node_b, hub = ReportRelay(), ReportRelay(), ReportRelay()
    node_a.add("app#D#a", load(100, [0.01]))
    node_b.add("app#D#b", load(50, [0.5, 0.02]))
    assert hub.add_many(*node_a.take()) == (0.0, None)  # nothing heard from the controller yet
    node_a.add("app#D#a", load(120, [0.03]))
    hub.add_many(*node_a.take())
    hub.add_many(*node_b.take())
    loads, tbt, calls, _ = hub.take()
    assert calls == 3 and {r: x.running_tokens for r, x in loads} == {"app#D#a": 120, "app#D#b": 50}
    assert tbt == {"app#D": LogHistogram.of([0.01, 0.03, 0.5, 0.02])}
    book = LoadBook(clock=lambda: 10.0)
    assert book.report_many(loads, tbt, calls) == (pytest.approx(2 / DEFAULT_MAX_REPORTS_PER_S), 0)
    assert book.snapshot().num_tbt_samples == 4 and book.snapshot().token_load == 170


def test_replies_carry_the_hubs_and_a_hub_that_has_not_heard_keeps_them():
    relay = ReportRelay()
    relay.took_reply((0.1, 3))
    assert relay.interval_s == 0.1 and relay.hubs == 3
    relay.took_reply((0.2, None))  # from a hub that has not heard from the controller yet
    assert relay.interval_s == 0.2 and relay.hubs == 3
    relay.took_reply((0.2, 0))
    assert relay.hubs == 0
    relay.took_reply((0.2, 3))
    relay.took_reply(0.3)  # a controller from before hubs (detached, still running): straight to it
    assert relay.interval_s == 0.3 and relay.hubs == 0
    # Nodes spread over the hubs, each always to the same one.
    picks = [hub_index(f"node{i:03d}", 4) for i in range(400)]
    assert picks == [hub_index(f"node{i:03d}", 4) for i in range(400)]
    assert all(60 <= picks.count(k) <= 140 for k in range(4))


def test_demand_rides_the_relays_to_the_controller_newest_first_in_any_order():
    """An engine replica's ingress sends its demand counters with its load reports: a node
    relay keeps each source's newest (counters only grow: field by field the larger, so a call
    overtaken by a later datagram changes nothing), a hub merges node relays' the same way, and
    the controller's demand log gets each source's growth once."""
    from autoscale.demand import DemandCounts

    old, new = DemandCounts(served_tokens=100, served_requests=1), DemandCounts(served_tokens=300, served_requests=3,
                                                                              refused_tokens=50)
    node_a, node_b, hub = ReportRelay(), ReportRelay(), ReportRelay()
    node_a.add("app#D#a", load(1, []), [("app#D", "ingress:a", new)])
    node_a.add("app#D#a", load(1, []), [("app#D", "ingress:a", old)])  # overtaken: changes nothing
    node_b.add_demand("app#D", "ingress:b", old)
    assert len(node_b) == 1  # demand alone is something to flush
    assert node_a.take()[3] == [("app#D", "ingress:a", new)]
    node_a.add("app#D#a", load(1, []), [("app#D", "ingress:a", old)])
    hub.add_many(*node_a.take())
    hub.add_many(*node_b.take())
    hub.add_many([], {}, 1, [("app#D", "ingress:a", new)])
    demand = hub.take()[3]
    assert sorted(demand) == [("app#D", "ingress:a", new), ("app#D", "ingress:b", old)]

    now = [10.0]
    book = LoadBook(clock=lambda: now[0])
    book.report_many([], {}, 1, [("app#D", "ingress:a", old)])  # the source's baseline (the log starts at 10)
    for entry in (new, old):  # the late old one: no growth, none taken back
        now[0] += 1
        book.report_many([], {}, 1, [("app#D", "ingress:a", entry)])
    now[0] += 1
    book.report("app#D#a", load(1, []), [("app#D", "ingress:a", new)])
    now[0] = 14.0
    snap = book.snapshot()  # the demand log's rates over (10, 14]: the growth once
    assert (snap.served_tps, snap.refused_tps) == (200 / 4, 50 / 4)
