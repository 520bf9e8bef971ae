"""The engine loop in a process of its own (`replica.engine_process`), as vLLM's EngineCore.

In one process the engine's loop thread and the replica's event loop (HTTP, SSE writes,
admission, detokenizing) share one GIL: under load each torch call the loop makes waits for the
event loop to let go, and passes run long (measured: a neighbour thread busy a third of the
time stretched 128-stream decode passes 1.6x; the same work in another process, not at all).
Here the engine and its loop run in a child process, and the replica's process keeps only
what faces its callers:

- `ProcessEngine` (the replica's side) has `AsyncEngine`'s interface: `add_request` answers
  with the stream of a request's deltas (their text decoded here, `StreamText`), `abort`,
  health, and the snapshots the replica's load reports read (`EngineMirror`: what the engine
  last published).
- The child (`child_main`, started as `python -c`) runs an `AsyncEngine` whose streams are
  the parent's, over one socket: a request's intake and aborts come in; a pass's deltas (as
  `Delta.fields` tuples: cheap to pickle, built and decoded here), the load, new TBT samples,
  iterations and metric records since the last message go out in one message, sent by every
  pass that has a delta due, else only once STATE_EVERY_S has passed since the last.

The child dies with its parent: it reads until the socket closes. Metrics are recorded in the
child into a list (`_Forwarding`) and replayed by the parent into its own backend (Ray's metrics
work only in a Ray worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from replicas.outputs import Delta, StreamText, output_of
from replicas.protocol import RequestOutput, SamplingParams, sample_id
from replicas.scheduling.batch import QueueCounts
from replicas.serving.async_engine import AsyncEngine, EngineDeadError, _Stream, hand_out, read_stream
from replicas.serving.startup_gc import freeze_startup_objects

logger = logging.getLogger(__name__)

STATE_EVERY_S = 0.05  # a pass with no delta due sends its state only if the last went this long ago
# (half the load reporter's 100 ms period: nothing in the replica reads it fresher; at 20 ms the
# reader thread took 2.5 ms of CPU per streamed request, at 50 ms 1.3: docs/results/http_path.md)
BEAT_S = 0.5  # the child tells its state this often while idle (health, gauges)
START_TIMEOUT_S = 900.0  # the child's model load and warm-up, at most
ITERATIONS_KEPT = 4096  # the mirror's recent passes (the load reporter reads at most 1,024 back)


class PassTime(NamedTuple):
    """A pass as the replica's mirror keeps it: what the load reporter reads of an
    `IterationStats`. The child sends them as one flat list of floats (start, duration, ...):
    a hundred passes a stream as dataclasses were a third of the messages' unpickling."""

    start: float
    duration: float


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """What the child builds: `factory()` returns the engine (picklable: a module-level function
    and its arguments); metrics recorded for `metrics_model` when set; a pass trace when set."""

    factory: Callable[[], Any]
    wedge_timeout_s: float
    stream_interval_s: float
    metrics_model: str | None = None
    tbt_slo_s: float | None = None
    pass_trace_dir: str | None = None


@dataclasses.dataclass
class EngineState:
    """What the child publishes after each pass (and each beat): the replica's view of it."""

    load: QueueCounts
    tbt: tuple[int, list[float]]  # the samples taken ever, and those since the last state
    drain_rate: float | None
    prefill_tps: float | None
    runner: dict[str, Any]
    sketch: Any = None  # a fresh prefix sketch, when the child rebuilt it


# ---- the replica's side -------------------------------------------------------------------


class _PassTime:
    def __init__(self) -> None:
        self.prefill_tokens_per_s: float | None = None


class _Runner:
    def __init__(self, status: dict[str, Any]) -> None:
        self.update(status)

    def update(self, status: dict[str, Any]) -> None:
        self.path, self.fallback_error = status["path"], status["fallback_error"]
        self.compiles = tuple(status["compiles"])


class EngineMirror:
    """What the replica reads of an engine in another process, as the child last published it:
    the same names as `Engine`'s, read-only (the limits fixed at start, the rest refreshed)."""

    def __init__(self, info: dict[str, Any], state: EngineState) -> None:
        self.config = info["config"]
        self.max_model_len, self.max_batch_total_tokens = info["max_model_len"], info["max_batch_total_tokens"]
        self.vocab_size, self.block_size = info["vocab_size"], info["block_size"]
        self.tokenizer = info["tokenizer"]
        self.iterations: deque[Any] = deque(maxlen=ITERATIONS_KEPT)
        self.pass_time = _PassTime() if info["pass_time"] else None
        self.peers = None  # no tensor-parallel group (refused with replica.engine_process)
        self.runner = _Runner(state.runner)
        self._drain_rate: float | None = None
        self.update(state)

    def update(self, state: EngineState) -> None:
        self._drain_rate = state.drain_rate
        if self.pass_time is not None:
            self.pass_time.prefill_tokens_per_s = state.prefill_tps
        self.runner.update(state.runner)

    def drain_rate(self) -> float | None:
        return self._drain_rate

    def close(self) -> None:  # the child closes its engine when it stops
        pass


class ProcessEngine:
    """`AsyncEngine`'s interface over an engine loop in a child process."""

    def __init__(self, spec: ChildSpec, metrics_backend: Any = None) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        main = f"from replicas.serving.engine_process import child_main; child_main({theirs.fileno()})"
        self._proc = subprocess.Popen([sys.executable, "-c", main], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._metrics = None if metrics_backend is None else HeldReplay(metrics_backend)
        self._streams: dict[int, _Stream] = {}
        self._keys = iter(range(1, 1 << 62))
        self.error: BaseException | None = None
        self.wedge_timeout_s = spec.wedge_timeout_s
        try:
            self._send(("spec", spec))
            if not self._conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
            kind, payload = self._conn.recv()
        except (EOFError, OSError, EngineDeadError) as exc:
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine process exited ({self._proc.returncode}) while starting: see its log "
                               "above") from exc
        except BaseException:
            self._kill()
            raise
        if kind == "failed":
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        info, state, ops = payload
        self.engine = EngineMirror(info, state)
        self._tbt_total, self._tbt_tail = 0, deque(maxlen=info["config"].tbt_sample_window)
        self.sketch_snapshot = state.sketch
        self._apply(state, ops, [])
        self._heard_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    # ---- caller side -------------------------------------------------------------------

    async def add_request(self, prompts: Sequence[Sequence[int]], params: SamplingParams, request_id: str,
                          priority: int = 0, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.add_request`: the child checks and queues the request and answers;
        once queued, the stream of its deltas (their text decoded here)."""
        if isinstance(prompts, str) or any(isinstance(p, str) for p in prompts):
            raise TypeError("ProcessEngine.add_request takes prompt token ids, not text")
        if not prompts:
            raise ValueError("ProcessEngine.add_request takes one prompt at least")
        now = time.perf_counter()  # CLOCK_MONOTONIC: the child's perf_counter reads the same clock
        arrival = now if arrival_time is None else min(arrival_time, now)
        if not self.is_alive():
            raise EngineDeadError("engine process is not running")
        key, stream = next(self._keys), _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[key] = stream
        if self.error is not None:  # the reader failed the streams before this one was added
            self._streams.pop(key, None)
            raise EngineDeadError("engine process is not running")
        prompts = [list(p) for p in prompts]
        try:
            self._send(("add", key, prompts, params, request_id, priority, arrival))
            answer = await stream.queue.get()
        except BaseException:  # the caller left before the answer: take back what was queued
            self._streams.pop(key, None)
            for i in range(len(prompts) * params.n):
                self._try_send(("abort", sample_id(request_id, i), key))
            raise
        if isinstance(answer, BaseException):
            self._streams.pop(key, None)
            raise answer
        n = params.n
        samples = [sample_id(request_id, i) for i in range(len(prompts) * n)]  # choice p * n + j
        texts = {} if params.stop else {rid: prompts[i // n] for i, rid in enumerate(samples)}
        return self._iterate(key, set(samples), stream, StreamText(self.engine.tokenizer, texts))

    async def _iterate(self, key: int, unfinished: set[str], stream: _Stream,
                       text: StreamText) -> AsyncIterator[RequestOutput]:
        try:
            async for out in read_stream(stream.queue, unfinished, text):
                yield out
        finally:
            self._streams.pop(key, None)
            for sample in unfinished:  # the caller went away: the child frees their KV blocks
                self._try_send(("abort", sample, key))

    def abort(self, request_id: str) -> None:
        self._try_send(("abort", request_id, None))

    def is_alive(self) -> bool:
        return self.error is None and self._proc.poll() is None and self._reader.is_alive()

    def is_healthy(self) -> bool:
        """False when the child died or has said nothing for the wedge timeout: it tells its
        state at least every STATE_EVERY_S while passes run and every BEAT_S while idle, so one
        pass (or a stopped process) that lasts longer is wedged."""
        silent = time.monotonic() - self._heard_at > self.wedge_timeout_s + BEAT_S
        return self.is_alive() and not silent

    def shutdown(self) -> None:
        self._try_send(("stop",))
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
        self._conn.close()

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=30)

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError as exc:  # a closed or broken socket: the child is gone
            raise EngineDeadError(f"lost the engine process: {exc!r}") from None

    def _try_send(self, message: tuple) -> None:
        try:
            self._send(message)
        except EngineDeadError:  # nothing left to stop
            pass

    # ---- the reader thread ---------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                self._heard_at = time.monotonic()
                if kind == "pass":
                    outputs, state, ops, iterations = payload
                    self._apply(state, ops, iterations)
                    self._deliver(outputs)
                elif kind == "answer":
                    key, answer = payload
                    stream = self._streams.get(key)
                    if stream is not None:
                        stream.put(answer)
                elif kind == "dead":
                    raise EngineDeadError(payload)
        except BaseException as exc:  # EOF: the child exited
            code = self._proc.poll()
            self.error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
                f"the engine process exited ({code})" if code is not None else f"lost the engine process: {exc!r}")
            if not isinstance(exc, (EOFError, OSError, EngineDeadError)):
                logger.exception("engine process reader failed")
            for stream in list(self._streams.values()):
                stream.put(self.error)
            self._streams.clear()

    @property
    def tbt_snapshot(self) -> tuple[int, tuple[float, ...]]:
        """As `AsyncEngine.tbt_snapshot`: the TBT samples taken ever, and the latest of them."""
        return self._tbt_total, tuple(self._tbt_tail)

    def _apply(self, state: EngineState | None, ops: list[list], iterations: list[float]) -> None:
        if state is not None:
            self.load_snapshot = state.load
            self._tbt_total = state.tbt[0]
            self._tbt_tail.extend(state.tbt[1])
            if state.sketch is not None:
                self.sketch_snapshot = state.sketch
            self.engine.update(state)
        if iterations:
            self.engine.iterations.extend(map(PassTime, iterations[::2], iterations[1::2]))
        if self._metrics is not None:
            try:
                self._metrics.add(ops, time.monotonic())
            except Exception:  # metrics must never stop the stream
                logger.exception("replaying the engine's metrics failed")

    def _deliver(self, outputs: list[tuple[int, RequestOutput | tuple]]) -> None:
        """A pass's deltas (a `Delta.fields` tuple, or the output the child built) to their callers."""
        streams = self._streams
        hand_out((stream, output_of(out) if isinstance(out, tuple) else out)
                 for key, out in outputs if (stream := streams.get(key)) is not None)


# ---- metrics across the process boundary ---------------------------------------------------


class _Forwarding:
    """A metrics backend that records what it is asked into `ops`, for `replay` elsewhere.

    Between two `take`s, what the replica's metrics would end up with is kept, not every call: a
    gauge's last value, a counter's sum, a histogram's values in one list (`_Forwarded`). A
    message that carries several passes (no delta was due in between) then replays a few records
    instead of a few per pass."""

    def __init__(self) -> None:
        self.ops: list[list] = []
        self.pending: dict[tuple, list] = {}  # (metric id, tags) -> its op in `ops`, until `take`
        self._count = 0

    def _new(self, kind: str, *args: Any) -> _Forwarded:
        self._count += 1
        self.ops.append(["new", self._count, kind, args])
        return _Forwarded(self._count, kind, self)

    def counter(self, name: str, doc: str, tags: Sequence[str]) -> _Forwarded:
        return self._new("counter", name, doc, tuple(tags))

    def gauge(self, name: str, doc: str, tags: Sequence[str]) -> _Forwarded:
        return self._new("gauge", name, doc, tuple(tags))

    def histogram(self, name: str, doc: str, buckets: Sequence[float], tags: Sequence[str]) -> _Forwarded:
        return self._new("histogram", name, doc, tuple(buckets), tuple(tags))

    def take(self) -> list[list]:
        ops, self.ops, self.pending = self.ops, [], {}
        return ops


class _Forwarded:
    __slots__ = ("_id", "_kind", "_to")

    def __init__(self, metric_id: int, kind: str, to: _Forwarding) -> None:
        self._id, self._kind, self._to = metric_id, kind, to

    def record(self, value: float, tags: dict[str, str]) -> None:
        if self._kind == "histogram":
            self.record_many((value,), tags)
            return
        key = (self._id, tuple(tags.items()))
        op = self._to.pending.get(key)
        if op is None:
            self._to.pending[key] = op = ["one", self._id, value, tags]
            self._to.ops.append(op)
        elif self._kind == "counter":
            op[2] += value
        else:  # a gauge: its last value
            op[2] = value

    def record_many(self, values: Sequence[float], tags: dict[str, str]) -> None:
        key = (self._id, tuple(tags.items()))
        op = self._to.pending.get(key)
        if op is None:
            self._to.pending[key] = op = ["many", self._id, list(values), tags]
            self._to.ops.append(op)
        else:
            op[2].extend(values)

    def flush(self) -> None:
        self._to.ops.append(["flush", self._id])


def replay(ops: list[list], backend: Any, metrics: dict[int, Any]) -> None:
    """Record `ops` (from `_Forwarding`) into `backend`; `metrics`: those made so far, by id."""
    for op in ops:
        if op[0] == "new":
            _, metric_id, kind, args = op
            metrics[metric_id] = getattr(backend, kind)(*args)
        elif op[0] == "one":
            metrics[op[1]].record(op[2], op[3])
        elif op[0] == "many":
            metrics[op[1]].record_many(op[2], op[3])
        else:
            metrics[op[1]].flush()


class HeldReplay:
    """The child's records held in the replica between two replays into `backend`, summed as
    the child sums them (`_Forwarding`: a gauge's last value, a counter's sum, a histogram's
    values): replayed at most every `backend.replay_every_s` (0 where it has none), by the first
    message after that (the child sends one at least every BEAT_S). Ray's metrics cost ~10 us a
    record and are exported once a period (10 s by default): a message's ten records replayed
    as they came were most of the replica's metrics work."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.every_s = float(getattr(backend, "replay_every_s", 0.0))
        self._held, self._held_metrics = _Forwarding(), {}
        self._metrics: dict[int, Any] = {}
        self._replayed_at = float("-inf")

    def add(self, ops: list[list], now: float) -> None:
        if ops:
            replay(ops, self._held, self._held_metrics)
        if self._held.ops and now - self._replayed_at >= self.every_s:
            self._replayed_at = now
            replay(self._held.take(), self.backend, self._metrics)


# ---- the child's side ----------------------------------------------------------------------


class _Remote:
    """A parent's stream, as the child's loop sees it: answers go out at once; `open`: its
    samples not finished yet (at 0 the core forgets its key)."""

    __slots__ = ("key", "core", "open")

    def __init__(self, key: int, core: _Core) -> None:
        self.key, self.core, self.open = key, core, 0

    def put(self, item: Any) -> None:
        if isinstance(item, BaseException):  # refused: nothing of it will stream
            self.core.remotes.pop(self.key, None)
        self.core.send(("answer", (self.key, item)))


class _Core(AsyncEngine):
    """The child's async engine: its streams are the parent's; a pass with deltas due is one message."""

    def __init__(self, engine: Any, conn: Connection, spec: ChildSpec, forwarding: _Forwarding | None) -> None:
        self.conn, self._send_lock, self.forwarding = conn, threading.Lock(), forwarding
        self.remotes: dict[int, _Remote] = {}  # the parent's streams by key (an abort names its own)
        self.started = False  # "ready" sent: the parent reads states from then on
        self._sent_iteration: float = -1.0
        self._sent_tbt = 0  # TBT samples taken so far that the parent has heard of
        self._sent_sketch: Any = None
        self._told_at = time.monotonic()
        super().__init__(engine, wedge_timeout_s=spec.wedge_timeout_s, stream_interval_s=spec.stream_interval_s)

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def state(self) -> tuple[EngineState, list[list], list[float]]:
        """The engine's state, the metric records since the last call and the passes since the
        last call as `PassTime` fields, flat (on the loop's thread: it alone appends to
        `iterations`)."""
        engine = self.engine
        sketch = self.sketch_snapshot
        fresh_sketch = sketch if sketch is not self._sent_sketch else None
        self._sent_sketch = sketch
        runner = engine.runner
        total = engine.num_tbt_samples
        fresh = min(total - self._sent_tbt, len(engine.recent_tbt))
        self._sent_tbt = total
        state = EngineState(
            load=self.load_snapshot, tbt=(total, list(itertools.islice(reversed(engine.recent_tbt), fresh))[::-1]),
            drain_rate=engine.drain_rate(),
            prefill_tps=engine.pass_time.prefill_tokens_per_s if engine.pass_time is not None else None,
            runner={"path": runner.path, "fallback_error": runner.fallback_error, "compiles": runner.compiles},
            sketch=fresh_sketch)
        fresh_passes = []
        for it in reversed(engine.iterations):
            if it.start <= self._sent_iteration or len(fresh_passes) == ITERATIONS_KEPT:
                break
            fresh_passes.append(it)
        iterations: list[float] = []  # PassTime's fields, flat, oldest first
        if fresh_passes:
            self._sent_iteration = fresh_passes[0].start
            for it in reversed(fresh_passes):
                iterations += (it.start, it.duration)
        self._told_at = time.monotonic()
        return state, self.forwarding.take() if self.forwarding is not None else [], iterations

    def _tell_idle(self) -> None:
        """While idle: the observers' gauges, and the state at least every BEAT_S."""
        super()._tell_idle()
        if self.started and time.monotonic() - self._told_at >= BEAT_S:
            self.send(("pass", ([], *self.state())))

    def _deliver_all(self, outputs: list[RequestOutput | Delta]) -> None:
        streams = self._streams
        sent = []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            sent.append((stream.key, out.fields() if isinstance(out, Delta) else out))
            if out.finished:
                del streams[out.request_id]
                stream.open -= 1
                if not stream.open:
                    self.remotes.pop(stream.key, None)
        if not sent and time.monotonic() - self._told_at < STATE_EVERY_S:
            return  # no delta due (merged into a later one): the state goes with the next message
        self.send(("pass", (sent, *self.state())))

    def _deliver(self, out: RequestOutput | Delta) -> None:
        self._deliver_all([out])

    def take(self, message: tuple) -> None:
        """A request's intake or an abort, from the parent (on the child's main thread)."""
        if message[0] == "add":
            _, key, prompts, params, request_id, priority, arrival = message
            remote = self.remotes[key] = _Remote(key, self)
            try:
                reqs = self._requests(prompts, params, request_id, priority, arrival)
            except Exception as exc:  # noqa: BLE001 - a bad request: its caller hears why
                remote.put(exc)
                return
            remote.open = len(reqs)
            self._submit(reqs, remote)
        else:
            _, request_id, key = message
            if key is None:  # `abort(request_id)`: whichever stream has it
                self._abort_own(request_id, None)
            elif key in self.remotes:  # a caller that left: its own request only (a key gone: finished)
                self._abort_own(request_id, self.remotes[key])


def child_main(fd: int) -> None:
    """The engine process: build the engine `ChildSpec` says, then serve the parent on `fd`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-process %(name)s: %(message)s")
    conn = Connection(fd)
    _, spec = pickle.loads(conn.recv_bytes())
    try:
        engine = spec.factory()
        forwarding = None
        if spec.metrics_model is not None:
            from replicas.serving.metrics import EngineMetrics
            forwarding = _Forwarding()
            engine.observers.append(EngineMetrics(forwarding, spec.metrics_model, spec.tbt_slo_s))
        if spec.pass_trace_dir is not None:
            from replicas.serving.pass_trace import PassTrace
            engine.observers.append(PassTrace(spec.pass_trace_dir))
        core = _Core(engine, conn, spec, forwarding)
    except BaseException as exc:
        logger.exception("the engine failed to start")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    info = {"config": engine.config, "max_model_len": engine.max_model_len,
            "max_batch_total_tokens": engine.max_batch_total_tokens, "vocab_size": engine.vocab_size,
            "block_size": engine.block_size, "tokenizer": engine.tokenizer, "pass_time": engine.pass_time is not None}
    state, ops, _ = core.state()  # the warm-up's passes are not the replica's
    freeze_startup_objects(logger, "the engine process", own_process=True)
    core.send(("ready", (info, state, ops)))
    core.started = True
    try:
        _serve(conn, core)
    finally:
        core.shutdown()
        engine.close()


def _serve(conn: Connection, core: _Core) -> None:
    """Take the parent's intake and aborts until it says stop or goes away; tell it if the loop
    dies meanwhile."""
    while True:
        if not core.is_alive():
            core.send(("dead", repr(core.error) if core.error else "the engine loop stopped"))
            return
        if not conn.poll(BEAT_S):
            continue
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if message[0] == "stop":
            return
        core.take(message)
