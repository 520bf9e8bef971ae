"""The controller holds each live replica's latest load and, per deployment, a window of TBT
histograms; it aggregates p50/p99 (within the histogram's 0.99%) and SLO attainment over it,
forgets replicas that stop reporting, and answers each report with the period the fleet can
afford; as a Ray actor it is found by name from anywhere and fed by `LoadReporter`
fire-and-forget."""

from __future__ import annotations

import dataclasses
import pickle
import uuid

import pytest

from autoscale.controller import (DEFAULT_MAX_REPORTS_PER_S, LoadBook, get_or_create_controller, kill_controller,
                                  load_view)
from autoscale.keys import deployment_key, replica_key
from autoscale.load import ClusterSnapshot, relay_hubs
from replicas.scheduling.histogram import RELATIVE_ERROR, LogHistogram
from replicas.protocol import ReplicaLoad


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def report(running: int, waiting: int, samples: list[float], ts: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(running_tokens=running, waiting_tokens=waiting, free_blocks=10, total_blocks=20,
                       block_size=16, tbt_histogram=LogHistogram.of(samples) or None, timestamp=ts)


def close(got: float | None, exact: float) -> bool:
    return got is not None and abs(got - exact) <= RELATIVE_ERROR * exact


@pytest.mark.unit
def test_aggregates_over_two_replicas():
    clock = Clock()
    book = LoadBook(window_s=10.0, stale_after_s=2.0, clock=clock)
    book.report("a", report(100, 20, [0.01] * 50))
    book.report("b", report(300, 0, [0.02] * 49 + [0.5]))
    snap = book.snapshot(tbt_slo_s=0.1)
    assert sorted(snap.replicas) == ["a", "b"]
    assert snap.replicas["a"].token_load == 120 and snap.replicas["a"].tbt_histogram is None
    assert (snap.running_tokens, snap.waiting_tokens, snap.num_tbt_samples) == (400, 20, 100)
    assert close(snap.tbt_p50_s, 0.01) and close(snap.tbt_p99_s, 0.02) and snap.tbt_slo_token_share == 0.99
    only_b = book.snapshot(["b", "unknown"], with_tbt=False)
    assert list(only_b.replicas) == ["b"] and only_b.num_tbt_samples == 0


@pytest.mark.unit
def test_window_and_since_limit_the_samples():
    clock = Clock()
    book = LoadBook(window_s=10.0, stale_after_s=100.0, clock=clock)
    book.report("a", report(0, 0, [0.9] * 10))
    clock.t += 6.0
    book.report("a", report(0, 0, [0.1] * 10))
    assert book.snapshot().num_tbt_samples == 20
    assert close(book.snapshot(window_s=5.0).tbt_p99_s, 0.1)
    assert book.snapshot(since=clock.t - 1).num_tbt_samples == 10
    clock.t += 5.0  # the first batch is now 11 s old
    assert book.snapshot().num_tbt_samples == 10


@pytest.mark.unit
def test_tbt_is_kept_per_deployment():
    """A snapshot's TBT covers the deployments of the replicas asked for: another app's gaps stay
    out, and a replica's gaps stay in after it leaves, until they age out."""
    clock = Clock()
    book = LoadBook(window_s=10.0, stale_after_s=2.0, clock=clock)
    a1, a2, b1 = ("SERVE_REPLICA::a#LLMServer#1", "SERVE_REPLICA::a#LLMServer#2", "SERVE_REPLICA::b#LLMServer#1")
    assert deployment_key(a1) == "SERVE_REPLICA::a#LLMServer" and deployment_key("plain") == "plain"
    book.report(a1, report(0, 0, [0.01] * 10))
    book.report(a2, report(0, 0, [0.02] * 10))
    book.report(b1, report(0, 0, [0.5] * 10))
    snap_a = book.snapshot([a1, a2])
    assert snap_a.num_tbt_samples == 20 and close(snap_a.tbt_p99_s, 0.02)
    assert book.snapshot([b1]).num_tbt_samples == 10 and book.snapshot().num_tbt_samples == 30
    book.remove(a2)
    assert list(book.snapshot([a1, a2]).replicas) == [a1] and book.snapshot([a1]).num_tbt_samples == 20
    clock.t += 1.0
    book.report(a1, report(0, 0, []))  # a report without gaps keeps the load fresh only
    clock.t += 10.0
    assert book.snapshot([a1], tbt_slo_s=0.1).num_tbt_samples == 0


@pytest.mark.unit
def test_report_replies_the_period_the_fleet_affords():
    book = LoadBook(max_reports_per_s=1000.0, clock=Clock())
    assert book.report("a", report(1, 0, [])) == pytest.approx(0.001)
    interval_s, hubs = book.report_many([(f"r{i}", report(1, 0, [0.01])) for i in range(199)])
    assert interval_s == pytest.approx(0.2) and hubs == 0  # 200 replicas at 1,000 reports/s: every 0.2 s
    assert book.snapshot(["r5"]).replicas["r5"].replica_id == "r5" and book.snapshot().num_tbt_samples == 199
    with pytest.raises(ValueError):
        LoadBook(max_reports_per_s=0.0)


@pytest.mark.unit
def test_relay_flushes_beyond_the_call_budget_go_through_hubs():
    """The reply to a relay's flush names how many hubs the node relays should flush through:
    none while the node relays' flushes (a hub's call counting those it merged) fit the budget,
    then enough that no hub and not the controller takes more than the budget."""
    clock = Clock()
    book = LoadBook(max_relay_calls_per_s=50.0, clock=clock)
    start = [100]

    def second(flushes: int, calls_each: int = 1) -> int:
        """`flushes` calls spread over the next whole second; the last reply's hubs."""
        hubs = -1
        for i in range(flushes):
            clock.t = start[0] + i / flushes
            _, hubs = book.report_many([], calls=calls_each)
        start[0] += 1
        return hubs

    assert second(40) == 0 and second(40) == 0  # 40 a second: direct
    assert second(120) == 0  # the second at 120 is counted when it is over
    assert second(10, calls_each=12) == 3 and book.relay_calls_per_s == 120  # through 3 hubs, 40 each
    assert second(10, calls_each=12) == 3  # the hubs' calls stand for the node relays' 120
    start[0] += 5  # a silent spell: nothing to relay
    assert second(1) == 0 and book.relay_calls_per_s == 0
    with pytest.raises(ValueError):
        LoadBook(max_relay_calls_per_s=0.0)


@pytest.mark.unit
def test_the_hub_count_grows_at_once_and_shrinks_only_with_room_to_spare():
    assert relay_hubs(400, 500) == 0 and relay_hubs(501, 500) == 2 and relay_hubs(1_250, 500) == 3
    assert relay_hubs(1_600, 500, current=3) == 4  # grows at once
    assert relay_hubs(980, 500, current=3) == 3  # 2 would carry it, with less than a fifth to spare
    assert relay_hubs(800, 500, current=3) == 2
    assert relay_hubs(450, 500, current=2) == 2 and relay_hubs(400, 500, current=2) == 0


@pytest.mark.unit
def test_a_removed_replicas_late_load_does_not_bring_it_back():
    """A hub may hold a replica's last load for a flush after the replica said it is going: the
    controller keeps it out (its gaps count: they were served) until `stale_after_s`."""
    clock = Clock()
    book = LoadBook(stale_after_s=2.0, clock=clock)
    book.report("app#D#a", report(100, 0, []))
    book.report("app#D#b", report(10, 0, []))
    book.remove("app#D#a")
    clock.t += 0.15
    book.report_many([("app#D#a", report(100, 0, [])), ("app#D#b", report(20, 0, []))],
                     {"app#D": LogHistogram.of([0.01, 0.02])})
    book.report("app#D#a", report(100, 0, [0.03]))  # straight, with gaps: the gaps count
    assert book.replica_ids() == ["app#D#b"] and book.snapshot().num_tbt_samples == 3
    clock.t += 2.5  # b reports on; a's removal is forgotten: an id reporting anew is a replica again
    book.report("app#D#b", report(20, 0, []))
    book.report("app#D#a", report(5, 0, []))
    assert book.replica_ids() == ["app#D#a", "app#D#b"]


@pytest.mark.unit
def test_the_routing_view_is_pickled_once_for_every_router_within_its_age():
    clock = Clock()
    book = LoadBook(view_max_age_s=0.02, clock=clock)
    a, b, other = "app#D#a", "app#D#b", "app#E#c"
    book.report(a, report(100, 0, [0.01]))
    book.report(other, report(1_000, 0, []))
    first = book.routing_view("app#D")
    assert load_view(first) == book.snapshot([a], with_tbt=False)
    book.report(b, report(7, 0, []))
    clock.t += 0.01
    assert book.routing_view("app#D") is first  # another router, 10 ms later: the same bytes
    assert load_view(book.routing_view(None)).token_load == 1_107  # every replica: a view of its own
    assert list(load_view(book.routing_view("app#E")).replicas) == [other]
    clock.t += 0.015
    fresh = load_view(book.routing_view("app#D"))  # 25 ms: built again, b in
    assert list(fresh.replicas) == [a, b] and fresh.token_load == 107
    assert fresh.tbt_p99_s is None and fresh.replicas[a].tbt_histogram is None
    clock.t -= 1.0  # the clock stepped back: the cached view is not trusted for a second more
    book.report(b, report(9, 0, []))
    assert load_view(book.routing_view("app#D")).token_load == 109
    with pytest.raises(TypeError):
        load_view(pickle.dumps({"a": 1}))


@pytest.mark.unit
def test_stale_replicas_are_dropped_and_remove_forgets():
    clock = Clock()
    book = LoadBook(stale_after_s=2.0, clock=clock)
    book.report("a", report(1, 0, []))
    book.report("b", report(1, 0, []))
    clock.t += 1.5
    book.report("b", report(2, 0, []))
    clock.t += 1.0  # a silent for 2.5 s, b for 1 s
    assert book.replica_ids() == ["b"]
    book.remove("b")
    assert book.snapshot().replicas == {}


@pytest.mark.unit
def test_replica_key_is_serves_full_id_string():
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    rid = ReplicaID("abc123", deployment_id=DeploymentID(name="LLMServer", app_name="default"))
    assert replica_key(rid) == "SERVE_REPLICA::default#LLMServer#abc123"
    assert replica_key("already-a-string") == "already-a-string"


@pytest.fixture
def controller(ray_serve):
    """A controller of its own. Its limits run on its real clock, so they are far beyond any
    wait here: nothing a test reports goes stale or leaves the TBT window before it is read."""
    name, namespace = f"ctl_{uuid.uuid4().hex[:8]}", "stallfree_test"
    handle = get_or_create_controller(name, namespace, stale_after_s=600.0, window_s=600.0)
    yield name, namespace, handle
    kill_controller(name, namespace)


@pytest.mark.serve
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "node_relay"])
def test_actor_snapshot_from_reporters(controller, wait_until, relay: bool):
    import ray

    from autoscale.reporter import LoadReporter

    name, namespace, handle = controller
    assert get_or_create_controller(name, namespace)._actor_id == handle._actor_id  # found by name
    clock = Clock()  # reporters send when their clock says so, not when the test happens to run
    a = LoadReporter("fake-a", controller_name=name, namespace=namespace, clock=clock, relay=relay)
    b = LoadReporter("fake-b", controller_name=name, namespace=namespace, clock=clock, relay=relay)
    load = ReplicaLoad(running_tokens=500, waiting_tokens=100, free_blocks=5, total_blocks=10, block_size=16)
    assert a.maybe_report(load, tbt=(3, [0.01, 0.02, 0.03]))
    assert b.maybe_report(dataclasses.replace(load, running_tokens=10), tbt=(1, [0.2]))

    def both() -> ClusterSnapshot | None:
        snap = ray.get(handle.snapshot.remote(tbt_slo_s=0.1))
        return snap if len(snap.replicas) == 2 else None

    snap = wait_until(both, what="both reports received")
    assert snap.replicas["fake-a"].token_load == 600 and snap.replicas["fake-b"].token_load == 110
    assert snap.num_tbt_samples == 4 and close(snap.tbt_p99_s, 0.2) and snap.tbt_slo_token_share == 0.75
    # A reporter that is told to stop deregisters at once; the other stays.
    a.stop()
    wait_until(lambda: ray.get(handle.replica_ids.remote()) == ["fake-b"], what="fake-a removed")
    clock.t += 1.0  # a report is due again
    assert b.maybe_report(load, tbt=(3, [0.01, 0.02, 0.4]))
    wait_until(lambda: ray.get(handle.snapshot.remote()).running_tokens == 500,
               what="fake-b's new load")
    assert ray.get(handle.snapshot.remote()).num_tbt_samples == 6  # fake-a's gaps were served: they stay
    # The controller's reply, read by the next poll: 1 or 2 replicas (a's going) over the budget.
    wait_until(lambda: b.maybe_report(load) or b.fleet_interval_s > 0, what="the reply read")
    assert 1 / DEFAULT_MAX_REPORTS_PER_S <= b.fleet_interval_s <= 2 / DEFAULT_MAX_REPORTS_PER_S


@pytest.mark.serve
def test_node_relay_flushes_through_a_hub_when_the_controller_asks(ray_serve, wait_until):
    """A controller whose budget is below what one node relay flushes (about 10 a second) asks
    for hubs: the node's relay then flushes through one, created on demand, and every load and gap
    still arrives."""
    import ray

    from autoscale.relay import hub_name, relay_name
    from autoscale.reporter import LoadReporter

    name, namespace = f"ctl_{uuid.uuid4().hex[:8]}", "stallfree_test"
    handle = get_or_create_controller(name, namespace, stale_after_s=600.0, window_s=600.0,
                                      max_relay_calls_per_s=2.0)
    clock = Clock()
    rep = LoadReporter("app#D#a", controller_name=name, namespace=namespace, clock=clock, relay=True)
    node_relay = relay_name(name, ray.get_runtime_context().get_node_id())
    sent, used = [0], []

    def through_hub() -> str | None:
        """Report one more gap and a new load; the hub the node's relay flushes to, once it does."""
        clock.t += 1.0
        sent[0] += 1
        assert rep.maybe_report(ReplicaLoad(running_tokens=sent[0]), tbt=(sent[0], [0.01] * sent[0]))
        try:
            relay = ray.get_actor(node_relay, namespace=namespace)
        except ValueError:  # not created yet
            return None
        index = ray.get(relay.__ray_call__.remote(lambda r: -1 if r._upstream is None else r._upstream[0]))
        if index < 0:
            return None
        used.append(hub_name(name, index))
        return used[-1]

    try:
        hub = wait_until(through_hub, what="the node relay flushing through a hub")
        assert ray.get_actor(hub, namespace=namespace) is not None
        through_hub()  # one report at least after the switch

        def caught_up() -> bool:
            snap = ray.get(handle.snapshot.remote())
            return snap.token_load == sent[0] and snap.num_tbt_samples == sent[0]

        wait_until(caught_up, what="every load and gap through the hub")
    finally:
        rep.stop()
        kill_controller(name, namespace)
        for actor in {node_relay, *used}:
            try:
                ray.kill(ray.get_actor(actor, namespace=namespace), no_restart=True)
            except ValueError:
                pass


@pytest.mark.serve
def test_actor_drops_replicas_that_stop_reporting(ray_serve, wait_until):
    import ray

    name, namespace = f"ctl_{uuid.uuid4().hex[:8]}", "stallfree_test"
    handle = get_or_create_controller(name, namespace, stale_after_s=0.5)
    try:
        ray.get(handle.report.remote("fake-s", report(1, 0, [0.01] * 5)))  # only staleness removes it
        # Not asserted present first: on a busy machine 0.5 s may pass before the test looks.
        wait_until(lambda: ray.get(handle.replica_ids.remote()) == [], what="fake-s dropped as stale")
        snap = ray.get(handle.snapshot.remote())  # its load went with it; its gaps were served
        assert snap.replicas == {} and snap.num_tbt_samples == 5 and snap.token_load == 0
    finally:
        kill_controller(name, namespace)


@pytest.mark.serve
def test_reporter_survives_a_dead_controller(controller, wait_until):
    from autoscale.reporter import LoadReporter

    name, namespace, handle = controller
    # The reporter's clock stands still: no lookup retry (LOOKUP_RETRY_S) comes due, so the
    # dead controller is neither found again nor re-created during the test.
    rep = LoadReporter("fake-c", controller_name=name, namespace=namespace, clock=Clock(), relay=False)
    assert rep.maybe_report(ReplicaLoad(running_tokens=1), now=1.0)
    kill_controller(name, namespace)
    reports = iter(range(2, 10_000))

    def failure_noticed() -> bool:  # never raises; the failed report is noticed, the handle dropped
        rep.maybe_report(ReplicaLoad(running_tokens=1), now=float(next(reports)))
        return rep.num_failed > 0

    wait_until(failure_noticed, interval_s=0.1, what="the failed report noticed")
    sent = rep.num_sent
    for now in (20_000.0, 20_001.0):  # without a handle nothing is sent, so nothing more fails
        rep.maybe_report(ReplicaLoad(running_tokens=1), now=now)
    assert (rep.num_sent, rep.num_failed) == (sent, 1)


@pytest.mark.unit
def test_prefix_sketches_go_only_to_who_asks():
    """A replica's Bloom sketch rides in its load; only the prefix router's snapshot carries it
    (the door, the policy and the token-load router get the loads without it)."""
    from replicas.scheduling.prefix_hash import PrefixSketch

    book = LoadBook(window_s=10.0, stale_after_s=2.0, clock=Clock())
    sketch = PrefixSketch.of([12345], 20)
    book.report("a", dataclasses.replace(report(100, 0, []), prefix_sketch=sketch))
    assert book.snapshot(with_tbt=False).replicas["a"].prefix_sketch is None
    with_sketch = book.snapshot(with_tbt=False, with_sketches=True).replicas["a"]
    assert with_sketch.prefix_sketch == sketch and 12345 in with_sketch.prefix_sketch
    assert book.snapshot(with_tbt=False).replicas["a"].running_tokens == 100
