"""Grammar masks: every token a mask allows keeps the grammar alive and every token it blocks
would break it; rows without a grammar and the logits logprobs read stay untouched; a
constraint that does not compile is an InvalidRequestError naming its field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from replicas.execution import guided as guided_module
from replicas.execution.guided import CACHE_SIZE, POOL_MIN_ROWS, Grammars
from replicas.loading.models import load_model
from replicas.protocol import GuidedDecoding, InvalidRequestError, SamplingParams
from replicas.request import Request

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ("yes", "no", "not \"sure\"")
LARK = 'start: num ("+" num){0,2}\nnum: /[0-9]{1,2}/'


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("embedded:tiny")[1]


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def guided_request(grammars: Grammars, guided: GuidedDecoding, rid: str = "r", **params: object) -> Request:
    return Request(rid, [1], SamplingParams(guided=guided, **params), guide=grammars.matcher(guided))  # type: ignore[arg-type]


def allowed_ids(grammars: Grammars, req: Request) -> list[int]:
    logits = torch.zeros(1, grammars.vocab_size)
    return torch.nonzero(torch.isfinite(grammars.mask(logits, [req])[0])).flatten().tolist()


@pytest.mark.engine
@pytest.mark.parametrize("guided,check", [
    (GuidedDecoding("json_schema", json.dumps(PERSON)), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (GuidedDecoding("json_object"), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    (GuidedDecoding("regex", REGEX, "guided_regex"), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    (GuidedDecoding("choice", CHOICES, "guided_choice"), lambda t: t in CHOICES or pytest.fail(t)),
    (GuidedDecoding("grammar", LARK, "guided_grammar"),
     lambda t: re.fullmatch(r"\d{1,2}(\+\d{1,2}){0,2}", t) or pytest.fail(t)),
], ids=["json_schema", "json_object", "regex", "choice", "lark"])
def test_allowed_tokens_keep_the_grammar_alive_blocked_ones_break_it(tokenizer, grammars, guided, check) -> None:
    rng = random.Random(0)
    vocab = grammars.vocab_size
    eos = tokenizer.eos_token_id
    for walk in range(3):
        req = guided_request(grammars, guided)
        out: list[int] = []
        for _ in range(200):
            allowed = allowed_ids(grammars, req)
            assert allowed, "a live grammar always allows some token"
            blocked = sorted(set(range(vocab)) - set(allowed))
            for tok in rng.sample(allowed, min(40, len(allowed))):
                probe = req.guide.deep_copy()
                assert probe.consume_token(tok) and not probe.is_error(), tokenizer.decode([tok])
            for tok in rng.sample(blocked, min(40, len(blocked))):
                probe = req.guide.deep_copy()
                assert not probe.consume_token(tok), f"blocked token {tokenizer.decode([tok])!r} was accepted"
            # Walk on, by a random allowed token (EOS now and then once it is allowed); after 30
            # tokens json_object takes a quote when it may, or its strings would never end.
            text = [t for t in allowed if t != eos]
            quotes = [t for t in text if '"' in tokenizer.decode([t])]
            if eos in allowed and (not text or (walk == 0 and rng.random() < 0.1)):
                tok = eos
            elif guided.kind == "json_object" and len(out) > 30 and quotes:
                tok = quotes[0]
            else:
                tok = rng.choice(text)
            out.append(tok)
            if grammars.advance(req, tok):
                break
        else:
            pytest.fail(f"walk {walk} did not complete: {tokenizer.decode(out)!r}")
        check(tokenizer.decode([t for t in out if t != eos]))


@pytest.mark.engine
def test_mask_leaves_free_rows_and_the_logprobs_logits_untouched(grammars) -> None:
    guided = GuidedDecoding("choice", ("yes", "no"), "guided_choice")
    logits = torch.randn(3, grammars.vocab_size)
    raw = logits.clone()
    rows = [guided_request(grammars, guided, "a"), Request("b", [1], SamplingParams()),
            guided_request(grammars, guided, "c", logprobs=2)]
    masked = grammars.mask(logits, rows)
    assert torch.equal(logits, raw), "a row asks for logprobs: the raw logits must survive"
    assert torch.equal(masked[1], raw[1])
    allowed = allowed_ids(grammars, rows[0])
    assert 0 < len(allowed) < 10
    for r in (0, 2):
        finite = torch.nonzero(torch.isfinite(masked[r])).flatten().tolist()
        assert finite == allowed and torch.equal(masked[r, allowed], raw[r, allowed])
    in_place = grammars.mask(logits, rows[:2])  # no logprobs: the logits themselves are masked
    assert in_place is logits and torch.isinf(logits[0]).sum() == grammars.vocab_size - len(allowed)
    free = torch.randn(2, grammars.vocab_size)
    assert grammars.mask(free, [rows[1], rows[1]]) is free


@pytest.mark.engine
def test_the_thread_pool_and_the_loop_fill_the_same_masks(tokenizer, grammars, monkeypatch) -> None:
    guided = GuidedDecoding("json_schema", json.dumps(PERSON))
    text = tokenizer.encode('{"name":"ab","age":42,"tags":["a","bc"]}', add_special_tokens=False)
    rows = [guided_request(grammars, guided, f"r{i}") for i in range(POOL_MIN_ROWS + 2)]
    for i, req in enumerate(rows):  # each row in another state of the grammar
        assert req.guide.consume_tokens(text[:i])
    masks = []
    for threads in (1, 2):
        monkeypatch.setattr(guided_module, "POOL_THREADS", threads)
        masks.append(grammars.mask(torch.zeros(len(rows), grammars.vocab_size), rows))
    assert torch.equal(*masks) and len({tuple(torch.isfinite(m).tolist()) for m in masks[0]}) > 3


@pytest.mark.engine
def test_grammar_complete_finishes_and_eos_waits_for_acceptance(tokenizer, grammars) -> None:
    req = guided_request(grammars, GuidedDecoding("regex", "ab?", "guided_regex"))
    eos = tokenizer.eos_token_id
    assert eos not in allowed_ids(grammars, req)  # nothing matched yet: EOS is masked
    assert not grammars.advance(req, tokenizer.convert_tokens_to_ids("a"))
    assert eos in allowed_ids(grammars, req)  # "a" matches, "ab" would too
    assert grammars.advance(req, tokenizer.convert_tokens_to_ids("b"))  # nothing can follow "ab"


@pytest.mark.engine
def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(tokenizer, grammars) -> None:
    guided = GuidedDecoding("json_schema", json.dumps(PERSON))
    a, b = grammars.matcher(guided), grammars.matcher(guided)
    assert a is not b and guided in grammars._cache
    assert a.consume_tokens(tokenizer.encode('{"name":"', add_special_tokens=False))
    assert not b.is_error() and b.consume_tokens(tokenizer.encode('{"name":"x","age":3}', add_special_tokens=False))
    assert b.is_stopped() and not a.is_stopped()
    for i in range(CACHE_SIZE + 5):
        grammars.matcher(GuidedDecoding("regex", f"x{{{i}}}", "guided_regex"))
    assert len(grammars._cache) == CACHE_SIZE and guided not in grammars._cache


@pytest.mark.engine
@pytest.mark.parametrize("guided,message", [
    (GuidedDecoding("json_schema", '{"type": "strin"}', "guided_json"), "strin"),
    (GuidedDecoding("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (GuidedDecoding("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "minLength": 5, '
                    '"maxLength": 2}}, "required": ["a"]}', "tools"), "nsatisfiable"),
    (GuidedDecoding("regex", "a(b", "guided_regex"), "unclosed group"),
    (GuidedDecoding("grammar", 'root ::= "a" [0-9+', "guided_grammar"), "GBNF"),
    (GuidedDecoding("grammar", "start: nothere", "structured_outputs.grammar"), "nothere"),
])
def test_a_constraint_that_does_not_compile_names_its_field(grammars, guided, message) -> None:
    with pytest.raises(InvalidRequestError) as err:
        grammars.matcher(guided)
    assert err.value.param == guided.param and message in err.value.message


@pytest.mark.unit
@pytest.mark.parametrize("kind,spec,message", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", "", "non-empty string"),
    ("json_object", "{}", "takes no schema"),
    ("choice", (), "non-empty list"),
    ("choice", ("a", ""), "non-empty list"),
    ("regex", "x" * ((1 << 20) + 1), "characters"),
    ("xml", "<a/>", "kind must be one of"),
])
def test_the_constraint_shape_is_checked_where_it_is_built(kind, spec, message) -> None:
    with pytest.raises(InvalidRequestError) as err:
        GuidedDecoding(kind, spec, "guided_x")
    assert err.value.param == "guided_x" and message in err.value.message
