"""A replica reports at most every interval (sooner on a big token-load jump; an unchanged load
only every heartbeat; a large fleet's longer period when the controller asks for it), carries
every TBT gap that is new since its last report exactly once, binned, and never raises when
sending fails."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autoscale.controller import LoadBook
from autoscale.reporter import LoadReporter, new_tbt_samples
from replicas.scheduling.histogram import RELATIVE_ERROR, LogHistogram
from replicas.protocol import ReplicaLoad

pytestmark = pytest.mark.unit


def FakeLoad(**fields: Any) -> ReplicaLoad:  # noqa: N802 - reads like the record it builds
    return ReplicaLoad(**{"free_blocks": 100, "total_blocks": 100, **fields})


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ReplicaLoad]] = []

    def __call__(self, replica_id: str, payload: ReplicaLoad) -> None:
        self.sent.append((replica_id, payload))

    def gaps(self) -> LogHistogram:
        total = LogHistogram()
        for _, p in self.sent:
            if p.tbt_histogram is not None:
                total.merge(p.tbt_histogram)
        return total


def reporter(sink: Sink, **kw: Any) -> LoadReporter:
    return LoadReporter("r1", send=sink, interval_s=0.1, min_interval_s=0.02, change_tokens=256,
                        change_fraction=0.25, clock=lambda: 0.0, **kw)


def test_new_tbt_samples_finds_the_overlap():
    assert new_tbt_samples(0, 2, [1.0, 2.0]) == [1.0, 2.0]
    assert new_tbt_samples(2, 2, [1.0, 2.0]) == []
    assert new_tbt_samples(2, 3, [1.0, 2.0, 3.0]) == [3.0]
    assert new_tbt_samples(3, 5, [2.0, 3.0, 4.0, 5.0]) == [4.0, 5.0]  # a capped tail slid
    assert new_tbt_samples(2, 9, [7.0, 8.0]) == [7.0, 8.0]  # more than the tail arrived
    assert new_tbt_samples(3, 5, [0.5] * 6) == [0.5, 0.5]  # repeated values are no problem


def test_throttles_to_the_interval():
    sink = Sink()
    rep = reporter(sink)
    sent = [rep.maybe_report(FakeLoad(running_tokens=100 + t), now=t / 1000) for t in range(0, 1000, 10)]
    assert sum(sent) == 10  # every 100 ms over one second of 10 ms polls
    assert [round(p.timestamp, 2) for _, p in sink.sent[:3]] == [0.0, 0.1, 0.2]


def test_an_unchanged_load_is_sent_only_every_heartbeat():
    sink = Sink()
    rep = reporter(sink, heartbeat_s=1.0)
    sent = [rep.maybe_report(FakeLoad(running_tokens=100), now=t / 100) for t in range(250)]
    assert sum(sent) == 3  # at 0, 1 and 2 s: the controller (stale after 2 s) keeps it
    assert rep.maybe_report(FakeLoad(running_tokens=100), now=2.1, tbt=(1, [0.02]))  # a new gap is news


def test_the_fleet_period_from_the_controllers_reply_is_followed():
    book = LoadBook(max_reports_per_s=1000.0, clock=lambda: 0.0)
    book.report_many([(f"other{i}", FakeLoad()) for i in range(499)])  # 500 replicas with r1: every 0.5 s
    rep = LoadReporter("r1", send=book.report, interval_s=0.1, clock=lambda: 0.0)
    sent = [rep.maybe_report(FakeLoad(running_tokens=100 + t), now=t / 100) for t in range(200)]
    assert rep.fleet_interval_s == 0.5 and sum(sent) == 4  # at 0, 0.5, 1 and 1.5 s


def test_big_change_reports_early_but_not_within_min_interval():
    sink = Sink()
    rep = reporter(sink)
    assert rep.maybe_report(FakeLoad(running_tokens=100), now=0.0)
    assert not rep.maybe_report(FakeLoad(running_tokens=5000), now=0.01)  # within 20 ms
    assert rep.maybe_report(FakeLoad(running_tokens=5000), now=0.03)  # jump: early
    assert not rep.maybe_report(FakeLoad(running_tokens=5100), now=0.06)  # small change: wait
    assert rep.maybe_report(FakeLoad(running_tokens=5100), now=0.13)
    assert [p.running_tokens for _, p in sink.sent] == [100, 5000, 5100]


def test_every_new_tbt_sample_is_sent_once():
    sink = Sink()
    rep = reporter(sink)
    tail: list[float] = []
    produced: list[float] = []
    for step in range(100):  # 10 ms polls, 3 new samples each, engine keeps the last 8
        new = [step + 0.1, step + 0.2, step + 0.3]
        produced += new
        tail = (tail + new)[-8:]
        rep.maybe_report(FakeLoad(running_tokens=10), now=step / 100, tbt=(len(produced), list(tail)))
    last_sent_at = round(sink.sent[-1][1].timestamp * 100)
    assert sink.gaps() == LogHistogram.of(produced[: 3 * (last_sent_at + 1)])
    assert all(p.tbt_histogram.count == 30 for _, p in sink.sent[1:])  # 10 polls of 3 a report


def test_iteration_stats_are_summarised_per_report():
    sink = Sink()
    rep = reporter(sink)
    its = [SimpleNamespace(start=float(i), duration=0.01 * (i + 1)) for i in range(4)]
    rep.maybe_report(FakeLoad(), now=0.0, iterations=its[:2])
    rep.maybe_report(FakeLoad(), now=0.2, iterations=its)
    first, second = (p for _, p in sink.sent)
    assert first.iterations == 2 and abs(first.iteration_max_s - 0.02) < 1e-9
    assert second.iterations == 2 and abs(second.iteration_mean_s - 0.035) < 1e-9


def test_send_failure_never_raises():
    def broken(replica_id: str, payload: ReplicaLoad) -> None:
        raise ConnectionError("controller gone")

    rep = LoadReporter("r1", send=broken, clock=lambda: 0.0)
    assert rep.maybe_report(FakeLoad(), now=0.0)
    assert rep.num_failed == 1 and rep.num_sent == 0


def test_autoscaling_stats_from_the_local_window():
    sink = Sink()
    rep = LoadReporter("r1", send=sink, tbt_window_s=10.0, clock=lambda: 0.0)
    rep.maybe_report(FakeLoad(running_tokens=40, waiting_tokens=7), now=1.0,
                     tbt=(100, [0.01 * i for i in range(1, 101)]))
    stats = rep.autoscaling_stats(now=2.0)
    assert stats["num_tbt_samples"] == 100 and abs(stats["tbt_p99_s"] - 0.99) <= RELATIVE_ERROR * 0.99
    assert (stats["running_tokens"], stats["waiting_tokens"]) == (40.0, 7.0)
    assert rep.autoscaling_stats(now=20.0)["num_tbt_samples"] == 0


def test_outside_a_serve_replica_the_reporter_stays_idle():
    sink = Sink()
    rep = LoadReporter(send=sink, clock=lambda: 0.0)  # no replica id, no Serve replica context
    assert not rep.maybe_report(FakeLoad(running_tokens=5), now=0.0)
    assert rep.replica_id is None and sink.sent == []


class FakeRelay:
    """A node relay as a reporter meets it: its datagram socket (`recv` reads one report), and
    its `report` method, whose calls it keeps (`calls`: each call's arguments) and answers with
    (period 0, that socket)."""

    def __init__(self, parent: str) -> None:
        import os
        import socket

        self.path = os.path.join(parent, "reports.sock")
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.path)
        self.socket.settimeout(30)
        self.calls: list[tuple] = []
        self.handle = SimpleNamespace(report=SimpleNamespace(remote=self._remote))

    def _remote(self, *message: Any) -> Any:
        import concurrent.futures

        self.calls.append(message)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result((0.0, self.path))
        return SimpleNamespace(future=lambda: done)

    def recv(self) -> tuple:
        import pickle

        return pickle.loads(self.socket.recv(65536))


@pytest.fixture
def fake_relay() -> Any:
    import shutil
    import tempfile

    parent = tempfile.mkdtemp()  # short: a Unix socket's path has a limit of ~108 bytes
    try:
        yield FakeRelay(parent)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_between_heartbeat_calls_reports_go_to_the_node_relays_socket_and_none_is_lost(fake_relay) -> None:  # noqa: ANN001
    """The relay's reply to a call names its datagram socket; reports then go there, one call a
    heartbeat carries the rest (the controller's period, a restarted relay's socket); a datagram
    that cannot go (the relay gone) sends that same report by call."""
    import os

    rep = LoadReporter("r1", controller=fake_relay.handle, interval_s=0.1, heartbeat_s=1.0, clock=lambda: 0.0)
    got = []
    for t in range(20):  # two seconds of reports, one every 100 ms
        assert rep.maybe_report(FakeLoad(running_tokens=100 + t), now=t / 10, tbt=(t + 1, [0.01]))
        if rep.num_datagrams > len(got):  # read as the relay's loop does (the queue may hold 10)
            got.append(fake_relay.recv())
    calls = [load for _, load in fake_relay.calls]
    assert [round(load.timestamp, 1) for load in calls] == [0.0, 1.0]  # a call a heartbeat
    assert rep.num_sent == 20 and rep.num_datagrams == 18 and rep.num_failed == 0
    assert [(rid, load.running_tokens) for rid, load in got] == [
        ("r1", 100 + t) for t in range(20) if t not in (0, 10)]
    assert sum(load.tbt_histogram.count for load in calls + [load for _, load in got]) == 20  # every gap once
    fake_relay.socket.close()
    os.unlink(fake_relay.path)  # the relay is gone
    assert rep.maybe_report(FakeLoad(running_tokens=500), now=2.0)
    assert fake_relay.calls[-1][1].running_tokens == 500 and rep.num_datagrams == 18  # went by call


def test_demand_counters_ride_with_the_reports_by_call_and_by_datagram(fake_relay) -> None:  # noqa: ANN001
    """`LoadReporter.demand`: what it returns when a report goes rides with that report, by call
    and by datagram alike, and the node relay takes it from either; with nothing due the report
    goes as before."""
    from autoscale.demand import DemandCounter, DemandCounts
    from autoscale.relay import NodeRelay

    calls = fake_relay.calls

    def hook(counter: DemandCounter) -> Any:
        return lambda now: [] if (c := counter.to_send(now)) is None else [("app#D", "ingress:r1", c)]

    def reporter_at() -> LoadReporter:
        return LoadReporter("r1", controller=fake_relay.handle, interval_s=0.1, heartbeat_s=1.0, clock=lambda: 0.0)

    by_call = reporter_at()
    by_call.demand = hook(DemandCounter())
    assert by_call.maybe_report(FakeLoad(running_tokens=1), now=0.0)  # a call, with the baseline
    assert calls[-1][2] == (("app#D", "ingress:r1", DemandCounts()),)

    counter = DemandCounter()
    rep = reporter_at()
    assert rep.maybe_report(FakeLoad(running_tokens=1), now=0.0) and len(calls[-1]) == 2  # no hook yet
    rep.demand = hook(counter)
    got = []
    for t, load_tokens in ((0.5, 2), (1.0, 3), (1.5, 4), (2.0, 5), (2.5, 6)):
        if t == 1.0:
            counter.served(64)
        if t == 2.0:
            counter.refused(10)
        assert rep.maybe_report(FakeLoad(running_tokens=load_tokens), now=t)
        if rep.num_datagrams > len(got):
            got.append(fake_relay.recv())
    assert [len(c) for c in calls[-3:]] == [2, 2, 2]  # the heartbeats' calls at 0, 1 and 2: nothing due
    assert [m[2][0][2] for m in got] == [DemandCounts(), DemandCounts(served_tokens=64, served_requests=1),
                                      counter.counts]  # each datagram a second after the last sent
    message = got[-1]

    # The relay's datagram intake takes it; what is not a demand report is refused, not kept.
    relay = NodeRelay.__ray_actor_class__("ctl", "ns", "node")
    relay._wake = lambda: None
    relay._take_datagram(message)
    assert relay._relay.take()[3] == list(message[2])
    with pytest.raises(ValueError, match="not demand reports"):
        relay._take_datagram(("r1", FakeLoad(), [("app#D", "x", {"served_tokens": 1})]))
