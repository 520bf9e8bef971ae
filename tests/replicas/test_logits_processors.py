"""Logits processing equals its formula: logit_bias added, EOS/stop ids -inf before min_tokens,
repetition over prompt + output, frequency x count + presence x seen over the output, for every
row that asks and no other, counted incrementally; in the engine, greedy output equals HF
`generate` with the same processors, and min_tokens holds EOS back."""

from __future__ import annotations

import math

import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.execution.logits_processors import LogitsProcessors
from replicas.loading.models import load_model
from replicas.protocol import InvalidRequestError
from replicas.request import Request, RequestStatus
from replicas.execution.sampler import sample_logits as sample

V = 8
EOS = frozenset({0, 2})


def req(prompt: list[int], output: list[int], **params: object) -> Request:
    r = Request("r", prompt, SamplingParams(max_tokens=20, **params))  # type: ignore[arg-type]
    r.output_token_ids = list(output)
    return r


def expected(row: list[float], r: Request) -> list[float]:
    """The processors' definition, written out element by element (vLLM's order)."""
    p, out = r.params, r.output_token_ids
    x = list(row)
    for t, b in p.logit_bias:
        x[t] += b
    if len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else EOS):
            x[t] = -math.inf
    seen = set(r.prompt_token_ids) | set(out)
    for t in range(V):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        count = out.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


@pytest.mark.unit
def test_each_row_equals_the_hand_computed_transform() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 3
    raw = logits.clone()
    rows = [
        req([1, 3], [4, 4, 5], temperature=0),  # nothing asked: untouched
        req([1, 3], [4, 4, 5], frequency_penalty=0.5, presence_penalty=-1.25),
        req([1, 3, 6], [4, 7], repetition_penalty=1.7, temperature=0),
        req([5], [3, 3, 3, 1], repetition_penalty=0.8, frequency_penalty=2.0, presence_penalty=1.0,
            logit_bias={1: 5.0, 7: -100.0}),
        req([1], [3], min_tokens=3, stop_token_ids=[6], logit_bias={0: 50.0}),
        req([1], [3], min_tokens=3, ignore_eos=True, stop_token_ids=[6]),  # EOS not masked
    ]
    out = LogitsProcessors(V, EOS)(logits, rows)
    assert torch.equal(logits, raw)  # the raw logits (logprobs read them) are not changed
    assert out.dtype == torch.float32
    for i, r in enumerate(rows):
        assert out[i].tolist() == pytest.approx(expected(raw[i].tolist(), r), abs=1e-5), i
    assert out[4, 0] == out[4, 2] == out[4, 6] == -math.inf and out[5, 6] == -math.inf
    assert out[5, 0] == raw[5, 0] and out[5, 2] == raw[5, 2]


@pytest.mark.unit
def test_nothing_asked_returns_the_same_tensor_and_keeps_no_state() -> None:
    logits = torch.randn(3, V)
    procs = LogitsProcessors(V, EOS)
    assert procs(logits, [req([1], [2]), req([1], [], temperature=0), req([1], [2])]) is logits
    # min_tokens reached: nothing left to mask, the logits pass through untouched too.
    assert procs(logits, [req([1], [2, 3], min_tokens=2)]) is logits
    assert procs.counts is None


@pytest.mark.unit
def test_counts_follow_appended_tokens_and_rows_are_reused() -> None:
    procs = LogitsProcessors(V, EOS)
    logits = torch.zeros(2, V)
    a = req([1], [], frequency_penalty=1.0)
    b = req([2], [], presence_penalty=0.5, repetition_penalty=2.0)
    for tokens in ([3, 4], [3, 5], [3, 3]):  # one token appended per pass, as the engine does
        out = procs(logits + 1.0, [a, b])
        assert out[0].tolist() == pytest.approx(expected([1.0] * V, a))
        assert out[1].tolist() == pytest.approx(expected([1.0] * V, b))
        a.output_token_ids.append(tokens[0])
        b.output_token_ids.append(tokens[1])
    assert procs.counts[[procs._states[a].row, procs._states[b].row]].sum(1).tolist() == [2, 2]
    a.status = RequestStatus.FINISHED_LENGTH
    row_a = procs._states[a].row
    c = req([6], [7, 7], frequency_penalty=1.0)  # takes a's row back, counted from zero
    out = procs(logits, [b, c])
    assert procs.num_tracked == 2 and procs._states[c].row == row_a
    assert out[1].tolist() == pytest.approx(expected([0.0] * V, c))


@pytest.mark.unit
def test_greedy_rows_are_argmax_of_the_processed_logits() -> None:
    logits = torch.tensor([[0.0, 4.0, 3.9, 1.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    rows = [req([1], [1], temperature=0),  # raw argmax: token 1
            req([1], [1], temperature=0, presence_penalty=0.5),  # 4.0 - 0.5 < 3.9
            req([5], [], temperature=0, logit_bias={3: 3.5})]  # 1.0 + 3.5 wins
    procs = LogitsProcessors(V, EOS)
    assert sample(procs(logits, rows), rows) == [1, 2, 3]


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded:tiny")


def engine(llama) -> Engine:
    return Engine(*llama, EngineConfig(max_batch_prefill_tokens=24, max_batch_total_tokens=512,
                                       block_size=4, max_num_seqs=6))


PROMPTS = [[5, 9, 9, 14, 5, 30, 31, 32], list(range(40, 80)), [7] * 13]


def hf(model, prompt: list[int], n: int, **kwargs) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.engine
def test_greedy_with_repetition_penalty_and_logit_bias_equals_hf_generate(llama) -> None:
    """HF's RepetitionPenalty (prompt + output) and SequenceBias (single tokens), in that order,
    are ours; the batch mixes penalized, biased and plain requests."""
    model = llama[0]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    rep = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    bias = {60: 4.0, 9: -3.0, 100: 2.5}
    both = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=0.7,
                          logit_bias=bias)
    eng = engine(llama)
    params = [p for p in (plain, rep, both) for _ in PROMPTS]
    outs = eng.generate(PROMPTS * 3, params)
    seq_bias = {(t,): b for t, b in bias.items()}
    for i, p in enumerate(PROMPTS):
        ref_plain = hf(model, p, 12, min_new_tokens=12)
        assert outs[i].token_ids == ref_plain
        ref_rep = hf(model, p, 12, min_new_tokens=12, repetition_penalty=1.8)
        assert outs[3 + i].token_ids == ref_rep and ref_rep != ref_plain
        ref_both = hf(model, p, 12, min_new_tokens=12, repetition_penalty=0.7, sequence_bias=seq_bias)
        assert outs[6 + i].token_ids == ref_both and ref_both not in (ref_plain, ref_rep)
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.engine
def test_greedy_with_frequency_and_presence_penalties_equals_a_hand_written_decode(llama) -> None:
    """Each step of the reference is HF's forward over prompt + output so far, the penalties
    applied by their formula, argmax."""
    model = llama[0]
    cases = [(1.5, 0.75), (-0.5, -2.0)]  # (frequency, presence): against and towards repeats
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, frequency_penalty=f,
                             presence_penalty=pr) for f, pr in cases for _ in PROMPTS]
    outs = engine(llama).generate(PROMPTS * len(cases), params)
    changed = 0
    for j, (o, sp) in enumerate(zip(outs, params)):
        p = PROMPTS[j % len(PROMPTS)]
        seq: list[int] = []
        for _ in range(10):
            with torch.inference_mode():
                x = model(torch.tensor([p + seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(seq, dtype=torch.long), minlength=x.shape[0]).float()
            penalty = sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
            seq.append(int((x - penalty).argmax()))
        assert o.token_ids == seq
        changed += o.token_ids != hf(model, p, 10, min_new_tokens=10)
    assert changed >= len(PROMPTS)  # the penalties changed the greedy choice (not a no-op)


@pytest.mark.engine
def test_min_tokens_holds_eos_back(llama) -> None:
    """EOS biased to win every step: without min_tokens the first token is EOS; with it, exactly
    min_tokens other tokens come first (HF's min_new_tokens, both EOS ids masked), then EOS."""
    model, eos = llama[0], llama[1].eos_token_id
    eng = engine(llama)
    bias = {eos: 100.0}
    first = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, logit_bias=bias))[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop"
    held = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, logit_bias=bias,
                                                     min_tokens=4))[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and held.finish_reason == "stop"
    assert not set(held.token_ids[:4]) & eng.eos_token_ids
    assert held.token_ids == hf(model, PROMPTS[0], 10, min_new_tokens=4, sequence_bias={(eos,): 100.0})
    # A stop token id is held back the same way.
    stop = held.token_ids[1]
    by_id = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop],
                                                      logit_bias={stop: 100.0}, min_tokens=3))[0]
    assert len(by_id.token_ids) == 4 and by_id.token_ids[-1] == stop and stop not in by_id.token_ids[:3]
    assert by_id.finish_reason == "stop"


@pytest.mark.engine
def test_stop_strings_are_not_looked_for_before_min_tokens(llama) -> None:
    eng = engine(llama)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = eng.generate([PROMPTS[1]], plain)[0]
    tok = llama[1]
    head = tok.decode(full.token_ids[:2], skip_special_tokens=True)
    stop = head[-3:]  # completed by the first two tokens, nowhere after them
    assert len(stop) == 3 and full.text.find(stop, len(head) - 3 + 1) == -1
    cut = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                    stop=[stop]))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= 2
    held = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                     stop=[stop], min_tokens=2))[0]
    assert held.finish_reason == "length" and held.token_ids == full.token_ids and held.text == full.text


@pytest.mark.engine
def test_logit_bias_ids_are_checked_against_the_vocabulary(llama) -> None:
    eng = engine(llama)
    with pytest.raises(InvalidRequestError, match=r"\[0, 2048\)") as e:
        eng.add_request([5, 6], SamplingParams(logit_bias={2048: 1.0}))
    assert e.value.param == "logit_bias" and not eng.requests


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_out_of_range_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field
