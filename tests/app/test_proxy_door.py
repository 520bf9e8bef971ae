"""The door in Serve's HTTP proxy answers 429 itself, in OpenAI's shape with Retry-After, while
the requests already forwarded stand in a queue (their median wait for a first token over the
target) or just after the server refused one; one slow request alone never closes it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from starlette.types import Message

from app.middleware import INGRESS_MS_HEADER, StreamLimitMiddleware
from app.proxy_door import (CALLBACK_ENV, DEFAULT_WAIT_TARGET_MS, HA_PROXY_ENV, IMPORT_PATH, NICENESS_ENV,
                            Pending, PendingMiddleware, ProxyDoorConfig, middlewares, proxy_env)
from autoscale.demand import DemandCounts

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pending_of(target_s: float = 2.0, min_pending: int = 4,
               gap_target_s: float | None = 0.25) -> tuple[Pending, Clock]:
    clock = Clock()
    return Pending(target_s, clock, min_pending=min_pending, hold_s=0.5, check_every_s=0.05,
                   gap_target_s=gap_target_s, gap_window_s=1.0, min_gaps=20, slow_share=0.1), clock


def test_a_standing_queue_closes_the_door_until_it_drains() -> None:
    pending, clock = pending_of()
    keys = [pending.start() for _ in range(5)]  # all arrive at t = 100
    clock.t += 2.1
    assert not pending.admits()  # median wait 2.1 s > 2 s
    assert pending.median_wait_s == pytest.approx(2.1) and pending.retry_after == 3
    for key in keys[:3]:  # three answered: two left, under min_pending
        pending.answered(key)
    assert not pending.admits()  # the decision holds until the next check
    clock.t += 0.06
    assert pending.admits()


def test_the_median_not_the_oldest_decides() -> None:
    pending, clock = pending_of()
    pending.start()  # a long prompt, still prefilling
    clock.t += 10.0
    fresh = [pending.start() for _ in range(4)]
    clock.t += 0.5
    assert pending.admits()  # waits 10.5, 0.5, 0.5, 0.5, 0.5: median 0.5 s
    assert pending.median_wait_s == pytest.approx(0.5)
    clock.t += 1.6
    assert not pending.admits()  # now the fresh ones wait 2.1 s too: a standing queue
    for key in fresh:
        pending.answered(key)
    clock.t += 0.06
    assert pending.admits()  # the long one alone never closes it


def test_fewer_than_min_pending_never_close_it() -> None:
    pending, clock = pending_of(min_pending=4)
    for _ in range(3):
        pending.start()
    clock.t += 60.0
    assert pending.admits()


def test_a_429_from_downstream_holds_it_for_the_hold_at_most_the_retry_after() -> None:
    pending, clock = pending_of()
    pending.saw_429(7)
    assert not pending.admits() and pending.retry_after == 7
    clock.t += 0.49
    assert not pending.admits()
    clock.t += 0.02
    assert pending.admits()  # hold 0.5 s (< Retry-After 7)
    pending.saw_429(0)  # a nonsensical Retry-After still holds, for at least a second of advice
    assert pending.retry_after == 1 and not pending.admits()


def test_a_429_cuts_the_window_of_unanswered_requests_and_answers_regrow_it() -> None:
    """Like TCP's congestion window: a 429 from downstream cuts the requests the door may have
    forwarded and not heard back from to half of those on their way (at most once in 0.5 s, and
    never under min_requests), and each admitting answer grows it by 1/window."""
    pending, clock = pending_of(gap_target_s=None)
    pending.min_cap = 8
    keys = [pending.start() for _ in range(40)]
    pending.answered(keys.pop())  # the refused one
    pending.saw_429(1)
    assert pending.window == 19.5  # half of the 39 still on their way
    pending.saw_429(1)  # the same news again, within the cooldown: no second cut
    assert pending.window == 19.5
    clock.t += 0.6  # past the hold
    assert not pending.admits() and pending.reason == "unanswered window"  # 39 waiting >= 19.5
    for key in keys[:20]:  # 20 answered with their first token: 19 left, and the window grows
        pending.answered(key)
        pending.admitted()
    assert 20.4 < pending.window < 20.6
    assert pending.admits()  # 19 waiting < 20.5
    clock.t += 0.6
    for key in keys[20:]:
        pending.answered(key)
    pending.saw_429(1)  # nothing on its way: the floor
    assert pending.window == 8


def test_slow_streams_close_it_until_their_gaps_leave_the_window() -> None:
    pending, clock = pending_of()
    for _ in range(18):
        pending.gap(0.05)
    pending.gap(0.3)
    pending.gap(0.3)  # 2 of 20 slow: 10%, not over a tenth
    assert pending.admits()
    pending.gap(0.3)  # 3 of 21: over
    clock.t += 0.06
    assert not pending.admits() and pending.reason == "slow streams" and pending.retry_after == 1
    clock.t += 1.0  # the window has moved past them all
    assert pending.admits()


def slow_window(pending: Pending, clock: Clock) -> None:
    """A second of gaps, all over the target."""
    clock.t += 1.01
    for _ in range(25):
        pending.gap(0.3)


def quick_window(pending: Pending, clock: Clock) -> None:
    clock.t += 1.01
    for _ in range(25):
        pending.gap(0.05)


def streaming(pending: Pending) -> None:
    """One more request in flight, past its first token."""
    pending.answered(pending.start())


def test_the_stream_cap_is_learned_from_slow_gaps_and_grows_back_while_it_binds() -> None:
    pending, clock = pending_of()
    assert pending.cap == 1024  # no bound before the gaps were ever slow
    for _ in range(100):
        streaming(pending)
    slow_window(pending, clock)
    assert not pending.admits() and pending.reason == "slow streams"
    assert pending.cap == pytest.approx(90)  # 0.9 x the 100 in flight
    slow_window(pending, clock)  # still slow, but 100 > cap: what was cut has not shown yet
    assert not pending.admits() and pending.cap == pytest.approx(90)
    for _ in range(15):
        pending.ended()  # 85 in flight: under the cap
    quick_window(pending, clock)
    assert pending.admits()  # quick gaps, 85 < 90: open; the cap does not bind, so it holds
    assert pending.cap == pytest.approx(90)
    for _ in range(5):
        streaming(pending)
    assert not pending.admits() and pending.reason == "stream cap" and pending.retry_after == 1
    clock.t += 1.0  # quick and binding: 5% more
    quick_window(pending, clock)
    assert pending.admits() and pending.cap == pytest.approx(94.5)
    for _ in range(4):
        streaming(pending)
    assert pending.admits()  # 94 in flight, under 94.5
    streaming(pending)
    assert not pending.admits() and pending.reason == "stream cap"  # 95


def cut_at(streams: int) -> tuple[Pending, Clock]:
    """A door whose gaps turned slow with `streams` in flight."""
    pending, clock = pending_of()
    for _ in range(streams):
        streaming(pending)
    slow_window(pending, clock)
    pending.admits()
    return pending, clock


def test_the_cap_is_cut_again_only_after_the_cooldown_and_never_under_the_minimum() -> None:
    pending, clock = cut_at(10)
    assert pending.cap == pytest.approx(9)
    for _ in range(2):
        pending.ended()  # 8 in flight, under the cap, and the gaps still slow
    clock.t += 0.5
    for _ in range(25):
        pending.gap(0.3)
    pending.admits()
    assert pending.cap == pytest.approx(9)  # within the cooldown
    clock.t += 0.5
    slow_window(pending, clock)
    pending.admits()
    assert pending.cap == 8  # 0.9 x 8 = 7.2, but the minimum is 8


def test_a_cap_that_does_not_bind_holds_so_the_next_overload_is_no_flood() -> None:
    """Steady load under the cap, gaps quick for long: the cap stays where the slow gaps put it
    (the old door regrew x 1.5 a second here and let the next overload in as a flood)."""
    pending, clock = cut_at(40)
    assert pending.cap == pytest.approx(36)
    for _ in range(10):
        pending.ended()  # 30 in flight: steady, under the cap, well over min_cap
    for _ in range(30):
        quick_window(pending, clock)
        assert pending.admits()
    assert pending.cap == pytest.approx(36)
    for _ in range(6):
        streaming(pending)  # the overload starts: 36 in flight, the 37th is refused
    assert not pending.admits() and pending.reason == "stream cap"
    quick_window(pending, clock)
    assert pending.admits()  # binding now: it grows, by 5%
    assert pending.cap == pytest.approx(37.8)


def test_gaps_slow_with_fewer_than_min_cap_in_flight_cut_nothing() -> None:
    """The last streams of a phase leave slow gaps in the window with almost nothing in flight:
    they are not what a cap could fix, and the cap learned from the load is kept."""
    pending, clock = cut_at(40)
    for _ in range(35):
        pending.ended()  # 5 in flight, min_cap 8
    clock.t += 2.0  # past the cooldown
    slow_window(pending, clock)
    assert not pending.admits() and pending.reason == "slow streams"
    assert pending.cap == pytest.approx(36)


def test_a_quiet_spell_keeps_the_cap_and_the_next_burst_grows_it_while_it_binds() -> None:
    """After the load is gone the cap holds (the old door grew it x 1.5 a second once idle, and the
    next overload came in as a flood); a burst finds the cap and grows it 5% (at least 1) a second
    while the gaps stay quick."""
    pending, clock = cut_at(20)
    assert pending.cap == pytest.approx(18)
    for _ in range(20):
        pending.ended()  # idle now
    for _ in range(60):
        quick_window(pending, clock)
        assert pending.admits()
    assert pending.cap == pytest.approx(18)
    caps = []
    for _ in range(4):
        while pending.admits():
            streaming(pending)  # the burst fills the cap
        assert pending.reason == "stream cap"
        quick_window(pending, clock)
        pending.admits()
        caps.append(round(pending.cap, 2))
    assert caps == [19, 20, 21, 22.05]


def test_too_few_gaps_or_no_gap_target_never_close_it() -> None:
    pending, clock = pending_of()
    for _ in range(19):
        pending.gap(5.0)
    assert pending.admits()  # 19 < min_gaps
    off, _ = pending_of(gap_target_s=None)
    for _ in range(100):
        off.gap(5.0)
    assert off.admits()


class App:
    """A stand-in for what the proxy forwards to: answers each request with `status` once released."""

    def __init__(self, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status, self.headers = status, headers or []
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.calls += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(mw: object, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await mw({"type": "http", "path": path, "headers": headers or []}, receive, send)  # type: ignore[operator]
    return sent


async def settle(cond, rounds: int = 100) -> None:  # noqa: ANN001
    for _ in range(rounds):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_the_middleware_refuses_while_queueing_in_openai_shape_and_never_forwards() -> None:
    pending, clock = pending_of()
    app = App()
    counted: list[str] = []
    mw = PendingMiddleware(app, pending, count=counted.append)
    held = [asyncio.create_task(call(mw, "/llm/v1/completions")) for _ in range(4)]  # any route prefix
    await settle(lambda: app.calls == 4)
    clock.t += 3.0
    refused = await call(mw, "/v1/chat/completions")
    start, body = refused[0], json.loads(refused[1]["body"])
    assert start["status"] == 429 and app.calls == 4
    assert dict(start["headers"])[b"retry-after"] == b"3"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "rate_limit_exceeded" and "wait 3.0 s" in body["error"]["message"]
    assert pending.num_refused == 1 and counted == ["queueing"]
    retried = await call(mw, "/v1/completions", [(b"x-stainless-retry-count", b"1")])  # the SDK's retry
    assert retried[0]["status"] == 429 and pending.num_refused == 2 and pending.num_refused_retries == 1
    app.release.set()
    for done in await asyncio.gather(*held):
        assert done[0]["status"] == 200
    clock.t += 0.06
    assert pending.admits()


async def test_other_routes_pass_even_when_closed() -> None:
    pending, _ = pending_of()
    pending.saw_429(5)
    app = App()
    app.release.set()
    mw = PendingMiddleware(app, pending)
    assert (await call(mw, "/health"))[0]["status"] == 200
    assert (await call(mw, "/v1/models"))[0]["status"] == 200
    assert (await call(mw, "/v1/completions"))[0]["status"] == 429 and app.calls == 2


async def test_a_downstream_429_is_passed_on_and_closes_the_door() -> None:
    pending, clock = pending_of()
    app = App(429, [(b"retry-after", b"4")])
    app.release.set()
    counted: list[str] = []
    mw = PendingMiddleware(app, pending, count=counted.append)
    first = await call(mw, "/v1/completions")
    assert first[0]["status"] == 429 and app.calls == 1  # the ingress's own answer, untouched
    second = await call(mw, "/v1/completions")
    assert second[0]["status"] == 429 and app.calls == 1  # the proxy's
    assert dict(second[0]["headers"])[b"retry-after"] == b"4"
    assert "refused a request moments ago" in json.loads(second[1]["body"])["error"]["message"]
    assert counted == ["refused downstream"]
    clock.t += 0.5
    app.status = 200
    assert (await call(mw, "/v1/completions"))[0]["status"] == 200 and app.calls == 2


async def test_the_middleware_times_the_gaps_between_a_streams_chunks() -> None:
    pending, clock = pending_of()

    async def stream(scope, receive, send) -> None:  # noqa: ANN001
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            clock.t += 0.3
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await call(PendingMiddleware(stream, pending), "/v1/completions")
    assert len(pending._gaps) == 3 and pending._num_slow == 3  # three 0.3 s gaps, the last to the end
    assert pending.in_flight == 0  # counted from admission to the stream's end


def test_the_door_settings_follow_the_tbt_slo_as_a_p99_unless_set() -> None:
    default = ProxyDoorConfig().settings(None)
    assert (default.gap_target_s, default.slow_share) == (pytest.approx(0.25), pytest.approx(0.1))
    assert default.wait_target_s == DEFAULT_WAIT_TARGET_MS / 1000 and default.enabled
    slo = ProxyDoorConfig().settings(1000.0)  # gaps the SLO allows are not refused
    assert (slo.gap_target_s, slo.slow_share) == (pytest.approx(1.0), pytest.approx(0.01))
    own = ProxyDoorConfig(gap_target_ms=300).settings(100.0)  # their own target keeps the default p90
    assert (own.gap_target_s, own.slow_share) == (pytest.approx(0.3), pytest.approx(0.1))
    assert ProxyDoorConfig(gap_quantile=0.95).settings(100.0).slow_share == pytest.approx(0.05)
    assert ProxyDoorConfig(watch_gaps=False).settings(100.0).gap_target_s is None
    with pytest.raises(ValueError, match="min_requests"):
        ProxyDoorConfig(min_requests=9, max_requests=8)
    with pytest.raises(ValueError, match="gap_quantile"):
        ProxyDoorConfig(gap_quantile=1.0)


def test_serves_callback_builds_both_parts_and_takes_published_settings() -> None:
    built = middlewares()
    assert [m.cls for m in built] == [PendingMiddleware, StreamLimitMiddleware]  # the limit outermost
    limit, pending, door = built[1].kwargs["limit"], built[0].kwargs["pending"], built[0].kwargs["door"]
    assert limit.max_limit == 1024 and built[1].kwargs["where"] == "proxy"
    assert pending.gap_target_s == pytest.approx(0.25) and pending.min_gaps == 20
    published = [ProxyDoorConfig(max_requests=16, min_requests=2, wait_target_ms=750,
                                 gap_quantile=0.99, gap_target_ms=100).settings(None)]
    door._read = lambda: published[0]

    async def refreshed() -> None:
        door.refresh()
        await door._reading
        door.refresh()  # within REFRESH_S: no second read
        assert door._reading.done()

    asyncio.run(refreshed())
    assert limit.max_limit == 16 and limit.min_limit == 2 and limit.limit <= 16
    assert pending.target_s == pytest.approx(0.75) and pending.max_cap == 16 and pending.cap <= 16
    assert pending.gap_target_s == pytest.approx(0.1) and pending.slow_share == pytest.approx(0.01)
    assert pending.min_gaps == 200  # two gaps over the target at the quantile's edge, at least
    assert json.loads(door.summary)["max_requests"] == 16  # what /health shows
    door.apply(ProxyDoorConfig(enabled=False).settings(None))  # off: both parts let everything by
    limit.in_flight = 10_000
    assert limit.admits() and pending.admits()


def test_the_doors_refusals_reach_the_controller_as_unsized_refused_demand() -> None:
    built = middlewares()
    limit, pending, door = built[1].kwargs["limit"], built[0].kwargs["pending"], built[0].kwargs["door"]
    sent: list = []
    door._report = lambda settings, counts: sent.append((settings.deployment, counts))
    settings = dataclasses.replace(ProxyDoorConfig().settings(None), controller_name="ctl",
                                   controller_namespace="ns", deployment="SERVE_REPLICA::llm#LLMServer")
    door._read = lambda: settings

    async def refresh() -> None:
        door._read_at = float("-inf")
        door.refresh()
        await door._reading

    asyncio.run(refresh())  # the baseline
    pending.num_refused, pending.num_refused_retries = 4, 1  # a retry: counted before
    limit.num_refused, limit.num_refused_retries = 3, 1
    door.demand._sent_at = float("-inf")  # a report is due
    asyncio.run(refresh())
    assert [(d, c.refused_unsized) for d, c in sent] == [("SERVE_REPLICA::llm#LLMServer", 0),
                                                         ("SERVE_REPLICA::llm#LLMServer", 5)]
    door._read = lambda: dataclasses.replace(settings, controller_name="")  # not reported
    pending.num_refused = 9
    door.demand._sent_at = float("-inf")
    asyncio.run(refresh())
    assert len(sent) == 2


def test_a_door_whose_process_carries_its_demand_leaves_it_to_the_carrier() -> None:
    """In an engine replica's own server the replica's load reports carry the door's refusals
    (`ReplicaIngress`): `doors_here` finds it, `demand_due` gives them once the app's deployment
    is known, and the door's own reads then send nothing."""
    from app.proxy_door import doors_here

    built = middlewares()
    pending, door = built[0].kwargs["pending"], built[0].kwargs["door"]
    assert door in doors_here()
    sent: list = []
    door._report = lambda settings, counts: sent.append(counts)
    assert door.demand_due(0.0) is None  # no deployment yet: nothing to report against
    settings = dataclasses.replace(ProxyDoorConfig().settings(None), controller_name="ctl",
                                   controller_namespace="ns", deployment="SERVE_REPLICA::llm#LLMServer")
    door._read = lambda: settings
    door.carried = True

    async def refresh() -> None:
        door._read_at = float("-inf")
        door.refresh()
        await door._reading

    asyncio.run(refresh())
    assert door.settings == settings and sent == []  # read, not reported
    assert door.demand_due(0.0) == ("SERVE_REPLICA::llm#LLMServer", door.source, DemandCounts())  # baseline
    pending.num_refused = 3
    assert door.demand_due(0.5) is None  # within REPORT_EVERY_S of the last
    deployment, source, counts = door.demand_due(1.5)
    assert counts.refused_unsized == 3 and sent == []


def test_proxy_env_sets_the_callback_and_priority_unless_given() -> None:
    assert proxy_env({"A": "1"}) == {"A": "1", CALLBACK_ENV: IMPORT_PATH, NICENESS_ENV: "0"}
    assert proxy_env({HA_PROXY_ENV: "1"})[HA_PROXY_ENV] == "1"  # HAProxy mode, if the caller says so
    assert proxy_env({NICENESS_ENV: "5"})[NICENESS_ENV] == "5"  # the caller's priority wins
    assert proxy_env({CALLBACK_ENV: "mine:f"})[CALLBACK_ENV] == "mine:f"


def test_a_slow_way_to_the_ingress_closes_the_door_until_it_leaves_the_window() -> None:
    """The median of the last second's hops over the target closes it (Retry-After: that median,
    rounded up); three slow hops are too few, one slow among quick ones is no standing queue; the
    hops age out of the window; no target: never."""
    pending, clock = pending_of()
    pending.hop_target_s = 0.5
    for _ in range(3):
        pending.hop(2.0)
    assert pending.admits()  # 3 < min_hops
    clock.t += 0.06
    pending.hop(0.1)
    pending.hop(0.1)
    assert not pending.admits() and pending.reason == "slow hop"  # 0.1, 0.1, 2, 2, 2: median 2 s
    assert pending.median_hop_s == 2.0 and pending.retry_after == 2
    clock.t += 1.0  # the 2 s hops leave the window; the 0.1 ones are too few to judge
    assert pending.admits() and pending.median_hop_s == 0.0
    for seconds in (0.1, 0.2, 0.1, 3.0, 0.1):
        pending.hop(seconds)
    clock.t += 0.06
    assert pending.admits() and pending.median_hop_s == pytest.approx(0.1)
    off, clock = pending_of()
    assert off.hop_target_s is None
    for _ in range(10):
        off.hop(9.0)
    clock.t += 0.06
    assert off.admits()


async def test_the_middleware_times_the_way_to_the_ingress_from_its_stamp() -> None:
    """A forwarded request's hop is the wait for its response's start less the ingress's own
    milliseconds on it: 1.5 s waited, 1.2 s of it at the ingress, is 0.3 s on the way."""
    pending, clock = pending_of()
    pending.hop_target_s = 0.5

    def ingress(took_s: float, at_ingress_ms: int):  # noqa: ANN202
        async def app(scope, receive, send) -> None:  # noqa: ANN001
            clock.t += took_s
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(INGRESS_MS_HEADER, str(at_ingress_ms).encode())]})
            await send({"type": "http.response.body", "body": b"{}"})
        return app

    await call(PendingMiddleware(ingress(1.5, 1200), pending), "/v1/completions")
    assert [h for _, h in pending._hops] == [pytest.approx(0.3)]
    reached = asyncio.Event()

    async def held(scope, receive, send) -> None:  # noqa: ANN001 - waits 1 s on the way, refused at once
        await reached.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(INGRESS_MS_HEADER, b"0")]})
        await send({"type": "http.response.body", "body": b"{}"})

    slow = [asyncio.create_task(call(PendingMiddleware(held, pending), "/v1/completions")) for _ in range(4)]
    await settle(lambda: pending.in_flight == 4)
    clock.t += 1.0
    reached.set()
    await asyncio.gather(*slow)
    clock.t += 0.06
    refused = await call(PendingMiddleware(ingress(0.0, 0), pending), "/v1/completions")
    assert refused[0]["status"] == 429
    assert "took 1.0 s to reach the ingress" in json.loads(refused[1]["body"])["error"]["message"]
    fresh, _ = pending_of()
    fresh.hop_target_s = 0.5
    unstamped = App()  # an answer without the ingress's stamp (no ingress limit there): no hop
    unstamped.release.set()
    await call(PendingMiddleware(unstamped, fresh), "/v1/completions")
    assert unstamped.calls == 1 and not fresh._hops
