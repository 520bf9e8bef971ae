"""The door admits by the replicas' reported queues plus the prompts it admitted that no report
shows yet, refuses over the summed bound with the Retry-After the drain rate gives, and admits
(leaving the replicas' own bounds to decide) when its view is missing or stale."""

from __future__ import annotations

import asyncio

import pytest

from app.admission import AdmissionGate
from autoscale.load import ReplicaLoad

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def load(rid: str, waiting: int, bound: int, drain: float, at: float) -> ReplicaLoad:
    return ReplicaLoad(rid, waiting_tokens=waiting, queue_bound_tokens=bound, drain_tps=drain, timestamp=at)


async def refreshed(gate: AdmissionGate) -> None:
    """Start a snapshot refresh (one is due) and let it complete."""
    await gate.decide(1)
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def primed(loads: dict[str, ReplicaLoad], clock: Clock) -> tuple[AdmissionGate, list[int]]:
    calls = [0]

    async def fetch() -> dict[str, ReplicaLoad]:
        calls[0] += 1
        return loads

    gate = AdmissionGate(fetch, clock=clock, refresh_s=0.05, max_age_s=1.0, reflect_grace_s=0.05)
    await refreshed(gate)
    return gate, calls


async def test_refuses_over_the_summed_bound_with_retry_after_from_the_drain_rate() -> None:
    clock = Clock()
    loads = {"a": load("a", 900, 1000, 100.0, clock.t), "b": load("b", 1000, 1000, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    assert (await gate.decide(100)).admitted  # 1900 + 100 = 2000 <= 2000
    refused = await gate.decide(600)  # 2500 - 2000 = 500 tokens over, at 200 tokens/s
    assert not refused.admitted and refused.retry_after_s == 3 and refused.bound_tokens == 2000
    assert gate.num_refused == 1


async def test_a_stalled_replica_bound_0_refuses_unless_its_queue_is_empty() -> None:
    """Bound 0 is a report (a stalled queue takes one request, at its head), not a missing one:
    the door refuses on it; a replica that reported no bound (None) stays out of the view."""
    clock = Clock()
    loads = {"a": load("a", 50, 0, 0.0, clock.t),
             "b": ReplicaLoad("b", waiting_tokens=10_000, timestamp=clock.t)}  # no bound reported
    gate, _ = await primed(loads, clock)
    refused = await gate.decide(10)
    assert not refused.admitted and refused.bound_tokens == 0 and refused.queued_tokens == 50
    loads["a"] = load("a", 0, 0, 0.0, clock.t + 0.5)
    clock.t += 0.1
    await refreshed(gate)
    assert (await gate.decide(10)).admitted  # empty: it takes one


async def test_its_own_admissions_count_until_a_report_shows_them() -> None:
    clock = Clock()
    loads = {"a": load("a", 0, 1000, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    clock.t += 0.01
    first = gate.admit(600)
    assert (await gate.decide(300)).admitted  # 600 unreflected + 300 <= 1000
    second = gate.admit(300)
    assert not (await gate.decide(200)).admitted  # 900 + 200 > 1000
    gate.settle(first)  # it ended: it is no longer queued
    assert (await gate.decide(200)).admitted
    gate.settle(second)
    # Queued on a replica before that replica's report was taken: the report counts it.
    clock.t += 1.0
    gate.acknowledged(gate.admit(900), "a", clock.t)  # replica "a" queued it ...
    loads["a"] = load("a", 0, 1000, 100.0, clock.t + 0.5)
    clock.t += 0.1  # refresh is due
    await refreshed(gate)
    assert (await gate.decide(900)).admitted  # ... and a newer report (queue empty) shows it gone


async def test_a_prompt_no_replica_has_acknowledged_counts_whatever_the_reports_say() -> None:
    """It waits in Serve's handle queue, where no report sees it."""
    clock = Clock()
    loads = {"a": load("a", 0, 1000, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    gate.admit(900)
    loads["a"] = load("a", 0, 1000, 100.0, clock.t + 0.5)
    clock.t += 0.6
    await refreshed(gate)
    assert not (await gate.decide(200)).admitted


async def test_a_stale_or_missing_view_admits() -> None:
    clock = Clock()

    async def failing() -> dict[str, ReplicaLoad]:
        raise RuntimeError("controller gone")

    gate = AdmissionGate(failing, clock=clock)
    assert (await gate.decide(10**6)).admitted
    await asyncio.sleep(0)
    assert gate.num_failed_refreshes == 1 and (await gate.decide(10**6)).admitted
    full = {"a": load("a", 5000, 1000, 100.0, clock.t)}
    gate2, _ = await primed(full, clock)
    assert not (await gate2.decide(10)).admitted
    clock.t += 5.0  # the snapshot is older than max_age_s and the refresh keeps failing
    gate2._fetch = failing
    assert (await gate2.decide(10)).admitted


async def test_refreshes_at_most_every_refresh_s() -> None:
    clock = Clock()
    gate, calls = await primed({"a": load("a", 0, 1000, 1.0, clock.t)}, clock)
    for _ in range(100):
        await gate.decide(1)
        await asyncio.sleep(0)
    assert calls[0] == 1
    clock.t += 0.06
    await gate.decide(1)
    await asyncio.sleep(0)
    assert calls[0] == 2


async def test_a_refusal_is_never_made_on_an_old_view() -> None:
    """The cached view says full, but it is old: the gate waits for a fresh one (queue empty)."""
    clock = Clock()
    loads = {"a": load("a", 5000, 1000, 100.0, clock.t)}
    gate, calls = await primed(loads, clock)
    assert not (await gate.decide(10)).admitted
    loads["a"] = load("a", 0, 1000, 100.0, clock.t + 0.7)
    clock.t += 0.7  # older than refuse_age_s (0.5 s), younger than max_age_s (1 s)
    assert (await gate.decide(10)).admitted
    assert calls[0] == 2


async def test_a_report_older_than_a_settlement_does_not_count_that_prompt() -> None:
    """A report taken while our prompt waited still shows it after it started: not counted."""
    clock = Clock()
    loads = {"a": load("a", 0, 100, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    clock.t += 0.01
    ticket = gate.admit(80)
    gate.acknowledged(ticket, "a", clock.t)
    loads["a"] = load("a", 80, 100, 100.0, clock.t + 0.01)  # the report shows it waiting
    clock.t += 0.1
    await refreshed(gate)
    assert not (await gate.decide(50)).admitted  # 80 waiting + 50 > 100
    gate.settle(ticket, left_at=clock.t)  # it left the queue after that report
    assert (await gate.decide(50)).admitted


async def test_a_resent_prompt_counts_as_unacknowledged_again() -> None:
    clock = Clock()
    loads = {"a": load("a", 0, 1000, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    ticket = gate.admit(900)
    gate.acknowledged(ticket, "a", clock.t)
    loads["a"] = load("a", 0, 1000, 100.0, clock.t + 0.5)  # its replica died: no report shows it
    clock.t += 0.6
    await refreshed(gate)
    assert (await gate.decide(200)).admitted  # acknowledged before the report: assumed in it
    gate.requeued(ticket)  # sent again, to another replica
    assert not (await gate.decide(200)).admitted  # in Serve's queue again: counted


async def test_each_replica_is_judged_on_its_own_report() -> None:
    """Queued on "b" after b's report: counted, though "a" reported later."""
    clock = Clock()
    loads = {"a": load("a", 0, 500, 100.0, clock.t + 1.0), "b": load("b", 0, 500, 100.0, clock.t)}
    gate, _ = await primed(loads, clock)
    gate.acknowledged(gate.admit(800), "b", clock.t + 0.5)
    assert not (await gate.decide(300)).admitted  # 800 + 300 > 1000
    gate.acknowledged(gate.admit(100), "a", clock.t + 0.5)  # before a's report: already in it
    assert (await gate.decide(200)).admitted  # 800 + 200 <= 1000


async def test_the_periodic_log_counts_from_the_start_and_says_when_there_is_no_view(caplog) -> None:
    """The first line (the first decision) counts from when the gate was made and says that no
    report came yet (it printed "in the last 1000000000 s ... view inf s old"); then every 5 s."""
    clock = Clock()
    gate = AdmissionGate(None, clock=clock)
    clock.t += 3.0
    with caplog.at_level("INFO", logger="app.admission"):
        assert (await gate.decide(10)).admitted
        clock.t += 1.0
        await gate.decide(10)  # within 5 s of the last line: no line
        clock.t += 4.0
        await gate.decide(10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admission:")]
    assert lines == ["admission: 1 decided, 0 refused in the last 3 s; now 0 prompt tokens queued of a bound "
                     "of 0 over 0 replicas (no load report yet: the replicas decide)",
                     "admission: 2 decided, 0 refused in the last 5 s; now 0 prompt tokens queued of a bound "
                     "of 0 over 0 replicas (no load report yet: the replicas decide)"]


def test_the_fetch_reads_its_deployments_routing_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """The door's fetch asks the controller for its own deployment's view (all replicas, filtered
    here, when the app is unnamed) and sends the demand counters along."""
    import concurrent.futures
    import pickle

    import autoscale.controller as controller_module
    from app.admission import controller_fetch
    from autoscale.demand import DemandCounts
    from autoscale.load import ClusterSnapshot

    ours, other = "SERVE_REPLICA::llm#LLMServer#a", "SERVE_REPLICA::chat#LLMServer#b"
    loads = {ours: ReplicaLoad(ours, waiting_tokens=5), other: ReplicaLoad(other, waiting_tokens=7)}
    asked: list[object] = []
    demand: list[tuple[str, str, DemandCounts]] = []

    class Method:
        def __init__(self, fn) -> None:  # noqa: ANN001
            self.fn = fn

        def remote(self, *args: object) -> object:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self.fn(*args))
            return type("Ref", (), {"future": lambda _self: done})()

    def view(deployment: str | None) -> bytes:
        asked.append(deployment)
        keep = {k: v for k, v in loads.items() if deployment is None or k.startswith(deployment + "#")}
        return pickle.dumps(ClusterSnapshot(replicas=keep))

    handle = type("Handle", (), {"routing_view": Method(view),
                                 "report_demand": Method(lambda *a: demand.append(a))})()
    monkeypatch.setattr(controller_module, "get_or_create_controller", lambda name, namespace: handle)
    named = controller_fetch("ctl", "ns", "llm", "LLMServer",
                             demand=("ingress:1", lambda now: DemandCounts(refused_tokens=9)))
    assert list(asyncio.run(named())) == [ours]
    assert asked == ["SERVE_REPLICA::llm#LLMServer"]
    assert demand == [("SERVE_REPLICA::llm#LLMServer", "ingress:1", DemandCounts(refused_tokens=9))]
    unnamed = controller_fetch("ctl", "ns", None, "LLMServer")
    assert sorted(asyncio.run(unnamed())) == [other, ours] and asked[-1] is None  # every app's LLMServer


def test_the_kept_sum_is_the_sum_over_every_ticket() -> None:
    """Admissions, acknowledgements (before and after a report), resends and settlements in a
    random order, with new snapshots now and then: the sum a decision reads (kept up to date by
    each change) is always the one a walk over every ticket gives."""
    import random

    rng = random.Random(7)
    clock = Clock()
    gate = AdmissionGate(None, clock=clock, reflect_grace_s=0.05)
    loads = {r: load(r, 0, 10_000, 100.0, clock.t) for r in "ab"}
    gate._unreflected(loads, clock.t)
    open_tickets: list[int] = []
    checked = 0
    for step in range(3000):
        clock.t += rng.uniform(0, 0.01)
        op = rng.random()
        if op < 0.3 or not open_tickets:
            open_tickets.append(gate.admit(rng.randint(1, 500)))
        elif op < 0.55:
            gate.acknowledged(rng.choice(open_tickets), rng.choice("ab"), clock.t + rng.uniform(-0.2, 0.2))
        elif op < 0.6:
            gate.requeued(rng.choice(open_tickets))
        elif op < 0.85:
            ticket = open_tickets.pop(rng.randrange(len(open_tickets)))
            gate.settle(ticket, left_at=clock.t + rng.uniform(-0.2, 0.2) if rng.random() < 0.8 else None)
        elif op < 0.9:  # a new snapshot: the sum is taken afresh
            loads = {r: load(r, 0, 10_000, 100.0, clock.t + rng.uniform(-0.3, 0.1)) for r in "ab"}
        kept = gate._unreflected(loads, clock.t)
        gate._base_loads = None  # force the walk
        assert gate._unreflected(loads, clock.t) == kept, step
        checked += kept != 0
    assert checked > 1000  # the sums compared were mostly not trivially 0


def test_demand_goes_to_the_controller_when_due_and_a_failed_send_looks_it_up_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`controller_demand`: the counters go to the app's deployment key only when the counter says
    they are due; a send that raises drops the handle, so the next one finds a restarted
    controller."""
    import autoscale.controller as controller_module
    from app.admission import controller_demand
    from autoscale.demand import DemandCounter

    sent: list[tuple] = []
    lookups: list[str] = []
    broken = [True]

    class Handle:
        class report_demand:  # noqa: N801 - a Ray method's shape
            @staticmethod
            def remote(*args: object) -> None:
                if broken[0]:
                    broken[0] = False
                    raise RuntimeError("controller restarting")
                sent.append(args)

    def lookup(name: str, namespace: str) -> Handle:
        lookups.append(name)
        return Handle()

    monkeypatch.setattr(controller_module, "get_or_create_controller", lookup)
    counter = DemandCounter()
    send = controller_demand("ctl", "ns", "llm", "LLMServer", "ingress:r1", counter.to_send)
    with pytest.raises(RuntimeError):  # the first send (the controller's baseline) fails
        send(0.0)
    counter.served(120)
    assert send(0.5) is False and lookups == ["ctl"]  # within REPORT_EVERY_S: nothing due
    assert send(10.0) is True and lookups == ["ctl", "ctl"]  # looked up again after the failure
    counter.refused(30)
    assert send(10.5) is False
    assert send(20.0) is True and lookups == ["ctl", "ctl"]  # the handle kept while it works
    assert send(40.0) is False  # nothing moved
    assert [(key, source) for key, source, _ in sent] == [("SERVE_REPLICA::llm#LLMServer", "ingress:r1")] * 2
    assert [(c.served_tokens, c.refused_tokens) for _, _, c in sent] == [(120, 0), (120, 30)]  # totals


async def test_an_engine_replica_serving_http_leaves_admission_to_its_own_queue() -> None:
    """`ingress_in_replica`: a request that reached the replica is served there or refused, so its
    token gate reads no fleet view (no controller call per refresh) and admits whatever size; the
    replica's own queue bound refuses (`LLMServer._admit`, tested in test_llm_server.py)."""
    from app.replica_ingress import ReplicaIngress

    gate = ReplicaIngress._admission_gate(object(), None, None)
    assert (await gate.decide(10**9)).admitted
    gate.settle(gate.admit(10**9))
    assert (await gate.decide(10**9)).admitted and gate.num_failed_refreshes == 0
