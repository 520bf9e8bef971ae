"""With the embedded random model, every output generated under a JSON schema parses and
validates, greedy or sampled, batched beside free requests, through chunked prefill and
preemption; regex, choice and grammar outputs match; logprobs stay the model's own.

The schemas bound their strings, numbers and arrays (maxLength, enum, integer ranges,
multipleOf, maxItems, additionalProperties false): a random model almost never closes a free
string (one token of 2048 holds a quote), while every path through these grammars ends within
`BOUND` tokens, so `MAX_TOKENS` lets every output complete, whatever tokens the model picks.
"""

from __future__ import annotations

import dataclasses

import json
import re
from decimal import Decimal

import jsonschema
import pytest
import torch

from replicas import Engine, EngineConfig, SamplingParams
from replicas.loading.models import load_model
from replicas.protocol import GuidedDecoding

pytestmark = pytest.mark.engine

BOUND = 200  # longest path (tokens) through any schema below: about 6 per string character
MAX_TOKENS = 320
SCHEMAS = {
    "flat_required": {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "nickname": {"type": "string", "maxLength": 4}}},
    "nested_objects": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["id", "role"],
                     "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                    "role": {"enum": ["admin", "user", "guest"]},
                                    "address": {"type": "object", "additionalProperties": False,
                                                "required": ["zip"],
                                                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
            "active": {"type": "boolean"}}},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                  "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
    "enums_and_consts": {
        "type": "object", "additionalProperties": False, "required": ["kind", "level", "version"],
        "properties": {"kind": {"enum": ["circle", "square", 3, None, True]},
                       "level": {"type": "string", "enum": ["low", "mid", "high"]},
                       "version": {"const": "v1"}}},
    "numbers": {
        "type": "object", "additionalProperties": False, "required": ["price", "ratio", "count"],
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
                       "ratio": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
                       "count": {"type": "integer", "minimum": -50, "maximum": 50}}},
    "anyof_and_refs": {
        "$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "type": "object", "additionalProperties": False, "required": ["shape"],
        "properties": {"shape": {"anyOf": [{"$ref": "#/$defs/point"},
                                           {"type": "array", "items": {"$ref": "#/$defs/point"},
                                            "maxItems": 2}]},
                       "label": {"type": ["string", "null"], "maxLength": 3}}},
}
PROMPTS = ["Hello, world!", "The quick brown fox", "A serving system takes requests", "Once upon a time"]


@pytest.fixture(scope="module")
def model_tok():
    return load_model("embedded:tiny")


def validate(text: str, schema: dict) -> None:
    """jsonschema's check of `text`, numbers read as decimals: in binary floating point 71.13 is
    not a multiple of 0.01 (71.13 / 0.01 = 7112.999...), in the JSON text it is."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    jsonschema.validate(json.loads(text, parse_float=Decimal), exact)

def engine(model_tok, **overrides) -> Engine:
    cfg = dict(policy="stall_free", max_batch_prefill_tokens=64, max_batch_total_tokens=16384,
               block_size=16, max_num_seqs=32)
    return Engine(*model_tok, EngineConfig(**(cfg | overrides)))


def params_grid(guided: GuidedDecoding) -> list[SamplingParams]:
    """Greedy, and seeded sampling at several temperatures with top-k / top-p."""
    grid = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guided=guided)]
    grid += [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, seed=s, top_p=p, top_k=k, guided=guided)
             for s, (t, p, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 1.0, 50), (1.0, 0.8, 20)])]
    return grid


def test_every_output_under_a_json_schema_parses_and_validates(model_tok) -> None:
    eng = engine(model_tok)
    prompts, params, schemas = [], [], []
    for i, schema in enumerate(SCHEMAS.values()):
        for j, p in enumerate(params_grid(GuidedDecoding("json_schema", json.dumps(schema)))):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(p)
            schemas.append(schema)
    # Free requests share the batches: their rows must not be masked.
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts + PROMPTS, params + [free] * len(PROMPTS))
    for out, schema, p in zip(outs, schemas, params):
        assert out.finish_reason == "stop", f"{out.text!r} did not complete in {MAX_TOKENS} tokens"
        assert len(out.token_ids) <= BOUND
        validate(out.text, schema)
    reference = Engine(*model_tok, EngineConfig(max_batch_total_tokens=4096)).generate(PROMPTS, free)
    assert [o.token_ids for o in outs[len(prompts):]] == [r.token_ids for r in reference]


def test_outputs_still_validate_through_chunked_prefill_and_preemption(model_tok) -> None:
    """A KV cache too small for the batch preempts requests mid-output; their grammar state must
    survive the recompute (the tokens so far are kept, so the matcher is too)."""
    eng = engine(model_tok, max_batch_prefill_tokens=16, max_batch_total_tokens=320, block_size=4)
    schema = SCHEMAS["nested_objects"]
    guided = GuidedDecoding("json_schema", json.dumps(schema))
    # 40 tokens: three chunks of prefill each; distinct, so the prefix cache shares no KV.
    prompts = [[7 + (i + j) % 50 for j in range(40)] for i in range(6)]
    ps = [SamplingParams(max_tokens=BOUND, temperature=1.0, seed=i, guided=guided) for i in range(6)]
    outs = eng.generate(prompts, ps)
    assert sum(o.num_preemptions for o in outs) > 0, "the test needs a preemption to mean anything"
    for out in outs:
        assert out.finish_reason == "stop"
        validate(out.text, schema)


def test_json_object_outputs_parse(model_tok) -> None:
    """Any JSON object. Its keys and strings are free, and the random model would not end them:
    a model that does is emulated by raising the logits of the quote and of the closing brace."""
    eng = engine(model_tok)
    tok = model_tok[1]
    closers = torch.tensor([tok.convert_tokens_to_ids(t) for t in ('"', "}")])
    forward = eng.runner.forward

    def closing_model(prep, *args):
        out = forward(prep, *args)
        sampled = out.sampled.clone()  # an inference tensor: edited as a copy
        sampled[:, closers] += 4.0
        return dataclasses.replace(out, sampled=sampled)

    eng.runner.forward = closing_model
    ps = params_grid(GuidedDecoding("json_object")) * 2
    outs = eng.generate([PROMPTS[i % 4] for i in range(len(ps))], ps)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)
    assert any(len(json.loads(o.text)) > 0 for o in outs), "every object was empty: nothing was tested"


@pytest.mark.parametrize("guided,matches", [
    (GuidedDecoding("regex", r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)", "guided_regex"),
     lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)", t)),
    (GuidedDecoding("choice", ("positive", "negative", "neutral"), "guided_choice"),
     lambda t: t in ("positive", "negative", "neutral")),
    (GuidedDecoding("grammar", 'root ::= "(" [0-9]{1,2} ("+" [0-9]{1,2}){0,3} ")"', "guided_grammar"),
     lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2}){0,3}\)", t)),
], ids=["regex", "choice", "gbnf"])
def test_regex_choice_and_grammar_outputs_match(model_tok, guided, matches) -> None:
    ps = params_grid(guided)
    outs = engine(model_tok).generate([PROMPTS[i % 4] for i in range(len(ps))], ps)
    for out in outs:
        assert out.finish_reason == "stop" and matches(out.text), out.text


def test_logprobs_are_the_models_own_not_the_masked_distribution(model_tok) -> None:
    """The schema forces '{' first: under the mask it has probability 1, under the random model
    about 1/2048."""
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMAS["flat_required"]))
    [out] = engine(model_tok).generate(["Hello"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                 logprobs=3, guided=guided))
    first_lp, top = out.logprobs[0]
    assert out.text.startswith("{") and first_lp < -3.0
    assert top[0][1] >= first_lp and top[0][0] != out.token_ids[0]


def test_every_sample_of_n_is_constrained(model_tok) -> None:
    """n forked samples each get their own grammar state: all of them parse and validate, and
    they differ (each is sampled on its own)."""
    eng = engine(model_tok)
    schema = SCHEMAS["nested_objects"]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=4,
                        guided=GuidedDecoding("json_schema", json.dumps(schema)))
    outs = eng.generate([PROMPTS[1]], sp)
    assert len(outs) == 4
    for out in outs:
        assert out.finish_reason == "stop", out.text
        validate(out.text, schema)
    assert len({o.text for o in outs}) > 1
