"""Structured outputs in the engine: constrained rows beside an unconstrained one in one decode call.

A tiny Llama with random weights writes whatever its logits say; held to a grammar by
xgrammar's token masks, its answers must still parse and validate, and the unconstrained
row must stay transformers' own greedy answer.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import generation_models as gm
from neuron_serve.errors import InvalidInput
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.frontend.structured import Constraint

# Every field bounded, so that even a random model's answer ends within max_tokens.
SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["tag", "n", "ok"]}
PROMPT = [5, 6, 7, 40]


@pytest.fixture(scope="module")
def structured():
    lm, tokenizer = gm.build("llama"), gm.byte_tokenizer()
    engine = engine_for(lm, max_num_seqs=4, max_model_len=128, prefill_buckets=[16, 128], decode_batch_buckets=[4],
                        decode_context_buckets=[128], tokenizer=tokenizer)
    yield lm, tokenizer, engine
    engine.close()


def test_constrained_answers_parse_and_validate_beside_an_unconstrained_one(structured):
    lm, tokenizer, engine = structured
    params = [SamplingParams(max_tokens=100, temperature=0, structured=Constraint("json_schema", SCHEMA)),
              SamplingParams(max_tokens=100, temperature=0.8, seed=1, structured=Constraint("regex", r"[a-c]{3}-\d{2}")),
              SamplingParams(max_tokens=10, temperature=0, structured=Constraint("choice", ("yes", "no", "maybe"))),
              SamplingParams(max_tokens=10, temperature=0)]
    schema, regex, choice, free = engine.generate_batch([PROMPT] * 4, params, timeout=120)
    jsonschema.validate(json.loads(tokenizer.decode(schema.tokens)), SCHEMA)
    assert re.fullmatch(r"[a-c]{3}-\d{2}", tokenizer.decode(regex.tokens))
    assert tokenizer.decode(choice.tokens) in ("yes", "no", "maybe")
    assert (schema.finish_reason, regex.finish_reason, choice.finish_reason) == ("stop", "stop", "stop")
    assert free.tokens == gm.eager_greedy(lm, PROMPT, 10)


def test_json_object_and_a_grammar(structured):
    _, tokenizer, engine = structured
    params = [SamplingParams(max_tokens=120, temperature=0.7, seed=3, structured=Constraint("json_object")),
              SamplingParams(max_tokens=20, temperature=0, structured=Constraint("grammar", 'root ::= "x" [0-9] [0-9]'))]
    obj, grammar = engine.generate_batch([PROMPT] * 2, params, timeout=120)
    if obj.finish_reason == "stop":  # a random model may not close its object within max_tokens: "length"
        assert isinstance(json.loads(tokenizer.decode(obj.tokens)), dict)
    else:
        assert obj.finish_reason == "length" and len(obj.tokens) == 120
    assert re.fullmatch(r"x\d\d", tokenizer.decode(grammar.tokens))


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(structured):
    _, _, engine = structured
    [done] = engine.generate_batch([PROMPT], SamplingParams(max_tokens=3, temperature=0,
                                                            structured=Constraint("regex", r"[a-z]{10}")), timeout=60)
    assert done.finish_reason == "length" and len(done.tokens) == 3


def test_a_schema_the_library_refuses_names_its_field(structured):
    _, _, engine = structured
    bad = Constraint("json_schema", {"type": "object", "properties": {"a": {"type": "nosuchtype"}}},
                     "response_format.json_schema.schema")
    with pytest.raises(InvalidInput, match=r"^response_format\.json_schema\.schema: the json schema cannot be "
                                           r"compiled: "):
        engine.submit(PROMPT, SamplingParams(max_tokens=4, structured=bad), lambda event: None)
    with pytest.raises(InvalidInput, match=r"^guided_regex: the regex cannot be compiled: "):
        engine.submit(PROMPT, SamplingParams(max_tokens=4, structured=Constraint("regex", "(", "guided_regex")),
                      lambda event: None)
