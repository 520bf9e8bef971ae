"""The per-pass trace: one JSON line per forward pass, what the engine measured and decided."""

from __future__ import annotations

import json

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas.loading.models import load_model
from replicas.serving.pass_trace import PassTrace

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def test_every_pass_is_one_line_with_its_times_and_the_slo_budgets_decision(llama, tmp_path):
    config = EngineConfig(policy="stall_free", max_batch_prefill_tokens=32, max_batch_total_tokens=512,
                          block_size=4, max_num_seqs=4, tbt_slo_ms=1000.0)
    engine = Engine(*llama, config)
    trace = PassTrace(tmp_path / "trace")
    engine.observers.append(trace)
    before = len(engine.iterations)
    engine.generate([[7] * 60, [9] * 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    trace.on_idle(engine)
    lines = [json.loads(line) for line in trace.path.read_text().splitlines()]
    passes = list(engine.iterations)[before:]
    assert len(lines) == len(passes) > 2
    for line, stats in zip(lines, passes):
        assert line["duration_s"] == stats.duration > 0
        assert line["prefill_tokens"] == stats.num_prefill_tokens
        assert line["decode_tokens"] == stats.num_decode_tokens
        assert line["cpu_s"] is not None and line["cpu_s"] >= 0
        assert line["predicted_s"] == stats.predicted_s and line["predicted_s"] > 0  # the SLO's model
        assert line["prefill_budget"] == stats.prefill_budget
    assert sum(line["prefill_tokens"] for line in lines) == 65  # both prompts, chunked
    assert any(line["pass_target_s"] == pytest.approx(0.8) for line in lines)  # SLO x margin, decoding
    starts = [line["time"] for line in lines]
    assert starts == sorted(starts) and starts[0] > 1.6e9  # wall clock, in order
    trace.close()


class _FullDisk:
    closed = False

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")

    def close(self):
        self.closed = True


def test_a_trace_that_cannot_write_stops_itself_and_the_engine_goes_on(llama, tmp_path, caplog):
    engine = Engine(*llama, EngineConfig(policy="stall_free", max_batch_prefill_tokens=32,
                                         max_batch_total_tokens=512, block_size=4, max_num_seqs=4))
    trace = PassTrace(tmp_path)
    trace._file.close()
    trace._file = _FullDisk()
    engine.observers.append(trace)
    out = engine.generate([[7] * 20], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5  # every pass ran
    assert trace._file.closed and "pass trace" in caplog.text and "No space left" in caplog.text
    trace.on_idle(engine)  # a closed trace ignores the rest
