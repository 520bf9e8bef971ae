"""On a stand-in device (a worker thread that runs each pass and holds it, as a GPU would), the
overlapped loop launches pass N+1 before it processes pass N's outputs, gives the same tokens as
the synchronous loop, and times each pass on the device's timeline, not the host's."""

from __future__ import annotations

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.device_queue import StandInDevice
from replicas.loading.models import load_model

pytestmark = pytest.mark.engine

PROMPTS = [list(range(5 + 3 * i, 45 + 3 * i)) for i in range(4)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.8, seed=4, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=1, n=2, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0, frequency_penalty=0.4, ignore_eos=True)]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


@pytest.fixture
def stand_in():
    devices: list[StandInDevice] = []

    def make(llama, overlap: str, device_s: float = 0.002) -> Engine:
        eng = Engine(*llama, EngineConfig(max_batch_prefill_tokens=32, max_batch_total_tokens=1024, overlap=overlap))
        eng.runner.device_queue = device = StandInDevice(device_s)
        devices.append(device)
        return eng

    yield make
    for device in devices:
        device.close()


def test_pass_n_plus_1_is_launched_before_pass_n_is_processed(llama, stand_in) -> None:
    eng = stand_in(llama, "on")
    events: list[tuple[str, int]] = []
    launch, postprocess = eng.runner.launch, eng._postprocess
    ids: dict[int, int] = {}  # id(batch) -> pass number
    kept = []  # the batches, alive: their ids stay theirs

    def launching(batch):  # noqa: ANN001, ANN202
        ids[id(batch)] = len(ids)
        kept.append(batch)
        events.append(("launch", ids[id(batch)]))
        return launch(batch)

    def processing(batch, *args):  # noqa: ANN001, ANN002, ANN202
        events.append(("process", ids[id(batch)]))
        return postprocess(batch, *args)

    eng.runner.launch, eng._postprocess = launching, processing
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    passes = len(ids)
    assert passes > 10
    for n in range(passes - 1):  # every pass but the last: its successor was on the device first
        assert events.index(("launch", n + 1)) < events.index(("process", n)), events


def test_the_stand_in_device_gives_the_synchronous_tokens(llama, stand_in) -> None:
    sync = stand_in(llama, "off").generate(PROMPTS, PARAMS)
    over = stand_in(llama, "on").generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in sync] == [o.token_ids for o in over]
    for a, b in zip(sync, over):
        assert (a.logprobs is None) == (b.logprobs is None)
        for (x, _), (y, _) in zip(a.logprobs or [], b.logprobs or []):
            assert abs(x - y) <= 1e-6


def test_passes_are_timed_on_the_device_timeline(llama, stand_in) -> None:
    """Overlapped, the host returns from a step while the next pass runs: the pass-time model and
    the metrics get each pass's own time on the device (the stand-in's clock here; CUDA events
    on a GPU), which holds at least the set device time."""
    eng = stand_in(llama, "on", device_s=0.02)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    jobs, stats = eng.runner.device_queue.jobs, list(eng.iterations)
    assert len(jobs) == len(stats)
    for job, s in zip(jobs, stats):
        assert s.duration == pytest.approx(job.finished - job.started, abs=1e-9)
        assert s.duration >= 0.02
