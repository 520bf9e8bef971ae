"""The engine loop in a process of its own (`replica.engine_process`, `ProcessEngine`): the same
deltas, text and usage as the loop on a thread; refusals raised before any stream; a caller
that leaves frees its blocks in the child; the child's metrics, load, TBT samples and passes
reach the replica's process; a dead child fails its streams and the health check; a child
whose parent dies exits."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence

import prometheus_client
import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.protocol import InvalidRequestError
from replicas.serving.async_engine import AsyncEngine, EngineDeadError
from replicas.serving.engine_process import ChildSpec, ProcessEngine, _Forwarding, replay
from replicas.serving.metric_backends import PrometheusBackend
from replicas.serving.metrics import EngineMetrics

pytestmark = pytest.mark.engine

MODEL = "embedded:tiny"
CONFIG = EngineConfig(num_threads=1, max_batch_total_tokens=4096)
module_loop = pytest.mark.asyncio(loop_scope="module")


def spec(**kw: object) -> ChildSpec:
    return ChildSpec(functools.partial(Engine.from_pretrained, MODEL, CONFIG), wedge_timeout_s=60,
                     stream_interval_s=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def backend() -> PrometheusBackend:
    return PrometheusBackend(prometheus_client.CollectorRegistry())


@pytest.fixture(scope="module")
def proc(backend: PrometheusBackend) -> Iterator[ProcessEngine]:
    engine = ProcessEngine(spec(metrics_model="m", tbt_slo_s=0.5), backend)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine | ProcessEngine, prompts: list[list[int]], params: SamplingParams,
                  request_id: str) -> dict[str, tuple]:
    """Each sample's stream joined: text, tokens, logprobs, and how it ended (how its deltas were
    cut depends on when the caller read them: a slower reader gets them merged)."""
    joined: dict[str, tuple] = {}
    stream = await engine.add_request(prompts, params, request_id)
    async for o in stream:
        text, ids, lps, _ = joined.get(o.request_id, ("", (), [], None))
        lps = lps + [(lp.token_id, lp.token, round(lp.logprob, 5), [(i, t, round(v, 5)) for i, t, v in lp.top])
                     for lp in o.logprobs or []]
        end = (o.index, o.finished, o.finish_reason, o.stop_reason, o.num_prompt_tokens, o.num_output_tokens)
        joined[o.request_id] = (text + o.delta_text, ids + tuple(o.delta_token_ids), lps, end)
    return joined


CASES = [
    ([list(range(5, 40))], SamplingParams(max_tokens=24, temperature=0)),
    ([list(range(7, 30)), list(range(9, 20))], SamplingParams(max_tokens=9, temperature=0.9, seed=5, n=2)),
    ([list(range(5, 40))], SamplingParams(max_tokens=30, temperature=0, stop=["e"])),
    ([list(range(11, 31))], SamplingParams(max_tokens=8, temperature=0, logprobs=2, repetition_penalty=1.3)),
]


@module_loop
async def test_the_same_deltas_as_the_loop_on_a_thread(proc: ProcessEngine) -> None:
    local = Engine.from_pretrained(MODEL, CONFIG)
    thread = AsyncEngine(local)
    try:
        for k, (prompts, params) in enumerate(CASES):
            ours = await collect(proc, prompts, params, f"case-{k}")
            theirs = await collect(thread, prompts, params, f"case-{k}")
            assert ours == theirs
            assert len(ours) == len(prompts) * params.n
            for text, ids, _, (_, finished, *_, num_output) in ours.values():
                assert finished and text and len(ids) == num_output > 0
    finally:
        thread.shutdown()


@module_loop
async def test_a_refusal_is_raised_before_any_stream(proc: ProcessEngine) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        await proc.add_request([[5] * 10], SamplingParams(max_tokens=5000), "too-long")
    assert refused.value.param == "max_tokens" and "maximum context length is 2048" in refused.value.message
    running = await proc.add_request([[5] * 8], SamplingParams(max_tokens=1500, ignore_eos=True), "dup")
    await anext(running)
    with pytest.raises(InvalidRequestError, match="already in use"):
        await proc.add_request([[5] * 8], SamplingParams(max_tokens=2), "dup")
    await running.aclose()


@module_loop
async def test_a_caller_that_leaves_frees_its_blocks(proc: ProcessEngine, await_until: Callable) -> None:
    stream = await proc.add_request([[5] * 30], SamplingParams(max_tokens=1500, ignore_eos=True), "gone")
    for _ in range(4):
        await anext(stream)
    assert proc.load_snapshot.num_running == 1 and proc.load_snapshot.free_blocks < proc.load_snapshot.total_blocks
    await stream.aclose()
    await await_until(lambda: proc.load_snapshot.num_running == 0
                      and proc.load_snapshot.free_blocks == proc.load_snapshot.total_blocks,
                      what="the child freed the blocks of the stream its caller left")


@module_loop
async def test_metrics_load_and_passes_reach_the_replica(proc: ProcessEngine, backend: PrometheusBackend,
                                                        await_until: Callable) -> None:
    def tokens() -> float:
        return backend.registry.get_sample_value("stallfree_generation_tokens_total", {"model_name": "m"}) or 0.0

    before, samples, passes = tokens(), proc.tbt_snapshot[0], len(proc.engine.iterations)
    out = await collect(proc, [[5] * 12], SamplingParams(max_tokens=20, ignore_eos=True), "counted")
    assert len(out["counted"][1]) == 20
    await await_until(lambda: tokens() == before + 20, what="the child's token counter replayed here")
    assert proc.tbt_snapshot[0] >= samples + 19  # a gap per token after the first
    assert len(proc.engine.iterations) >= passes + 20  # the passes the load reporter reads
    assert proc.engine.runner.path == "sdpa" and proc.engine.max_model_len == 2048
    assert proc.is_healthy()


def test_replay_records_what_the_child_recorded() -> None:
    """The forwarding backend and `replay` give the registry what EngineMetrics would give it."""
    direct, relayed = (PrometheusBackend(prometheus_client.CollectorRegistry()) for _ in range(2))
    forwarding = _Forwarding()
    for b in (direct, forwarding):
        hist = b.histogram("h_seconds", "doc", [0.1, 1.0], ["model_name"])
        hist.record_many([0.05, 0.5, 2.0], {"model_name": "x"})
        b.counter("c_total", "doc", ["model_name"]).record(3, {"model_name": "x"})
        b.gauge("g", "doc", []).record(7, {})
    replay(forwarding.take(), relayed, {})
    assert forwarding.take() == []
    def samples(backend: PrometheusBackend) -> list[tuple]:
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for m in backend.registry.collect()
                      for s in m.samples if not s.name.endswith("_created"))

    assert samples(relayed) == samples(direct) and ("h_seconds_bucket", (("le", "1.0"), ("model_name", "x")), 2.0) \
        in samples(relayed)
    assert EngineMetrics(forwarding, "m") and forwarding.ops  # EngineMetrics makes its metrics through it


def test_records_between_two_takes_cross_as_what_they_add_up_to() -> None:
    """Between two takes (a message that carries several passes), a gauge crosses as its last
    value, a counter as its sum, a histogram's values as one list, per tags; and the registry
    ends with what it would get call by call."""
    direct, relayed = (PrometheusBackend(prometheus_client.CollectorRegistry()) for _ in range(2))
    forwarding = _Forwarding()
    for b in (direct, forwarding):
        gauge, counter = b.gauge("g", "doc", ["model_name"]), b.counter("c_total", "doc", ["model_name"])
        hist = b.histogram("h_seconds", "doc", [0.1, 1.0], ["model_name"])
        for value in (3, 5, 2):
            gauge.record(value, {"model_name": "x"})
            counter.record(value, {"model_name": "x"})
            hist.record(value / 10, {"model_name": "x"})
        counter.record(1, {"model_name": "y"})
        hist.record_many([0.05, 2.0], {"model_name": "x"})
    ops = forwarding.take()
    assert [op[0] for op in ops] == ["new"] * 3 + ["one", "one", "many", "one"]
    assert ops[3][2] == 2 and ops[4][2] == 10 and ops[5][2] == [0.3, 0.5, 0.2, 0.05, 2.0] and ops[6][2] == 1
    replay(ops, relayed, {})

    def samples(backend: PrometheusBackend) -> list[tuple]:
        return sorted((s.name, tuple(sorted(s.labels.items())), round(s.value, 9)) for m in backend.registry.collect()
                      for s in m.samples if not s.name.endswith("_created"))

    assert samples(relayed) == samples(direct)
    assert forwarding.take() == [] and forwarding.pending == {}  # records after a take start anew
    gauge.record(9, {"model_name": "x"})
    assert forwarding.take() == [["one", 1, 9, {"model_name": "x"}]]


def test_the_replica_holds_the_childs_records_until_its_backends_replay_period_passed() -> None:
    """Messages within `replay_every_s` of the last replay are summed here (a gauge's last
    value, a counter's sum, a histogram's values) and replayed by the first message after it:
    the registry then holds what it would have held message by message."""
    from replicas.serving.engine_process import HeldReplay

    class Periodic(PrometheusBackend):
        replay_every_s = 1.0

    held, direct = Periodic(prometheus_client.CollectorRegistry()), PrometheusBackend(prometheus_client.CollectorRegistry())
    replica, made, child = HeldReplay(held), {}, _Forwarding()
    gauge, counter = child.gauge("g", "doc", ["model_name"]), child.counter("c_total", "doc", ["model_name"])
    hist = child.histogram("h_seconds", "doc", [0.1, 1.0], ["model_name"])

    def value(backend: PrometheusBackend, name: str) -> float | None:
        return backend.registry.get_sample_value(name, {"model_name": "x"})

    for now, v in [(0.0, 3), (0.4, 5), (0.9, 2), (1.2, 4)]:  # one message each
        gauge.record(v, {"model_name": "x"})
        counter.record(v, {"model_name": "x"})
        hist.record(v / 10, {"model_name": "x"})
        ops = child.take()
        replay(ops, direct, made)
        replica.add(ops, now)
        if now == 0.0:  # the first message: replayed at once
            assert value(held, "g") == 3 and value(held, "c_total") == 3
        if now == 0.9:  # within a second of it: held
            assert value(held, "g") == 3 and value(held, "c_total") == 3 and value(held, "h_seconds_count") == 1
    assert [round(value(held, n), 9) for n in ("g", "c_total", "h_seconds_count", "h_seconds_sum")] == \
        [round(value(direct, n), 9) for n in ("g", "c_total", "h_seconds_count", "h_seconds_sum")] == [4, 14, 4, 1.4]
    replica.add([], 5.0)  # nothing held: nothing to replay
    assert value(held, "c_total") == 14


def test_a_flush_in_the_child_exports_the_replicas_counted_histogram() -> None:
    """A histogram counted in the replica (`GaugeHistogram`, as Ray's backend makes it) sets its
    gauges when the child's engine flushes it (going idle), not only when `flush_s` has passed."""
    from replicas.serving.metric_backends import GaugeHistogram

    values: dict[str, dict[tuple, float]] = {}

    class Gauge:
        def __init__(self, name: str, doc: str, tags: tuple[str, ...]) -> None:
            self.name = name

        def set(self, value: float, tags: dict[str, str]) -> None:
            values.setdefault(self.name, {})[tuple(sorted(tags.items()))] = value

    class CountingBackend:
        def histogram(self, name: str, doc: str, buckets: Sequence[float], tags: Sequence[str]) -> GaugeHistogram:
            return GaugeHistogram(Gauge, name, doc, buckets, tags, flush_s=1e9)

    forwarding, made = _Forwarding(), {}
    hist = forwarding.histogram("h_seconds", "doc", [0.1, 1.0], ["model_name"])
    hist.record_many([0.05, 0.5, 2.0], {"model_name": "x"})
    replay(forwarding.take(), CountingBackend(), made)
    assert values == {}  # counted, not yet exported
    hist.flush()
    replay(forwarding.take(), CountingBackend(), made)
    assert values["h_seconds_count"] == {(("model_name", "x"),): 3}
    assert values["h_seconds_bucket"][(("le", "1.0"), ("model_name", "x"))] == 2


@module_loop
async def test_a_dead_engine_process_fails_its_streams_and_health(await_until: Callable) -> None:
    engine = ProcessEngine(spec())
    try:
        stream = await engine.add_request([[5] * 8], SamplingParams(max_tokens=1500, ignore_eos=True), "doomed")
        await anext(stream)
        engine._proc.kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await await_until(lambda: not engine.is_healthy(), what="health fails")
        with pytest.raises(EngineDeadError):
            await engine.add_request([[5]], SamplingParams(), "after")
    finally:
        engine.shutdown()


def test_a_child_silent_past_the_wedge_timeout_fails_health(wait_until: Callable) -> None:
    """A pass that never lands, as a stopped process: health fails, then holds again once it
    goes on (the child says something at least every BEAT_S)."""
    engine = ProcessEngine(ChildSpec(functools.partial(Engine.from_pretrained, MODEL, CONFIG), wedge_timeout_s=0.3,
                                     stream_interval_s=0.0))
    try:
        wait_until(engine.is_healthy, what="healthy once started")
        os.kill(engine._proc.pid, signal.SIGSTOP)
        wait_until(lambda: not engine.is_healthy(), what="health fails while the child says nothing")
        # Wedged, not dead: the process runs, the reader waits, and no error is set.
        assert engine.is_alive() and engine.error is None and engine._proc.poll() is None
        assert time.monotonic() - engine._heard_at > engine.wedge_timeout_s
        os.kill(engine._proc.pid, signal.SIGCONT)
        wait_until(engine.is_healthy, what="healthy again")

        async def serve_one() -> list:
            stream = await engine.add_request([[5] * 6], SamplingParams(max_tokens=4, ignore_eos=True), "after")
            return [o async for o in stream]

        outs = asyncio.run(serve_one())  # and it serves again
        assert outs[-1].finished and outs[-1].num_output_tokens == 4
    finally:
        os.kill(engine._proc.pid, signal.SIGCONT)
        engine.shutdown()


def test_the_engine_process_exits_with_its_parent(tmp_path: object, wait_until: Callable) -> None:
    script = textwrap.dedent(f"""
        import functools, os
        from replicas import Engine, EngineConfig
        from replicas.serving.engine_process import ChildSpec, ProcessEngine
        engine = ProcessEngine(ChildSpec(functools.partial(Engine.from_pretrained, {MODEL!r},
                                         EngineConfig(num_threads=1)), 60, 0.0))
        print(engine._proc.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    child = int(parent.stdout.split()[0])

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{child}/stat") as f:  # a zombie awaiting its reaper has exited too
            return f.read().split(")")[-1].split()[0] == "Z"

    wait_until(gone, what="the orphaned engine process exited")


def test_starting_fails_with_the_childs_reason() -> None:
    bad = ChildSpec(functools.partial(Engine.from_pretrained, "embedded:no-such-model", CONFIG), 60, 0.0)
    with pytest.raises(RuntimeError, match="failed to start: .*no-such-model"):
        ProcessEngine(bad)


def test_shutdown_stops_the_child_cleanly_and_twice_is_harmless() -> None:
    engine = ProcessEngine(spec())  # built outside any event loop, as in a replica's constructor
    assert engine.is_healthy()
    engine.shutdown()
    engine.shutdown()
    assert engine._proc.returncode == 0 and not engine.is_alive()


def test_the_child_forgets_finished_streams_and_a_stale_abort_stops_nothing(wait_until: Callable) -> None:
    """The child's side in process: a stream's key is forgotten once its samples finish, and an
    abort from a caller whose stream finished does not stop a new request that took the same id."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from replicas.serving.engine_process import _Core

    ours, theirs = socket.socketpair()
    parent, child = Connection(ours.detach()), Connection(theirs.detach())
    heard: list[tuple] = []
    reader = threading.Thread(target=lambda: _read_all(parent, heard), daemon=True)
    reader.start()
    core = _Core(Engine.from_pretrained(MODEL, CONFIG), child, spec(), None)
    try:
        def finished(key: int) -> bool:
            return any(kind == "pass" and any(k == key and out[2] for k, out in body[0]) for kind, body in heard)

        def tokens(key: int) -> int:  # streamed so far (each delta a `Delta.fields` tuple)
            return sum(len(out[1]) for kind, body in list(heard) if kind == "pass" for k, out in body[0] if k == key)

        core.take(("add", 1, [[5] * 4], SamplingParams(max_tokens=3, n=2), "x", 0, time.perf_counter()))
        wait_until(lambda: finished(1) and not core.remotes, what="both samples done and key 1 forgotten")
        core.take(("add", 2, [[5] * 4], SamplingParams(max_tokens=1500, ignore_eos=True), "x", 0, time.perf_counter()))
        wait_until(lambda: tokens(2) >= 1, what="the second request, the same id, streaming")
        core.take(("abort", "x", 1))  # the first caller, long gone, names the same id
        before = tokens(2)
        wait_until(lambda: tokens(2) >= before + 3, what="passes after the stale abort was queued")
        assert not finished(2) and 2 in core.remotes  # the loop took the abort and stopped nothing
        core.take(("abort", "x", 2))
        wait_until(lambda: finished(2) and not core.remotes, what="its own caller's abort stops it")
    finally:
        core.shutdown()
        parent.close()
        child.close()


def _read_all(conn: object, heard: list) -> None:
    import pickle

    try:
        while True:
            heard.append(pickle.loads(conn.recv_bytes()))  # type: ignore[attr-defined]
    except (EOFError, OSError):
        return
