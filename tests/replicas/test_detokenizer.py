"""Incremental detokenization: the deltas join to exactly the full decode, multi-byte characters
are never split, stop strings cut the text; the Rust stream and the Python fallback agree."""

from __future__ import annotations

import gc
import random
from array import array

import pytest

from replicas.detokenizer import IncrementalDetokenizer, token_array
from replicas.loading.model_files import load_tokenizer

pytestmark = pytest.mark.engine

TEXT = "Hello wörld: 🙂 naïve 日本語 text, and $3.99 — done."


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return load_tokenizer("embedded:tiny")


def run(tok, ids: list[int], prompt: list[int], stream: bool, stop: tuple[str, ...] = ()):  # noqa: ANN001, ANN201
    d = IncrementalDetokenizer(tok, prompt, stop)
    assert (d._stream is not None) is True  # the embedded tokenizer is a plain fast tokenizer
    if not stream:
        d._stream = None
    deltas, hit = [], None
    for i in ids:
        hit = d.add_token(i)
        deltas.append(d.take_delta(False))
        if hit is not None:
            break
    if hit is None:
        d.flush()
    deltas.append(d.take_delta(True))
    return deltas, hit


@pytest.mark.parametrize("stream", [True, False])
def test_deltas_join_to_the_full_decode(tok, stream: bool) -> None:  # noqa: ANN001
    prompt = tok.encode("The answer:", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, _ = run(tok, ids, prompt, stream)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # no character was ever split
    rng = random.Random(0)  # arbitrary ids too: the same text as one decode of them all
    noise = [rng.randrange(len(tok)) for _ in range(400)]
    full = tok.decode(prompt + noise, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    start = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(run(tok, noise, prompt, stream)[0]) == full[len(start):]


@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_cuts_and_holds_back(tok, stream: bool) -> None:  # noqa: ANN001
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, hit = run(tok, ids, [], stream, stop=("naïve",))
    assert hit == "naïve" and "".join(deltas) == TEXT[:TEXT.index("naïve")]


@pytest.mark.parametrize("stream", [True, False])
def test_lone_bytes_are_not_held_to_the_finish(tok, stream: bool) -> None:  # noqa: ANN001
    """A run of tokens that never completes a character (a byte-level token holding one lone
    UTF-8 continuation byte, again and again: what a random model emitted for 90 tokens) goes out
    as it runs, not all at the finish; the deltas still join to the full decode."""
    prompt = tok.encode("The answer:", add_special_tokens=False)
    lone = tok.convert_tokens_to_ids("»")  # byte 0xBB alone: a continuation byte, never valid
    assert tok.decode([lone]) == "\ufffd"
    words = tok.encode(" louder", add_special_tokens=False)
    emoji = tok.encode(" 🙂", add_special_tokens=False)  # one character over several tokens
    ids = words + [lone] * 40 + emoji + [lone] * 3 + emoji + words
    deltas, _ = run(tok, ids, prompt, stream)
    full = tok.decode(prompt + ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    start = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == full[len(start):]
    assert full.count("🙂") == 2  # the emoji after the lone bytes is not split
    held_run = deltas[len(words):len(words) + 40]
    assert "".join(held_run[:10]).count("\ufffd") >= 1  # out within the first 10 lone tokens
    first = next(i for i, d in enumerate(held_run) if d)
    assert all(held_run[first:])  # then a delta at every token while the run lasts


@pytest.mark.parametrize("stream", [True, False])
def test_byte_soup_joins_to_the_full_decode(tok, stream: bool) -> None:  # noqa: ANN001
    """Random runs of single-byte tokens (lead bytes, continuation bytes, the pieces of real
    multi-byte characters) and words: whatever is released early, the deltas join to exactly
    the text of one decode of them all."""
    pieces = [tok.convert_tokens_to_ids(t) for t in ("»", "ð", "Ł", "Ļ", "Ĥ", "Ã", "¶", "æ", "Ĺ", "¥")]
    pieces += tok.encode(" naïve 日本 🙂 x", add_special_tokens=False)
    prompt = tok.encode("Q:", add_special_tokens=False)
    start = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.choice(pieces) for _ in range(rng.randrange(5, 120))]
        full = tok.decode(prompt + ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(run(tok, ids, prompt, stream)[0]) == full[len(start):]


def test_catching_up_gives_the_text_of_token_by_token(tok) -> None:  # noqa: ANN001
    """A request detokenized only when its delta goes out (`catch_up`, a few tokens at a time)
    has, delta after delta, the text of adding its tokens one by one: byte soup with held runs
    released included."""
    pieces, prompt = _soup(tok)
    rng = random.Random(2)
    for _ in range(30):
        ids = [rng.choice(pieces) for _ in range(rng.randrange(5, 120))]
        one, caught = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        text_one, text_caught, end = [], [], 0
        while end < len(ids):
            end = min(len(ids), end + rng.randrange(1, 12))
            for i in ids[len(one.ids) - len(prompt[-5:]):end]:
                one.add_token(i)
            caught.catch_up(ids[:end])
            text_one.append(one.take_delta(False))
            text_caught.append(caught.take_delta(False))
        assert text_caught == text_one and len(caught.ids) == len(one.ids)


def test_the_ids_kept_cost_the_collector_one_step(tok) -> None:  # noqa: ANN001
    """What a stream keeps for its lifetime is walked by every garbage collection meanwhile
    (replicas/serving/startup_gc.py): the ids a detokenizer keeps are an array, whose only
    reference the collector follows is its type (a list: one per id), from a prompt given as a
    list or an array, and stay one as tokens come (one by one, caught up, stepped together),
    with the same text as the full decode."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    for prompt in ([5, 6, 7, 8, 9, 10], token_array([5, 6, 7, 8, 9, 10])):
        d = IncrementalDetokenizer(tok, prompt)
        assert isinstance(d.ids, array) and gc.get_referents(d.ids) == [array] and d.ids.tolist() == [6, 7, 8, 9, 10]
        out = token_array()
        text = []
        for n in (1, 2, 9, len(ids)):  # a token alone, then deltas of several
            out.extend(ids[len(out):n])
            text.append(d.delta(out, finished=n == len(ids), flush=n == len(ids)))
        assert "".join(text) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert isinstance(d.ids, array) and gc.get_referents(d.ids) == [array] and len(d.ids) == 5 + len(ids)


@pytest.mark.parametrize("stop", [(), ("日本",)])
@pytest.mark.parametrize("source", ["soup", "text"])
def test_a_delta_gives_the_text_of_token_by_token(tok, stop: tuple[str, ...], source: str) -> None:  # noqa: ANN001
    """`delta`, one token a call (a delta every pass: the inline step) or several (a stream
    interval: one step of the Rust stream for them all where that gives the same), gives, delta
    after delta and at the finish, the text of adding the tokens one by one: byte soup with
    held runs released included, text whose characters span tokens (deltas that end inside one
    step token by token), a stop string's hold-back included."""
    pieces, prompt = _soup(tok)
    text = tok.encode(TEXT * 3, add_special_tokens=False)
    rng = random.Random(3)
    for trial in range(30):
        if source == "soup":
            ids = [rng.choice(pieces) for _ in range(rng.randrange(5, 120))]
        else:
            start = rng.randrange(len(text) // 3)
            ids = text[start:start + rng.randrange(5, 120)]
        one, batched = IncrementalDetokenizer(tok, prompt, stop), IncrementalDetokenizer(tok, prompt, stop)
        text_one, text_batched, end = [], [], 0
        while end < len(ids):
            end = min(len(ids), end + (1 if trial % 2 else rng.randrange(1, 12)))
            for i in ids[len(one.ids) - len(prompt[-5:]):end]:
                one.add_token(i, find_stop=False)
            text_one.append(one.take_delta(False))
            text_batched.append(batched.delta(ids[:end], False))
        one.flush()
        text_one.append(one.take_delta(True))
        text_batched.append(batched.delta(ids, True, flush=True))
        assert text_batched == text_one and len(batched.ids) == len(one.ids)
        full = tok.decode(prompt[-5:] + ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert full.endswith("".join(text_one))


def _soup(tok) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Tokens to draw outputs from (lone bytes that hold runs back, multi-byte characters) and a
    prompt."""
    pieces = [tok.convert_tokens_to_ids(t) for t in ("»", "ð", "Ł", "Ã", "¶", "æ")]
    pieces += tok.encode(" naïve 日本 🙂 x", add_special_tokens=False)
    return pieces, tok.encode("Q:", add_special_tokens=False)
