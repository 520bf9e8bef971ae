"""Async streaming front of the engine: the batching loop runs on its own thread.

HTTP handling (asyncio) never blocks a forward pass and a forward pass never blocks
request intake: callers put requests and aborts into an inbox; the loop thread drains it
between iterations and pushes each delta back onto the caller's event loop. A delta's text is
built and decoded there, on the caller's loop, not on the engine's (`outputs.Delta`,
`outputs.StreamText`): the loop thread's work per pass is what the device waits for.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replicas.config import DEFAULT_WEDGE_TIMEOUT_S
from replicas.outputs import Delta, StreamText
from replicas.scheduling.prefix_hash import PrefixSketch
from replicas.protocol import RequestOutput, SamplingParams
from replicas.request import Request
from replicas.scheduling.batch import QueueCounts

if TYPE_CHECKING:  # torch's: the engine process's parent streams without loading it
    from replicas.engine import Engine

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
IDLE_REFRESH_S = 5.0  # while idle, observers hear `on_idle` this often (gauges stay exported)
SKETCH_INTERVAL_S = 0.1  # the prefix cache's sketch for load reports is rebuilt at most this often


class EngineDeadError(RuntimeError):
    """The engine loop is not running; the request cannot be served."""


QUEUED = "queued"  # the loop's answer to an intake that the engine accepted (else: why not)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | Delta | BaseException) -> None:
        _call_in(self.loop, self.queue.put_nowait, item)


def _call_in(loop: asyncio.AbstractEventLoop, fn: Any, arg: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Delta]]) -> None:
    """On the caller's loop: one pass's deltas into their streams' queues."""
    for q, out in items:
        q.put_nowait(out)


def hand_out(items: Iterable[tuple[_Stream, Any]]) -> None:
    """Each item into its stream's queue, with one wake-up of each caller's event loop (not one
    per stream)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for stream, out in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, out))
    for loop, batch in by_loop.items():
        _call_in(loop, _put_all, batch)


def _merged(first: RequestOutput | Delta | BaseException,
            q: asyncio.Queue) -> list[RequestOutput | Delta | BaseException]:
    """`first` and everything queued behind it, each sample's deltas merged into one (in order;
    an exception ends the list). A caller slower than the loop then hands every hop downstream
    (Serve's stream, SSE) fewer, larger items."""
    merged: dict[str, RequestOutput | Delta] = {}
    item = first
    while True:
        if isinstance(item, BaseException):
            return [*merged.values(), item]
        before = merged.get(item.request_id)
        merged[item.request_id] = item if before is None else before.followed_by(item)
        if q.empty():
            return list(merged.values())
        item = q.get_nowait()


async def read_stream(q: asyncio.Queue, unfinished: set[str], text: StreamText) -> AsyncIterator[RequestOutput]:
    """A request's deltas from `q`, their text decoded (merged deltas: one decode for their
    tokens together), until each sample in `unfinished` finished (removed from it as it does);
    an exception queued is raised."""
    ready: deque[RequestOutput | Delta | BaseException] = deque()  # merged, to hand out in order
    while unfinished:
        if not ready:
            ready.extend(_merged(await q.get(), q))
        item = ready.popleft()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            unfinished.discard(item.request_id)
        yield text.fill(item)


class AsyncEngine:
    def __init__(self, engine: Engine, wedge_timeout_s: float = DEFAULT_WEDGE_TIMEOUT_S,
                 stream_interval_s: float = 0.0) -> None:
        """`stream_interval_s`: a stream hands its caller a delta about this often (the first
        and the last at once), the tokens in between merged into it; 0: every pass's. The engine
        holds them (`Engine.stream_interval_s`): deltas it would merge are not built at all."""
        self.engine = engine
        self.wedge_timeout_s = wedge_timeout_s
        engine.stream_interval_s = stream_interval_s
        engine.outputs.deltas_by_caller = True  # the streams build and decode their deltas (`_iterate`)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._busy_since: float | None = None  # set while a step runs (wedge detection)
        self.error: BaseException | None = None
        # Published by the loop thread after every change, read by any thread: the scheduler's
        # counts and the TBT samples (count ever taken, latest ones), never half-updated.
        self.load_snapshot: QueueCounts = engine.last_load
        self.sketch_snapshot: PrefixSketch | None = engine.blocks.sketch()
        self._sketch_at = time.monotonic()
        self.tbt_snapshot: tuple[int, tuple[float, ...]] = (0, ())
        self._idle_told_at: float | None = None  # when observers last heard on_idle
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) ---------------------------------------

    async def add_request(self, prompts: Sequence[Sequence[int]], params: SamplingParams, request_id: str,
                          priority: int = 0, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Check the request against the engine's limits here, queue it on the loop (where the
        engine refuses an id already in use) and, once queued, return the stream of its deltas;
        a refusal is raised (InvalidRequestError) before anything streams. One or more prompts
        (each its token ids), `params.n` samples each, every delta carrying its choice `index`
        (sample j of prompt p is choice p * n + j).

        Token ids only: no tokenizing on the caller's loop (the deltas' text is decoded there). The
        `arrival_time` (perf_counter clock; default now) is when the request arrived, which may
        be before it reached this replica: TTFT and the queue deadline count from it.
        """
        if isinstance(prompts, str) or any(isinstance(p, str) for p in prompts):
            raise TypeError("AsyncEngine.add_request takes prompt token ids, not text")
        if not prompts:
            raise ValueError("AsyncEngine.add_request takes one prompt at least")
        now = time.perf_counter()
        arrival = now if arrival_time is None else min(arrival_time, now)
        reqs = self._requests(prompts, params, request_id, priority, arrival)
        if not self.is_alive():
            raise EngineDeadError("engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(reqs, stream)
        if not self.is_alive():  # it stopped meanwhile: nobody else will answer
            self._refuse_inbox(EngineDeadError("engine loop is not running"))
        try:
            answer = await stream.queue.get()
        except BaseException:  # the caller left before the answer: take back what was queued
            for req in reqs:
                self._abort_own(req.request_id, stream)
            raise
        if isinstance(answer, BaseException):
            raise answer
        return self._iterate(reqs, stream)

    def _requests(self, prompts: Sequence[Sequence[int]], params: SamplingParams, request_id: str,
                  priority: int, arrival: float) -> list[Request]:
        """One request's samples, checked (InvalidRequestError): each prompt's n samples after
        the previous prompt's, all forked from the first."""
        reqs: list[Request] = []
        for ids in prompts:
            reqs += self.engine.make_requests(ids, params, request_id, priority, arrival, first_index=len(reqs))
        for req in reqs[1:]:
            req.first_choice = reqs[0]
        return reqs

    def _submit(self, reqs: list[Request], stream: Any) -> None:
        """Hand `reqs` to the loop, which answers on `stream` (QUEUED, or why not)."""
        self._inbox.put(("add", reqs, stream))
        self._wake.set()

    async def _iterate(self, reqs: list[Request], stream: _Stream) -> AsyncIterator[RequestOutput]:
        """The deltas of the request's samples (one stream for all n), until each finished."""
        unfinished = {r.request_id for r in reqs}
        try:
            async for out in read_stream(stream.queue, unfinished, StreamText.of(self.engine.tokenizer, reqs)):
                yield out
        finally:
            for request_id in unfinished:  # the caller went away: free its KV blocks next iteration
                self._abort_own(request_id, stream)

    def abort(self, request_id: str) -> None:
        """Stop the request with this id (its stream ends with its last delta)."""
        self._abort_own(request_id, None)

    def _abort_own(self, request_id: str, stream: _Stream | None) -> None:
        """Stop the request if `stream` streams it (None: whichever does): a caller that leaves
        never stops another's request that took the same id."""
        self._inbox.put(("abort", request_id, stream))
        self._wake.set()

    def is_alive(self) -> bool:
        # `error` is set first thing when the loop dies, before it refuses its inbox: a request
        # queued after that refusal sees it here (add_request checks again after queueing).
        return self._thread.is_alive() and not self._stop.is_set() and self.error is None

    def is_healthy(self) -> bool:
        """False when the loop died or one iteration has run longer than the wedge timeout."""
        busy = self._busy_since
        wedged = busy is not None and time.monotonic() - busy > self.wedge_timeout_s
        return self.is_alive() and not wedged

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- loop side (the engine thread) -------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._tell_idle()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._idle_told_at = None
                self._busy_since = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a failed pass must not kill the loop, unless it says so
                    if getattr(exc, "fatal", False):  # e.g. a tensor-parallel group broken for good
                        raise
                    logger.exception("engine step failed; aborting the requests in flight")
                    self._fail_all(exc)
                    outputs = []
                finally:
                    self._busy_since = None
                # Publish the load before delivering, so no caller holds a token that the
                # snapshot still shows as waiting.
                self._publish()
                self._deliver_all(outputs)
            self._refuse_inbox(EngineDeadError("engine loop stopped"))
        except BaseException as exc:  # a fatal pass (a broken tensor-parallel group), or a bug
            # The thread ends here. Kept for health (the replica turns unhealthy and Serve replaces
            # it) and logged once: raised on, threading's hook would print it a second time.
            self.error = exc
            logger.exception("engine loop died")
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _tell_idle(self) -> None:
        """On becoming idle, and every IDLE_REFRESH_S after, let observers record the empty load."""
        now = time.monotonic()
        if self._idle_told_at is not None and now - self._idle_told_at < IDLE_REFRESH_S:
            return
        self._idle_told_at = now
        for observer in self.engine.observers:
            on_idle = getattr(observer, "on_idle", None)  # an optional hook
            if on_idle is not None:
                try:
                    on_idle(self.engine)
                except Exception:  # metrics must never stop the loop
                    logger.exception("observer on_idle failed")

    def _taken(self) -> Iterator[tuple[str, Any, _Stream | None]]:
        """The inbox's items, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for kind, payload, stream in self._taken():
            if kind == "add":
                reqs: list[Request] = payload
                try:
                    for req in reqs:
                        self.engine.enqueue(req)
                except Exception as exc:  # e.g. a duplicate id: only this request fails
                    if not isinstance(exc, ValueError):
                        logger.exception("enqueue of %s failed", req.request_id)
                    for queued in reqs[:reqs.index(req)]:
                        self.engine.abort(queued.request_id)
                    stream.put(exc)
                    continue
                for req in reqs:
                    self._streams[req.request_id] = stream
                stream.put(QUEUED)
            elif stream is None or self._streams.get(payload) is stream:
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver(out)
        self._publish()

    def _refuse_inbox(self, exc: BaseException) -> None:
        """Answer every intake still in the inbox with `exc` (the loop will not take them)."""
        for kind, _, stream in self._taken():
            if kind == "add":
                stream.put(exc)

    def _publish(self) -> None:
        engine = self.engine
        self.load_snapshot = engine.last_load
        now = time.monotonic()
        if now - self._sketch_at >= SKETCH_INTERVAL_S:  # rebuilt here: the loop owns the cache
            self.sketch_snapshot, self._sketch_at = engine.blocks.sketch(), now
        if self.tbt_snapshot[0] != engine.num_tbt_samples:
            self.tbt_snapshot = (engine.num_tbt_samples, tuple(engine.recent_tbt))

    def _deliver_all(self, outputs: list[RequestOutput | Delta]) -> None:
        """A pass's deltas, to their callers."""
        streams = self._streams
        pairs = []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            pairs.append((stream, out))
            if out.finished:
                del streams[out.request_id]
        hand_out(pairs)

    def _deliver(self, out: RequestOutput | Delta) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        if isinstance(exc, EngineDeadError):  # the loop ends: no intake will be answered by it
            self._refuse_inbox(exc)
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()
