"""The pooling routes' codec: OpenAI's, Jina's, Cohere's and vLLM's bodies to the plane's request and back."""

import base64
import json

import numpy as np
import pytest
import torch

from neuron_serve.serve.protocols import openai_pooling
from neuron_serve.serve.protocols.openai import OpenAIError
from neuron_serve.serve.protocols.pooling import PoolingResult


def decode(api: str, body: dict):
    return openai_pooling.decode(openai_pooling.parse(api, json.dumps(body).encode()))


@pytest.mark.parametrize("given, texts, ids, single", [
    ("one text", ["one text"], None, True),
    (["a", "b"], ["a", "b"], None, False),
    ([5, 6, 7], None, [[5, 6, 7]], True),
    ([[5, 6], [7]], None, [[5, 6], [7]], False),
])
def test_openai_input_takes_a_string_a_list_token_ids_or_lists_of_them(given, texts, ids, single):
    request = decode("embeddings", {"model": "m", "input": given, "dimensions": 8, "truncate_prompt_tokens": -1})
    assert (request.kind, request.texts, request.token_ids, request.single) == ("embed", texts, ids, single)
    assert (request.dimensions, request.truncate, request.field) == (8, -1, "input")


def test_rerank_pairs_the_query_with_each_document_and_score_broadcasts_text_1():
    rerank = decode("rerank", {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert (rerank.kind, rerank.pairs, rerank.field, rerank.name(1)) == ("score", [("q", "a"), ("q", "b")],
                                                                         "documents", "documents[1]")
    assert decode("score", {"model": "m", "text_1": "q", "text_2": ["a", "b"]}).pairs == [("q", "a"), ("q", "b")]
    assert decode("score", {"model": "m", "text_1": ["q", "r"], "text_2": ["a", "b"]}).pairs == [("q", "a"),
                                                                                               ("r", "b")]
    assert decode("classify", {"model": "m", "input": "x"}).texts == ["x"]


@pytest.mark.parametrize("api, body, message, param", [
    ("embeddings", {"model": "m", "input": {"text": "a"}},
     "input: give a string, a list of strings, a list of token ids or a list of token-id lists, not an object",
     "input"),
    ("embeddings", {"model": "m", "input": []}, "input: the list is empty; give at least one text or token list",
     "input"),
    ("embeddings", {"model": "m", "input": ["a", None]},
     "input[1]: null where input[0] is a string; give strings, token ids or token-id lists, all of one kind", "input"),
    ("embeddings", {"model": "m", "input": [[1, 2], [3, "x"]]}, "input[1][1]: a token id is an integer, not a string",
     "input"),
    ("embeddings", {"model": "m", "input": ["a"] * 2049},
     "input: 2049 inputs, more than the 2048 a request may hold; send them in several requests", "input"),
    ("embeddings", {"model": "m", "input": "a", "encoding_format": "int8"},
     "encoding_format: Input should be 'float' or 'base64'", "encoding_format"),
    ("embeddings", {"model": "m", "input": "a", "dimensions": 0},
     "dimensions: Input should be greater than or equal to 1", "dimensions"),
    ("embeddings", {"input": "a"}, "model: Field required", "model"),
    ("embeddings", {"model": "m", "input": "a", "normalize": True},
     "unknown field 'normalize': this server does not support it", "normalize"),
    ("rerank", {"query": "q", "documents": [{"title": "t"}]},
     "documents[0]: give a string or an object with a string 'text'", "documents"),
    ("rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 8},
     "max_tokens_per_doc is not supported; truncate_prompt_tokens cuts each query and document pair to that many "
     "tokens", "max_tokens_per_doc"),
    ("rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n: Input should be greater than or equal to 0",
     "top_n"),
    ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
     "text_1 holds 2 texts and text_2 3: give one text_1 (scored against every text_2) or as many as text_2 "
     "(scored pairwise)", "text_1"),
    ("embeddings", {"model": "m", "input": "a", "truncate_prompt_tokens": -2},
     "truncate_prompt_tokens: Input should be greater than or equal to -1", "truncate_prompt_tokens"),
])
def test_a_malformed_body_is_refused_naming_the_field(api, body, message, param):
    with pytest.raises(OpenAIError) as refused:
        decode(api, body)
    assert (str(refused.value), refused.value.param, refused.value.http_status) == (message, param, 400)


def encode(api: str, body: dict, values: torch.Tensor, labels=()) -> dict:
    parsed = openai_pooling.parse(api, json.dumps(body).encode())
    return json.loads(openai_pooling.encode(parsed, PoolingResult(values, tokens=7), "m", labels))


def test_embeddings_encode_as_float_lists_or_little_endian_base64():
    values = torch.tensor([[0.5, -1.25], [3.0, 0.1]])
    floats = encode("embeddings", {"model": "m", "input": ["a", "b"]}, values)
    assert [d["embedding"] for d in floats["data"]] == values.tolist()
    assert (floats["object"], floats["usage"], floats["data"][1]["index"]) == ("list", {"prompt_tokens": 7,
                                                                                        "total_tokens": 7}, 1)
    packed = encode("embeddings", {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}, values)
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]]
    assert np.array_equal(np.stack(decoded), values.numpy())


def test_rerank_sorts_by_relevance_and_keeps_the_top_n_with_their_documents():
    body = {"query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    answer = encode("rerank", body, torch.tensor([0.2, 0.9, 0.5]))
    assert [(r["index"], r["document"]["text"]) for r in answer["results"]] == [(1, "b"), (2, "c")]
    assert answer["usage"] == {"total_tokens": 7}
    bare = encode("rerank", {**body, "top_n": 0, "return_documents": False}, torch.tensor([0.2, 0.9, 0.5]))
    assert [r for r in bare["results"]] == [{"index": 1, "relevance_score": pytest.approx(0.9)},
                                            {"index": 2, "relevance_score": pytest.approx(0.5)},
                                            {"index": 0, "relevance_score": pytest.approx(0.2)}]


def test_score_and_classify_answers_follow_vllm():
    scores = encode("score", {"text_1": "q", "text_2": ["a", "b"]}, torch.tensor([0.25, 0.75]))
    assert [(d["index"], d["object"], d["score"]) for d in scores["data"]] == [(0, "score", 0.25), (1, "score", 0.75)]
    classes = encode("classify", {"input": ["a"]}, torch.tensor([[0.25, 0.75]]), labels=("no", "yes"))
    assert classes["data"] == [{"index": 0, "label": "yes", "probs": [0.25, 0.75], "num_classes": 2}]
    assert classes["usage"]["prompt_tokens"] == 7
