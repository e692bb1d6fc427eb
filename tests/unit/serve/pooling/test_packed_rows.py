"""Several texts a compiled row, in process (no Ray, no HTTP): every text's embedding equals sentence-transformers'
``encode`` of it alone whichever row and place it is packed into, a cross-encoder's scores equal
``CrossEncoder.predict``, nothing leaks between the texts of a row, batches are counted in tokens, and what cannot
be packed is served one text a row with the reason said."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import REGISTRY
from sentence_transformers import CrossEncoder, SentenceTransformer

import pooling_models
from neuron_serve.config.schema import ModelConfig
from neuron_serve.errors import ConfigError
from neuron_serve.pooling import source
from neuron_serve.serve.protocols.pooling import PoolingRequest

EMBEDDING_TOLERANCE = 1e-5  # XLA:CPU packed against eager float32 alone, on unit vectors
# A score is the sigmoid of one logit, which XLA:CPU sums in another order than eager (as the served tests allow).
SCORE_TOLERANCE = 3e-4


def words(pooling_dirs) -> list[str]:
    """Words of the docs the test tokenizer was trained on, each one token long."""
    tokenizer = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").tokenizer
    corpus = " ".join(__import__("make_embedders").corpus()[:200]).split()
    return [w for w in dict.fromkeys(corpus) if w.isalpha() and len(tokenizer(w)["input_ids"]) == 3][:200]


def text_of(vocabulary: list[str], tokens: int, start: int = 0) -> str:
    """A text of ``tokens`` tokens with [CLS] and [SEP] (each word one token)."""
    return " ".join(vocabulary[(start + i) % len(vocabulary)] for i in range(tokens - 2))


def serve(pooled, name, source_dir, calls, **changes):
    return pooling_models.on_plane(pooled(name, source_dir, **changes), calls)


pool = pooling_models.answer


def buckets(plane) -> dict:
    """The model's length buckets' work so far (the counts are the process's, shared by planes of one model)."""
    return plane.metadata()["parameters"].get("padding", {}).get("length", {}).get("buckets", {})


async def counted(plane, request):
    """The answer to ``request`` and each length bucket's calls, real and padded tokens for it alone."""
    before = buckets(plane)
    answer = await pool(plane, request)
    await asyncio.sleep(0.1)  # the metrics are applied once the answer is out
    after = buckets(plane)
    return answer, {b: {k: after[b][k] - before.get(b, {}).get(k, 0) for k in after[b]} for b in after}


def test_texts_of_every_length_packed_together_equal_encode_each_alone(pooled, pooling_dirs):
    """One request of texts from 3 tokens to the model's 64 (a 64-token text fills a row alone, 40 + 24 fill one
    exactly, the short ones share rows): each equals encode of it alone; the rows padded less than one text a row
    would have."""
    vocabulary = words(pooling_dirs)
    lengths = [64, 40, 24, 3, 4, 7, 12, 17, 33, 9, 5, 3]
    texts = [text_of(vocabulary, n, start=7 * i) for i, n in enumerate(lengths)]
    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    assert [len(reference.tokenizer(t)["input_ids"]) for t in texts] == lengths

    async def calls(plane):
        return *(await counted(plane, PoolingRequest("embed", texts=texts))), plane.metadata()["parameters"]

    answer, work, parameters = serve(pooled, "embedder-one", "embedder", calls)
    assert parameters["packing"] == "on" and parameters["texts_per_row"] == 32
    expected = reference.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(answer.values, expected, atol=EMBEDDING_TOLERANCE, rtol=0)
    work = work["64"]
    assert work["real"] == sum(lengths) == answer.tokens
    # FFD into rows of 64: [64], [40, 24], [33, 17, 12], [9, 7, 5, 4, 3, 3]: 4 rows for 12 texts.
    assert work["padded"] == answer.padded == 4 * 64 - sum(lengths) < 12 * 64 - sum(lengths)


def test_mean_pooling_never_counts_another_texts_tokens(pooled, pooling_dirs):
    """Two texts in one row whose pooling over both would differ from either alone: each answer is its own."""
    vocabulary = words(pooling_dirs)
    first, second = text_of(vocabulary, 10), text_of(vocabulary, 12, start=50)
    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    alone = reference.encode([first, second], convert_to_tensor=True)
    mixed = reference.encode([first + " " + second], convert_to_tensor=True)[0]
    assert (alone - mixed).abs().max() > 0.05  # a leak of the other text's tokens would show

    async def calls(plane):
        return await pool(plane, PoolingRequest("embed", texts=[first, second]))

    answer = serve(pooled, "embedder-one", "embedder", calls)
    assert answer.padded == 64 - 22  # one row holds both
    torch.testing.assert_close(answer.values, alone, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_a_text_longer_than_a_row_runs_in_the_bucket_that_holds_it(pooled, pooling_dirs):
    """The embedder of two length buckets (16 and 64 tokens): short texts packed together, a 50-token text beside
    them in one request runs in a row of 64; every answer equals encode's."""
    vocabulary = words(pooling_dirs)
    lengths = [5, 7, 4, 9, 6, 3, 50]
    texts = [text_of(vocabulary, n, start=5 * i) for i, n in enumerate(lengths)]

    async def calls(plane):
        return await counted(plane, PoolingRequest("embed", texts=texts))

    answer, work = serve(pooled, "embedder", None, calls)
    expected = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(answer.values, expected, atol=EMBEDDING_TOLERANCE, rtol=0)
    assert work["64"]["calls"] >= 1 and sum(b["real"] for b in work.values()) == sum(lengths)
    assert sum(b["padded"] for b in work.values()) < 16 * 6 + 64 - sum(lengths)  # less than one text a row


def test_cross_encoder_pairs_packed_together_equal_predict(pooled, pooling_dirs):
    """Query and document pairs, a pair a segment (its token types as the tokenizer makes them): the scores equal
    CrossEncoder.predict's (sigmoid of the logit)."""
    vocabulary = words(pooling_dirs)
    pairs = [(text_of(vocabulary, 6, start=i), text_of(vocabulary, 4 + 5 * i, start=30 + i)) for i in range(6)]

    async def calls(plane):
        return await pool(plane, PoolingRequest("score", pairs=pairs))

    answer = serve(pooled, "reranker", None, calls)
    expected = torch.tensor(CrossEncoder(str(pooling_dirs["reranker"]), device="cpu").predict(pairs))
    torch.testing.assert_close(answer.values, expected, atol=SCORE_TOLERANCE, rtol=0)
    assert answer.padded < 64 * len(pairs) - answer.tokens  # fewer rows than pairs


def test_a_batch_holds_at_most_max_batch_tokens(pooled, pooling_dirs):
    """batching.max_batch_tokens 24: concurrent requests of 10-token texts join batches of two texts at most, and
    every answer is its own text's."""
    vocabulary = words(pooling_dirs)
    texts = [text_of(vocabulary, 10, start=11 * i) for i in range(6)]
    name = "embedder-tokens"

    async def calls(plane):
        return await asyncio.gather(*(pool(plane, PoolingRequest("embed", texts=[t])) for t in texts))

    answers = serve(pooled, name, "embedder", calls, batching={"max_batch_size": 4, "max_batch_tokens": 24,
                                                               "max_queue_delay_ms": 50})
    labels = {"model": name, "replica": "test"}
    batches = REGISTRY.get_sample_value("neuron_serve_batch_size_rows_count", labels)
    at_most_two = REGISTRY.get_sample_value("neuron_serve_batch_size_rows_bucket", {**labels, "le": "2.0"})
    assert batches >= 3 and at_most_two == batches
    expected = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(torch.cat([a.values for a in answers]), expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_packing_false_serves_one_text_a_row(pooled, pooling_dirs):
    texts = ["serve the model", "a", "dynamic batching"]

    async def calls(plane):
        return await pool(plane, PoolingRequest("embed", texts=texts)), plane.metadata()["parameters"]

    answer, parameters = serve(pooled, "embedder-padded", "embedder", calls, pooling={"length_buckets": [32],
                                                                                       "packing": False})
    assert (parameters["packing"], parameters["texts_per_row"]) == ("off (pooling.packing: false)", 1)
    assert answer.padded == 32 * len(texts) - answer.tokens
    expected = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(answer.values, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_a_model_with_local_attention_is_served_one_text_a_row_and_refused_packing_true(pooling_dirs):
    """ModernBERT's local attention layers would see across texts under a block mask given whole: packing is off
    with the reason, and packing: true names the field."""
    config = {"name": "modernbert", "task": "embed", "model": {"pretrained": str(pooling_dirs["modernbert"])},
              "pooling": {"length_buckets": [32]}}
    _, spec, _ = source.load(ModelConfig.model_validate(config))
    assert spec.segments == 1 and spec.describe()["packing"] == (
        "off: its attention is local (local_attention 16), which a block-diagonal mask given to it would replace")
    config["pooling"]["packing"] = True
    with pytest.raises(ConfigError, match=r"pooling.packing: .*modernbert cannot run several texts a row: its "
                                          r"attention is local \(local_attention 16\).*; set packing: false or "
                                          r"leave it out"):
        source.load(ModelConfig.model_validate(config))
