"""Tokens: text to rows exactly as the model's transformers tokenizer makes them, truncation."""

import pytest

import pooling_models
from neuron_serve.errors import ConfigError, InvalidInput
from neuron_serve.pooling.spec import PoolingSpec
from neuron_serve.pooling.tokens import Row, Tokens

TEXTS = ["Serve the model.", "", "gRPC over HTTP/1 behind HAProxy, one call per request", "ünïcode text"]
PAIRS = [("how to serve", "neuron-serve deploy serves a model.yaml"), ("a", "b c d e f g h")]


def spec(names=("input_ids", "attention_mask", "token_type_ids"), prompt="") -> PoolingSpec:
    return PoolingSpec(task="embed", input_names=names, output_name="embedding", max_model_len=64,
                       length_buckets=(64,), pad_token_id=0, vocab_size=1000, prompt=prompt)


@pytest.mark.parametrize("make", [pooling_models.wordpiece, pooling_models.byte_bpe])
def test_texts_and_pairs_are_tokenized_as_the_transformers_tokenizer_does(make):
    tokenizer = make()
    tokens = Tokens(tokenizer, spec())
    assert [r.ids for r in tokens.texts(TEXTS)] == tokenizer(TEXTS)["input_ids"]
    expected = tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS])
    rows = tokens.pairs(PAIRS)
    assert [r.ids for r in rows] == expected["input_ids"]
    if "token_type_ids" in expected:
        assert [r.type_ids for r in rows] == expected["token_type_ids"]


def test_truncation_cuts_as_the_tokenizer_does_keeping_special_tokens():
    tokenizer = pooling_models.wordpiece()
    tokens = Tokens(tokenizer, spec())
    long = " ".join(TEXTS * 5)
    assert [r.ids for r in tokens.texts([long], 12)] == tokenizer([long], truncation=True, max_length=12)["input_ids"]
    expected = tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], truncation=True, max_length=8)
    assert [r.ids for r in tokens.pairs(PAIRS, 8)] == expected["input_ids"]
    assert [r.ids for r in tokens.texts([long])][0] == tokenizer(long)["input_ids"]  # none without truncate


def test_the_default_prompt_goes_before_every_text_and_each_query():
    tokenizer = pooling_models.wordpiece()
    tokens = Tokens(tokenizer, spec(prompt="query: "))
    assert tokens.texts(["a b"])[0].ids == tokenizer("query: a b")["input_ids"]
    assert tokens.pairs([("a", "b")])[0].ids == tokenizer("query: a", "b")["input_ids"]


def test_token_ids_keep_their_last_tokens_when_truncated():
    tokens = Tokens(pooling_models.wordpiece(), spec())
    assert tokens.ids([[5, 6, 7, 8]], 2) == [Row([7, 8], [0, 0])]


def test_too_short_a_truncation_for_a_pair_is_refused_naming_the_field():
    tokens = Tokens(pooling_models.wordpiece(), spec())
    with pytest.raises(InvalidInput, match="truncate_prompt_tokens: 3 tokens cannot hold an input with its 3 special "
                                           "tokens; give at least 4"):
        tokens.pairs(PAIRS, 3)
    with pytest.raises(InvalidInput, match="truncate_prompt_tokens: 2 tokens cannot hold an input with its 2 special "
                                           "tokens; give at least 3"):
        tokens.texts(TEXTS, 2)


def test_a_tokenizer_without_its_rust_core_is_refused():
    with pytest.raises(ConfigError, match=r"tokenizer: object is not a fast \(Rust\) tokenizer; save the model's "
                                          r"tokenizer with its tokenizer.json"):
        Tokens(object(), spec())
