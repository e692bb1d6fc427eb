"""The pooling plane over compiled models, in process (no Ray, no HTTP): each pooling and architecture equal to
sentence-transformers' ``encode``, Matryoshka dimensions, truncation, and the plane's refusals. Cross-encoders and
classifiers are checked against ``CrossEncoder.predict`` where they are served (tests/integration)."""

import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

import pooling_models
from neuron_serve.errors import InvalidInput
from neuron_serve.serve.protocols.pooling import PoolingRequest

EMBEDDING_TOLERANCE = 1e-5  # XLA:CPU against eager float32, on unit vectors and raw CLS states alike
# Mixed lengths: the embedder's two length buckets (16 and 64 tokens) both run in one request.
TEXTS = ["a", "serve the model", "gRPC over HTTP/1 behind HAProxy", "Ready means every port answers for every model "
         "and deploy prints its ready line only then", "dynamic batching"]
SHORT = TEXTS[:3] + ["the compile cache", "one core per replica"]  # within the 32 tokens of the other models
QUERY = "how does a replica batch requests"
DOCUMENTS = ["a dynamic batcher forms batches of requests", "the partition report", "batching", "gRPC ports",
             "requests wait in a queue for company"]


def run(pooled, name, calls, source=None, **changes):
    """Start a pooling plane on model ``name`` (built once a session), run ``calls(plane)``, stop it."""
    return pooling_models.on_plane(pooled(name, source, **changes), calls)


pool = pooling_models.answer


def embed(pooled, name, texts, source=None, **fields):
    async def calls(plane):
        return (await pool(plane, PoolingRequest("embed", texts=list(texts), **fields))).values
    return run(pooled, name, calls, source)


def test_mean_pooled_normalised_embeddings_equal_encode(pooled, pooling_dirs):
    served = embed(pooled, "embedder-one", TEXTS, source="embedder")
    expected = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)
    torch.testing.assert_close(served.norm(dim=-1), torch.ones(len(TEXTS)))


def test_a_bfloat16_embedder_equals_encode_in_bfloat16_and_answers_float32(pooled, pooling_dirs):
    """dtype: bfloat16 computes the encoder and its pooling in bfloat16 (the spec says so); the embeddings leave in
    float32, within 0.01 of sentence-transformers' bfloat16 encode (XLA:CPU keeps the steps between products in
    float32 where eager PyTorch rounds each: its unit vectors differ in the third decimal)."""
    config, _, spec, _ = pooled("embedder-one", "embedder", dtype="bfloat16")
    assert spec.dtype == "bfloat16" and spec.describe()["dtype"] == "bfloat16"
    async def calls(plane):
        return (await pool(plane, PoolingRequest("embed", texts=list(TEXTS)))).values

    served = run(pooled, "embedder-one", calls, "embedder", dtype="bfloat16")
    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").to(torch.bfloat16)
    expected = reference.encode(TEXTS, convert_to_tensor=True).float()
    assert served.dtype == torch.float32
    torch.testing.assert_close(served, expected, atol=0.01, rtol=0)


def test_pooling_type_and_normalize_of_model_yaml_override_the_directory(pooled, pooling_dirs):
    """The mean-pooled, normalised embedder served with pooling_type CLS and normalize false equals the same
    weights saved that way: CLS pooling, not normalised."""
    served = embed(pooled, "embedder-cls", SHORT, source="embedder")
    reference = SentenceTransformer(str(pooling_dirs["embedder-cls"]), device="cpu")
    expected = reference.encode(SHORT, convert_to_tensor=True)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)
    assert not torch.allclose(served.norm(dim=-1), torch.ones(len(SHORT)))


@pytest.mark.parametrize("name", ["qwen3", "modernbert"])
def test_decoder_last_token_and_modernbert_embeddings_equal_encode(pooled, pooling_dirs, name):
    """Qwen3-Embedding's form (last-token pooling; its tokenizer pads left, the plane right) and ModernBERT."""
    served = embed(pooled, name, SHORT)
    expected = SentenceTransformer(str(pooling_dirs[name]), device="cpu").encode(SHORT, convert_to_tensor=True)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_a_plain_transformers_encoder_pools_cls_and_normalises_as_vllm(pooled, pooling_dirs):
    """XLM-RoBERTa saved by transformers alone: vLLM's defaults for an encoder, CLS pooling, normalised."""
    config, model, spec, _ = pooled("xlmr")
    assert (spec.pooling_type, spec.normalize, spec.input_names) == ("CLS", True, ("input_ids", "attention_mask"))
    encoder = Transformer(str(pooling_dirs["xlmr"]))
    reference = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), "cls"), Normalize()],
                                    device="cpu")
    torch.testing.assert_close(embed(pooled, "xlmr", SHORT), reference.encode(SHORT, convert_to_tensor=True),
                               atol=EMBEDDING_TOLERANCE, rtol=0)


@pytest.mark.parametrize("dimensions", [8, 16])
def test_matryoshka_dimensions_equal_encode_truncated_and_normalised_again(pooled, pooling_dirs, dimensions):
    served = embed(pooled, "embedder-one", TEXTS, source="embedder", dimensions=dimensions)
    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True, truncate_dim=dimensions, normalize_embeddings=True)
    assert served.shape == (len(TEXTS), dimensions)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_an_embedding_model_scores_pairs_by_the_cosine_of_their_embeddings(pooled, pooling_dirs):
    """As vLLM scores with an embedding model: rerank and score work on task: embed too."""
    async def calls(plane):
        return (await pool(plane, PoolingRequest("score", pairs=[(QUERY, d) for d in DOCUMENTS]))).values

    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    expected = reference.similarity(reference.encode([QUERY]), reference.encode(DOCUMENTS))[0]
    served = run(pooled, "embedder-one", calls, source="embedder")
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_truncation_keeps_the_special_tokens_as_the_tokenizer_cuts(pooled, pooling_dirs):
    long = " ".join(TEXTS * 4)  # past the 64 tokens of the longest bucket

    async def calls(plane):
        found = []
        for truncate in (-1, 10):
            result = await pool(plane, PoolingRequest("embed", texts=[long], truncate=truncate))
            found.append((result.values, result.tokens))
        return found

    (full, full_tokens), (short, short_tokens) = run(pooled, "embedder-one", calls, source="embedder")
    reference = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    assert (full_tokens, short_tokens) == (64, 10)
    for values, tokens in ((full, 64), (short, 10)):
        reference.max_seq_length = tokens  # encode cuts at max_seq_length, keeping [CLS] and [SEP]
        torch.testing.assert_close(values, reference.encode([long], convert_to_tensor=True),
                                   atol=EMBEDDING_TOLERANCE, rtol=0)


@pytest.mark.parametrize("request_, message", [
    (PoolingRequest("embed", texts=["a " * 80]),
     "input[0] is 82 tokens, more than this model's maximum of 64 (pooling.max_model_len, its longest length "
     "bucket); shorten it, or set truncate_prompt_tokens (at most 64, or -1 for that) to cut it"),
    (PoolingRequest("embed", texts=["a"], truncate=65),
     "truncate_prompt_tokens: 65 is more than this model's maximum of 64 tokens (pooling.max_model_len); give at "
     "most 64, or -1 for that"),
    (PoolingRequest("embed", texts=["a"], dimensions=12),
     "dimensions: 12 is not one of this model's Matryoshka dimensions [8, 16]; give one of them"),
    (PoolingRequest("embed", texts=["a"], dimensions=33),
     "dimensions: 33 is more than this model's 32; give at most 32"),
    (PoolingRequest("embed", token_ids=[[5, 6], [7, 4000]], field="input"),
     "input[1][1]: token id 4000 is not in this model's vocabulary (0 to 999)"),
    (PoolingRequest("embed", token_ids=[[]], single=True), "input has no tokens; give a non-empty text or token list"),
    (PoolingRequest("classify", texts=["a"]), "model 'embedder-one' is a task: embed model; it cannot classify"),
])
def test_what_the_model_cannot_take_is_refused_naming_the_field_and_the_plane_serves_on(pooled, request_, message):
    async def calls(plane):
        with pytest.raises(InvalidInput) as refused:
            await pool(plane, request_)
        return str(refused.value), await pool(plane, PoolingRequest("embed", texts=["still served"]))

    refused, after = run(pooled, "embedder-one", calls, source="embedder")
    assert refused == message
    assert after.values.shape == (1, 32)


def test_every_compiled_model_takes_one_copy_of_the_weights(pooled, pooling_dirs):
    """Two length buckets at two batch sizes: four compiled models, whose executables take the same device tensors
    (compile/core_weights.py), one of each of the encoder's weights; the embeddings stay encode's."""
    from neuron_serve.compile import core_weights  # noqa: PLC0415
    from neuron_serve.compile.subgraph import CompiledSubgraph  # noqa: PLC0415

    config, model, _, _ = pooled("embedder", batch_sizes=[2, 8])
    grid = [b for i in range(len(model.buckets)) for b in model.grid(i)]
    assert len(grid) == 4
    held = model.held_weights()
    for bucket in grid:
        subgraphs = [m for m in bucket.graph_module.children() if isinstance(m, CompiledSubgraph)]
        assert subgraphs and not any(s.inline_weights for s in subgraphs)
        for sub in subgraphs:
            for (name, weight), tensor in zip(sub.held_weights.items(), sub._weights_on_device):
                assert weight is held[name, weight.device] and tensor is weight.tensor
    # What the process holds on the core for these host tensors is exactly this one set.
    storages = {w.key[0] for w in held.values()}
    on_core = [w for w in core_weights.held() if w.key[0] in storages]
    assert {id(w) for w in on_core} == {id(w) for w in held.values()}
    async def calls(plane):
        return (await pool(plane, PoolingRequest("embed", texts=list(TEXTS)))).values

    served = run(pooled, "embedder", calls, None, batch_sizes=[2, 8])
    expected = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(served, expected, atol=EMBEDDING_TOLERANCE, rtol=0)

