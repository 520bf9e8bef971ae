"""The replica class without Ray: it streams an acknowledgement then deltas, refuses bad or
overflowing requests as values (no traceback storms), frees KV blocks when its caller goes
away, keeps serving after one request fails, and fails health checks when its loop is dead
or wedged. (Covers replicas/serving/deployment.py; it lives here beside the app that drives it.)"""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
from collections.abc import Callable, Iterator

import pytest

from replicas import Engine, EngineConfig, RequestOutput, SamplingParams
from replicas.config import ReplicaConfig, ReplicaOptions
from replicas.serving.deployment import LLMServer, build_engine
from replicas.execution.kv_memory import activation_bytes, kv_memory_bytes, weight_bytes
from replicas.loading.models import load_model, model_max_length
from replicas.protocol import (Acknowledged, InvalidRequestError, QueueFullError, QueueTimeoutError, ReplicaLoad,
                               ReplicaUnhealthyError, RequestRejected)

pytestmark = pytest.mark.engine

MODEL = "embedded:tiny"
CAP = 64

# One event loop for the module, like a replica's: an aborted stream's last delivery may land
# after its test returns, and AsyncEngine's loop thread dies if that loop is already closed.
module_loop = pytest.mark.asyncio(loop_scope="module")


def make_server(engine_config: EngineConfig, **replica: object) -> LLMServer:
    config = ReplicaConfig(model=MODEL, engine=engine_config, options=ReplicaOptions(**replica))  # type: ignore[arg-type]
    return LLMServer(config, engine_factory=functools.partial(Engine.from_pretrained, MODEL, engine_config))


@pytest.fixture(scope="module", params=[False, True], ids=["loop-thread", "engine-process"])
def server(request: pytest.FixtureRequest) -> Iterator[LLMServer]:
    """One sequence slot, so a second request must wait in the queue; the engine's loop on a
    thread of the replica's process, then in a process of its own (`replica.engine_process`)."""
    srv = make_server(EngineConfig(max_num_seqs=1, max_batch_total_tokens=1024), max_queued_tokens=CAP,
                      engine_process=request.param)
    yield srv
    srv.shutdown()


async def drain(server: LLMServer, ids: list[int], params: dict, request_id: str) -> list:
    return [item async for item in server.generate(ids, SamplingParams(**params), 0, request_id)]


def idle_load(server: LLMServer) -> ReplicaLoad | None:
    """The load report once nothing runs or waits and every KV block is free, else None."""
    load = server.load()
    idle = load.num_running == load.num_waiting == 0 and load.free_blocks == load.total_blocks
    return load if idle else None


@module_loop
async def test_ack_then_deltas_with_exact_counts(server: LLMServer) -> None:
    items = await drain(server, [5] * 10, {"max_tokens": 7, "ignore_eos": True}, "counts")
    ack, *deltas = items
    assert isinstance(ack, Acknowledged) and ack.request_id == "counts"
    assert all(isinstance(d, RequestOutput) for d in deltas) and deltas[0].num_prompt_tokens == 10
    assert deltas[0].left_queue_at is not None and deltas[-1].left_queue_at is None  # the first says when
    assert sum(len(d.delta_token_ids) for d in deltas) == 7
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 7
    assert server.queued_tokens == 0


@module_loop
@pytest.mark.parametrize("ids,params,param,fragment", [
    ([], {}, "prompt", "must not be empty"),
    ([5] * 10, {"max_tokens": 3000}, "max_tokens", "maximum context length is 2048"),
    ([5] * 10, {"max_tokens": 1500}, "max_tokens", "max_batch_total_tokens = 1024"),
    ([5] * 10, {"max_tokens": 2, "priority": 5000}, "priority", "priority must be an integer"),
])
async def test_refusals_are_yielded_as_the_only_item(server: LLMServer, ids: list[int], params: dict,
                                                     param: str | None, fragment: str) -> None:
    params = dict(params)  # the case's own dict is shared by both servers
    priority = params.pop("priority", 0)
    items = [item async for item in server.generate(ids, SamplingParams(**params), priority, "bad")]
    assert len(items) == 1 and isinstance(items[0], InvalidRequestError)
    assert items[0].param == param and fragment in items[0].message
    assert isinstance(items[0], InvalidRequestError)


@module_loop
async def test_queue_cap_refuses_with_retry_after(server: LLMServer, await_until: Callable) -> None:
    running = server.generate([5] * 8, SamplingParams(max_tokens=1000, ignore_eos=True), 0, "long")
    await anext(running)
    await anext(running)  # a token: it holds the only slot
    waiting = server.generate([5] * 40, SamplingParams(max_tokens=1), 0, "waits")
    assert isinstance(await anext(waiting), Acknowledged)  # queued
    assert server.queued_tokens == 40 and server.load().waiting_tokens == 40
    [refused] = await drain(server, [5] * 40, {"max_tokens": 1}, "refused")
    assert isinstance(refused, QueueFullError) and refused.retry_after_s is not None
    assert 1 <= refused.retry_after_s <= 60
    copy = pickle.loads(pickle.dumps(refused))  # it crosses Ray intact
    assert (copy.message, copy.retry_after_s) == (refused.message, refused.retry_after_s)
    await waiting.aclose()
    await running.aclose()
    await await_until(lambda: idle_load(server), what="both requests gone")
    assert server.queued_tokens == 0


@module_loop
async def test_a_request_the_queue_would_start_past_its_deadline_is_refused_at_once(await_until: Callable) -> None:
    """The engine refuses by its own drain rate: at 1 prompt token/s, a prompt behind 40
    waiting tokens would start 40 s after arrival, past the 30 s deadline, so it is refused now
    (a 429 with Retry-After that says why), not in 30 s; the one in front keeps waiting."""
    srv = make_server(EngineConfig(max_num_seqs=1, max_batch_total_tokens=1024, queue_timeout_s=30.0),
                      max_queued_tokens=4096)
    try:
        running = srv.generate([5] * 8, SamplingParams(max_tokens=1000, ignore_eos=True), 0, "long")
        await anext(running)
        await anext(running)  # a token: it holds the only slot
        front = srv.generate([5] * 40, SamplingParams(max_tokens=1), 0, "front")
        assert isinstance(await anext(front), Acknowledged)
        behind = srv.generate([5] * 40, SamplingParams(max_tokens=1), 0, "behind")
        assert isinstance(await anext(behind), Acknowledged)  # admitted at the rate measured
        srv.engine.engine.drain_rate = lambda: 1.0  # then the queue drains at 1 token/s
        assert srv.drain_tps() == 1.0  # the replica reads the engine's measure
        refused = await anext(behind)
        assert isinstance(refused, QueueTimeoutError)
        assert "it would not be scheduled within queue_timeout_s (30.0 s)" in refused.message
        assert 1 <= refused.retry_after_s <= 60
        assert srv.load().num_waiting == 1  # the front one stays
        await front.aclose()
        await running.aclose()
        await await_until(lambda: idle_load(srv), what="both requests gone")
    finally:
        srv.shutdown()


@module_loop
async def test_closing_the_stream_aborts_and_frees_blocks(server: LLMServer, await_until: Callable) -> None:
    stream = server.generate([5] * 30, SamplingParams(max_tokens=900, ignore_eos=True), 0, "gone")
    for _ in range(4):
        await anext(stream)
    assert server.load().free_blocks < server.load().total_blocks
    await stream.aclose()  # what Serve does when the caller cancels
    await await_until(lambda: idle_load(server), what="the aborted request's blocks freed")


@module_loop
async def test_a_stream_lets_its_prompt_go_once_the_engine_has_it(server: LLMServer) -> None:
    """A stream's frame lives as long as the stream, and what it holds is walked by every garbage
    collection meanwhile (replicas/serving/startup_gc.py): once the engine has accepted the
    prompt, `generate` holds no reference to its ids, and the stream still ends whole."""
    stream = server.generate([5] * 30, SamplingParams(max_tokens=12, ignore_eos=True), 0, "let-go")
    assert "prompt_token_ids" in stream.ag_frame.f_locals  # before it starts, its frame holds the prompt
    items = [await anext(stream), await anext(stream)]  # the acknowledgement, the first delta
    assert isinstance(items[0], Acknowledged) and isinstance(items[1], RequestOutput)
    held = stream.ag_frame.f_locals
    assert "prompt_token_ids" not in held and "batch" not in held
    items += [item async for item in stream]
    assert sum(len(d.delta_token_ids) for d in items[1:]) == 12 and items[-1].num_prompt_tokens == 30


@module_loop
async def test_one_failing_request_leaves_the_others_running(server: LLMServer,
                                                             await_until: Callable) -> None:
    first = asyncio.ensure_future(drain(server, [5] * 8, {"max_tokens": 300, "ignore_eos": True}, "dup"))
    # Accepted; it then streams its 300 tokens (a short run would free the id before the retry).
    await await_until(lambda: server.engine.load_snapshot.num_running, interval_s=0.001, what="first request running")
    [duplicate] = await drain(server, [5] * 8, {"max_tokens": 2}, "dup")
    assert isinstance(duplicate, InvalidRequestError) and "already in use" in duplicate.message
    [invalid] = await drain(server, [5] * 8, {"max_tokens": 5000}, "other")
    assert isinstance(invalid, InvalidRequestError) and invalid.param == "max_tokens"
    items = await first
    assert items[-1].finished and items[-1].num_output_tokens == 300
    assert server.check_health()["path"] == "sdpa"


def test_reports(server: LLMServer) -> None:
    info = server.model_info()
    assert info["max_model_len"] == 2048 and info["max_batch_total_tokens"] == 1024
    assert info["policy"] == "stall_free" and info["vocab_size"] == 2048
    assert info["max_queued_tokens"] == CAP
    load = server.load()  # the one load record, as the controller receives it
    assert isinstance(load, ReplicaLoad) and load.total_blocks == 1024 // 16
    assert load.queue_bound_tokens == CAP  # no backlog measured: the bound is the cap


@module_loop
async def test_health_fails_when_wedged_or_dead(await_until: Callable) -> None:
    srv = make_server(EngineConfig(), wedge_timeout_s=0.2)
    srv.check_health()
    step = srv.engine.engine.step
    release = threading.Event()

    def stuck_step() -> list:
        release.wait()  # one iteration that lasts until the test lets it go: wedged for sure
        return step()

    def unhealthy() -> bool:
        try:
            srv.check_health()
        except RuntimeError as exc:
            assert "unhealthy" in str(exc)
            return True
        return False

    srv.engine.engine.step = stuck_step  # type: ignore[method-assign]
    stream = srv.generate([5] * 4, SamplingParams(max_tokens=2), 0, "slow")
    await anext(stream)
    await await_until(unhealthy, what="wedged step fails health")
    [refused] = [item async for item in srv.generate([5], SamplingParams(), 0, "while-wedged")]
    assert isinstance(refused, ReplicaUnhealthyError)
    release.set()
    await stream.aclose()
    srv.shutdown()
    with pytest.raises(RuntimeError, match="unhealthy"):
        srv.check_health()


def test_kv_cache_sized_from_a_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fraction is of the device's total memory, weights and activations taken out first;
    a replica given half a GPU sizes from half of it."""
    block_bytes = 512 * 16  # tiny: 512 KV bytes per token, 16 tokens a block
    config = EngineConfig(kv_cache_memory_fraction=0.5, max_num_seqs=4096)  # no cap by sequence slots
    model, _ = load_model(MODEL)
    used = weight_bytes(model) + activation_bytes(model.config, config, model_max_length(model.config), 4)
    total = 4 * (used + 100 * block_bytes)  # a quarter of it leaves 100 blocks
    monkeypatch.setattr("replicas.engine.device_memory_bytes", lambda device: total)
    engine = build_engine(ReplicaConfig(model=MODEL, engine=config))
    assert engine.blocks.num_blocks == (total // 2 - used) // block_bytes
    monkeypatch.setattr("replicas.serving.deployment._gpu_share", lambda: 0.5)  # two replicas on one device
    half = build_engine(ReplicaConfig(model=MODEL, engine=config))
    assert half.blocks.num_blocks == 100
    with pytest.raises(ValueError, match="leaves no KV cache"):
        kv_memory_bytes(1000, 0.5, weights=400, activations=200)

    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)