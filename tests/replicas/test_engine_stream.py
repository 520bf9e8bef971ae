"""With a stream interval (`Engine.stream_interval_s`, set by the async engine from the replica's
stream_interval_ms) a request's delta is built only when it is due, its first and last at once:
the tokens between are detokenized then, together, and the client gets the same text, tokens
and logprobs as pass by pass."""

from __future__ import annotations

import dataclasses
import functools
import gc
import types

import pytest

from replicas import Engine, EngineConfig, SamplingParams
from replicas import engine as engine_module
from replicas.loading.models import load_model
from replicas.outputs import Delta, StreamText
from replicas.protocol import RequestOutput

pytestmark = pytest.mark.engine

PROMPTS = [list(range(5 + 3 * i, 45 + 3 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def streams(llama, interval: float, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    eng = Engine(*llama, EngineConfig(max_batch_prefill_tokens=64, max_batch_total_tokens=2048))
    eng.stream_interval_s = interval
    ids = [eng.add_request(p, sp).request_id for p, sp in zip(PROMPTS, params)]
    out: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].append(o)
    return out


def test_deltas_held_to_the_interval_carry_the_same_text(llama) -> None:
    every = streams(llama, 0.0, [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 3)
    text = {rid: "".join(o.delta_text for o in outs) for rid, outs in every.items()}
    # stop strings taken from the text pass by pass: found as the tokens come, not when sent
    stop = text["req-1"][len(text["req-1"]) // 2:][:2]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)]
    every = streams(llama, 0.0, params)
    held = streams(llama, 1e9, params)  # never due but the first and the last
    for rid in every:
        assert [len(held[rid]), held[rid][0].num_output_tokens, held[rid][-1].finished] == [2, 1, True]
        assert "".join(o.delta_text for o in held[rid]) == "".join(o.delta_text for o in every[rid])
        assert [t for o in held[rid] for t in o.delta_token_ids] == [t for o in every[rid] for t in o.delta_token_ids]
        assert held[rid][-1].finish_reason == every[rid][-1].finish_reason
    assert every["req-1"][-1].finish_reason == "stop" and every["req-1"][-1].num_output_tokens < 20
    lps = [lp.logprob for o in held["req-2"] for lp in o.logprobs]
    assert lps == [lp.logprob for o in every["req-2"] for lp in o.logprobs] and len(lps) == 20


def test_text_decoded_by_the_caller_is_the_engines_text(llama) -> None:
    """With `deltas_by_caller` (the async engine's setting) the loop builds no output and decodes
    no text for a request without stop strings or logprobs: its deltas are `Delta`s, and
    `StreamText` on the caller's side, fed them as they come or merged, gives exactly the outputs
    the engine's own building and decoding gives (every field). A request with logprobs gets its
    output built on the loop, its text left to the caller. Random weights break characters (lone
    bytes, held runs): the hard cases of incremental decoding."""
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["zz"]),
              SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=1)]
    reference = streams(llama, 0.0, params)
    eng = Engine(*llama, EngineConfig(max_batch_prefill_tokens=64, max_batch_total_tokens=2048))
    eng.outputs.deltas_by_caller = True
    reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    assert set(eng.outputs.detoks) == {reqs[2].request_id}  # only the stop strings' request
    got: dict[str, list[RequestOutput | Delta]] = {r.request_id: [] for r in reqs}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].append(o)
    assert all(isinstance(o, Delta) for rid in ("req-0", "req-1") for o in got[rid])
    assert all(isinstance(o.delta_text, str) for o in got["req-2"])
    assert all(isinstance(o, RequestOutput) and o.delta_text is None for o in got["req-3"])
    held_any = False
    for merge in (1, 7):  # each delta on its own; seven at a time (a slow caller, an interval)
        text = StreamText.of(llama[1], reqs)
        for rid, outs in got.items():
            outs = [o if isinstance(o, Delta) else dataclasses.replace(o) for o in outs]
            merged = [functools.reduce(type(outs[0]).followed_by, outs[i:i + merge])
                      for i in range(0, len(outs), merge)]
            filled = []
            for o in merged:
                filled.append(text.fill(o))
                held = [ids for _, ids in text._detoks.values()]  # a stream's output ids so far:
                assert all(len(gc.get_referents(ids)) == 1 for ids in held)  # one step for a collection, not one an id
                held_any = held_any or bool(held)
            if merge == 1:
                assert filled == reference[rid]
            assert "".join(o.delta_text for o in filled) == "".join(o.delta_text for o in reference[rid])
            assert [t for o in filled for t in o.delta_token_ids] == [
                t for o in reference[rid] for t in o.delta_token_ids]
        assert not text._detoks and not text._prompts  # each finished stream let its decoder go
    assert held_any


def test_the_engine_sends_at_the_pass_nearest_the_interval(llama, monkeypatch) -> None:
    """The engine's own loop, on a clock that moves 45 ms a pass: with a 50 ms interval, every
    pass's token goes out (held until due, every other pass's would); at 10 ms a pass, every
    fifth pass's."""
    for pass_ms, expected_every in ((45, 1), (10, 5)):
        clock = [100.0]
        monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
            perf_counter=lambda: clock[0], process_time=lambda: 0.0, monotonic=lambda: clock[0]))
        eng = Engine(*llama, EngineConfig(max_batch_total_tokens=512))
        eng.stream_interval_s = 0.050
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=41, temperature=0, ignore_eos=True))
        sent_at_pass = []
        for i in range(41):
            clock[0] += pass_ms * 1e-3
            if eng.step():
                sent_at_pass.append(i)
        assert not eng.has_unfinished()
        assert sent_at_pass[0] == 0 and sent_at_pass[-1] == 40  # the first and the last at once
        middle = sent_at_pass[1:-1]
        assert middle and all(b - a == expected_every for a, b in zip(sent_at_pass, middle))
