"""The ingress's in-flight limit: cut multiplicatively (at most once a cooldown) while its event
loop lags over the target, grown back when it does not (slowly while it binds, fast when it
does not), never outside [min, max]; admits below it, and its refusal (a 429 in OpenAI's shape,
before the body is read) carries the Retry-After the rate requests end gives."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message

from app.middleware import INGRESS_MS_HEADER, StreamLimitMiddleware
from app.stream_limit import DECREASE, GROW_IDLE, PERSIST, StreamLimit, watch_loop

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def limit_of(max_limit: int = 100, min_limit: int = 4) -> tuple[StreamLimit, Clock]:
    clock = Clock()
    return StreamLimit(max_limit, target_s=0.05, min_limit=min_limit, interval_s=0.5,
                       cooldown_s=1.0, clock=clock), clock


def interval(limit: StreamLimit, clock: Clock, lag_s: float, samples: int = 4) -> None:
    """One control interval of watcher samples, all with this lag."""
    for _ in range(samples):
        clock.t += 0.5 / samples
        limit.observe(lag_s)


def test_admits_until_the_limit_and_counts_what_leaves() -> None:
    limit, _ = limit_of(max_limit=3, min_limit=1)
    for _ in range(3):
        assert limit.admits()
        limit.enter()
    assert not limit.admits() and limit.in_flight == 3
    limit.leave()
    assert limit.admits() and limit.in_flight == 2


def test_a_standing_lag_cuts_from_what_is_in_flight_once_a_cooldown() -> None:
    limit, clock = limit_of(max_limit=100)
    for _ in range(40):
        limit.enter()
    for _ in range(PERSIST - 1):  # over, but not yet through PERSIST intervals: hold
        interval(limit, clock, lag_s=0.2)
        assert limit.limit == 100
    interval(limit, clock, lag_s=0.2)  # standing: min(100, 40) x 0.8
    assert limit.limit == int(40 * DECREASE) == 32 and limit.state.lag_s == 0.2
    interval(limit, clock, lag_s=0.2)  # 0.5 s later: inside the cooldown, no second cut
    assert limit.limit == 32
    interval(limit, clock, lag_s=0.2)  # 1.0 s after the cut: cut again, from the limit now
    assert limit.limit == int(32 * DECREASE) == 25
    for _ in range(40):
        interval(limit, clock, lag_s=0.2)
    assert limit.limit == 4  # never below min_limit


def test_a_burst_passing_through_does_not_cut() -> None:
    limit, clock = limit_of(max_limit=100)
    for _ in range(90):
        limit.enter()
    for lag in [0.2, 0.3, 0.01, 0.2, 0.2, 0.2, 0.02, 0.1] * 3:  # high, but dips under the target
        interval(limit, clock, lag_s=lag)
    assert limit.limit == 100


def test_the_mean_lag_of_an_interval_decides_not_one_spike() -> None:
    limit, clock = limit_of(max_limit=100)
    for _ in range(50):
        limit.enter()
    for lag in (0.0, 0.0, 0.0, 0.16):  # one 160 ms pause (a GC), mean 40 ms: under 50
        clock.t += 0.125
        limit.observe(lag)
    assert limit.limit == 100


def test_grows_slowly_after_lag_and_fast_once_settled_never_over_the_max() -> None:
    limit, clock = limit_of(max_limit=100)
    for _ in range(20):
        limit.enter()
    for _ in range(30):  # cut to the floor
        interval(limit, clock, lag_s=1.0)
    assert limit.limit == 4
    interval(limit, clock, lag_s=0.01)
    assert limit.limit == 5  # + max(1, 4 x 5%): a lull inside an overload opens the door slowly
    for _ in range(8):  # 4.5 s under the target since the last lag over it: still additive
        interval(limit, clock, lag_s=0.01)
    assert limit.limit == 13
    interval(limit, clock, lag_s=0.01)  # 5 s settled: fast
    assert limit.limit == int(13 * GROW_IDLE + 1.0) == 20
    for _ in range(20):
        interval(limit, clock, lag_s=0.0)
    assert limit.limit == 100  # never over the max


def test_retry_after_is_the_excess_over_the_rate_requests_end() -> None:
    limit, clock = limit_of(max_limit=10, min_limit=10)
    assert limit.retry_after_s() == 5  # nothing ended lately: a while
    for _ in range(12):
        limit.enter()
    for _ in range(2):  # 2 ended in the last 10 s: 0.2 a second
        clock.t += 1.0
        limit.leave()
    # 10 in flight, limit 10: 1 over -> 1 / 0.2 = 5 s
    assert limit.retry_after_s() == 5
    limit.enter()
    limit.enter()  # 12 in flight: 3 over -> 15 s
    assert limit.retry_after_s() == 15
    clock.t += 30.0  # those endings are old now
    assert limit.retry_after_s() == 5


async def test_the_watcher_reports_how_late_its_timer_fires() -> None:
    seen: list[float] = []

    class Recorder(StreamLimit):
        def observe(self, lag_s: float) -> None:
            seen.append(lag_s)

    loop = asyncio.get_running_loop()
    rec = Recorder(10, target_s=0.05, clock=loop.time)
    task = loop.create_task(watch_loop(rec.observe, loop.time, tick_s=0.01))
    for _ in range(500):
        if len(seen) >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert len(seen) >= 3 and all(lag >= -0.005 for lag in seen)


class App:
    """A stand-in ASGI app: holds each request until released, then answers 200."""

    def __init__(self, limit: StreamLimit | None) -> None:
        self.state = type("State", (), {"stream_limit": limit})()
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.calls += 1
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(mw: StreamLimitMiddleware, app: App, path: str,
               headers: list[tuple[bytes, bytes]] | None = None) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await mw({"type": "http", "path": path, "app": app, "headers": headers or []}, receive, send)
    return sent


async def test_the_middleware_refuses_over_the_limit_in_openai_shape_and_counts_until_the_end() -> None:
    limit, _ = limit_of(max_limit=2, min_limit=1)
    app = App(limit)
    mw = StreamLimitMiddleware(app)
    held = [asyncio.create_task(call(mw, app, "/v1/completions")) for _ in range(2)]
    for _ in range(100):
        if limit.in_flight == 2:
            break
        await asyncio.sleep(0)
    assert limit.in_flight == 2 and app.calls == 2
    refused = await call(mw, app, "/v1/chat/completions")
    start, body = refused[0], json.loads(refused[1]["body"])
    assert start["status"] == 429 and app.calls == 2  # never reached the app
    assert dict(start["headers"])[b"retry-after"] == b"5"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "rate_limit_exceeded" and "2 requests are in flight" in body["error"]["message"]
    assert limit.num_refused == 1 and limit.num_refused_demand == 1
    retried = await call(mw, app, "/v1/completions", [(b"x-stainless-retry-count", b"2")])  # the SDK's retry
    assert retried[0]["status"] == 429 and limit.num_refused == 2 and limit.num_refused_demand == 1
    app.release.set()  # the held responses end: they leave the count
    for done in await asyncio.gather(*held):
        assert done[0]["status"] == 200
    assert limit.in_flight == 0 and limit.admits()


async def test_the_middleware_never_limits_other_routes_or_without_a_limit() -> None:
    limit, _ = limit_of(max_limit=1, min_limit=1)
    limit.in_flight = 1  # full
    app = App(limit)
    app.release.set()
    mw = StreamLimitMiddleware(app)
    assert (await call(mw, app, "/health"))[0]["status"] == 200
    assert (await call(mw, app, "/v1/models"))[0]["status"] == 200
    off = App(None)
    off.release.set()
    assert (await call(StreamLimitMiddleware(off), off, "/v1/completions"))[0]["status"] == 200


async def test_the_ingress_stamps_its_own_time_on_each_generation_responses_start() -> None:
    """At the ingress, a generation response's start carries the milliseconds it took there
    (`INGRESS_MS_HEADER`: the door takes it off its own wait to time the way to the ingress); a
    refusal carries 0; the proxy's own limit stamps nothing."""
    limit, _ = limit_of(max_limit=1, min_limit=1)
    app = App(limit)
    mw = StreamLimitMiddleware(app)
    held = asyncio.create_task(call(mw, app, "/v1/completions"))
    for _ in range(100):
        if limit.in_flight == 1:
            break
        await asyncio.sleep(0)
    refused = await call(mw, app, "/v1/completions")
    assert dict(refused[0]["headers"])[INGRESS_MS_HEADER] == b"0"
    await asyncio.sleep(0.05)  # the held request's time at the ingress
    app.release.set()
    ms = dict((await held)[0]["headers"])[INGRESS_MS_HEADER]
    assert ms.isdigit() and int(ms) >= 40
    assert (await call(mw, app, "/health"))[0]["headers"] == []  # other routes: untouched
    proxy_limit, _ = limit_of(max_limit=4, min_limit=1)
    at_proxy = App(proxy_limit)
    at_proxy.release.set()
    sent = await call(StreamLimitMiddleware(at_proxy, proxy_limit, where="proxy"), at_proxy, "/v1/completions")
    assert INGRESS_MS_HEADER not in dict(sent[0]["headers"])
