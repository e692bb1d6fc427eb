"""An embedder, a cross-encoder and a classifier served together by `neuron-serve deploy`, driven by OpenAI's and
Cohere's clients, plain HTTP and OIP v2, and checked against sentence-transformers and transformers, eager."""

import base64
import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import cohere
import httpx
import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import yaml
from openai import BadRequestError, NotFoundError, OpenAI
from sentence_transformers import CrossEncoder, SentenceTransformer

EMBEDDING_TOLERANCE = 1e-5
# A score is a sigmoid of one logit: batched with other requests into a longer bucket, XLA:CPU's kernels sum the
# encoder's products in another order than eager's (1.2e-4 seen on a busy machine).
SCORE_TOLERANCE = 3e-4
MODELS = ("embedder", "reranker", "classifier")
TEXTS = ["the compile cache", "gRPC over HTTP/1 behind HAProxy, one call a request",
         "Ready means every port answers for every model, and deploy prints its ready line only then", "a"]
QUERY = "how does a replica batch requests"
DOCUMENTS = ["a dynamic batcher forms batches of requests", "the partition report", "batching", "gRPC ports",
             "requests wait in a queue for company"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, server_factory, pooling_dirs):
    """The three models on one server (the unit tests' model.yaml files: their graphs are in the compile cache),
    and the eager references read from the same directories."""
    tmp = tmp_path_factory.mktemp("pooling-serve")
    configs = []
    for name in MODELS:
        (path := tmp / f"{name}.yaml").write_text(yaml.safe_dump(pooling_dirs.config(name)))
        configs.append(str(path))
    srv = server_factory(configs, tmp)
    srv.embedder = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    srv.reranker = CrossEncoder(str(pooling_dirs["reranker"]), device="cpu")
    srv.classifier_dir = str(pooling_dirs["classifier"])
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def encode(server, texts, **options) -> torch.Tensor:
    return server.embedder.encode(texts, convert_to_tensor=True, **options)


@pytest.mark.parametrize("base", ["/v1", "/v2/models/embedder/v1"])
@pytest.mark.parametrize("encoding_format", [None, "float"])
def test_openai_client_embeddings_equal_encode(served, base, encoding_format):
    """OpenAI's client unchanged, on the server's /v1 and on the model's own base URL. Given no encoding_format
    it asks for base64 and decodes the vectors itself."""
    options = {"encoding_format": encoding_format} if encoding_format else {}
    with OpenAI(base_url=served.url + base, api_key="unused") as client:
        answer = client.embeddings.create(model="embedder", input=TEXTS, **options)
    got = torch.tensor([item.embedding for item in answer.data])
    torch.testing.assert_close(got, encode(served, TEXTS), atol=EMBEDDING_TOLERANCE, rtol=0)
    tokens = sum(len(served.embedder.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens, answer.model) == (tokens, tokens, "embedder")


def test_matryoshka_dimensions_and_raw_base64_bytes(served):
    status, answer = post(served, "/v1/embeddings", {"model": "embedder", "input": TEXTS, "dimensions": 8,
                                                     "encoding_format": "base64"})
    assert status == 200
    got = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer["data"]]))
    expected = encode(served, TEXTS, truncate_dim=8, normalize_embeddings=True)
    torch.testing.assert_close(got, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_token_id_inputs_equal_their_text(served):
    ids = [served.embedder.tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    status, answer = post(served, "/v1/embeddings", {"model": "embedder", "input": ids})
    assert status == 200
    got = torch.tensor([d["embedding"] for d in answer["data"]])
    torch.testing.assert_close(got, encode(served, TEXTS[:2]), atol=EMBEDDING_TOLERANCE, rtol=0)


def test_cohere_client_reranks_as_cross_encoder_predict(served):
    with httpx.Client() as http:  # the client's own connections, closed with it
        client = cohere.ClientV2(base_url=served.url, api_key="unused", httpx_client=http)
        answer = client.rerank(model="reranker", query=QUERY, documents=DOCUMENTS, top_n=3)
    expected = served.reranker.predict([(QUERY, d) for d in DOCUMENTS])
    order = [int(i) for i in np.argsort(-expected)]
    assert [r.index for r in answer.results] == order[:3]
    np.testing.assert_allclose([r.relevance_score for r in answer.results], expected[order[:3]], atol=SCORE_TOLERANCE)


def test_jina_rerank_and_score_routes(served):
    expected = served.reranker.predict([(QUERY, d) for d in DOCUMENTS])
    status, answer = post(served, "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCUMENTS,
                                                 "return_documents": False})
    assert status == 200 and "document" not in answer["results"][0]
    assert [r["index"] for r in answer["results"]] == [int(i) for i in np.argsort(-expected)]
    status, answer = post(served, "/v2/models/reranker/v1/score", {"model": "reranker", "text_1": QUERY,
                                                                   "text_2": DOCUMENTS})
    assert status == 200
    np.testing.assert_allclose([d["score"] for d in answer["data"]], expected, atol=SCORE_TOLERANCE)


def test_classify_answers_each_label_and_its_probabilities(served):
    status, answer = post(served, "/classify", {"model": "classifier", "input": TEXTS})
    tokenizer = transformers.AutoTokenizer.from_pretrained(served.classifier_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(served.classifier_dir).eval()
    with torch.no_grad():
        expected = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert status == 200
    torch.testing.assert_close(torch.tensor([d["probs"] for d in answer["data"]]), expected, atol=SCORE_TOLERANCE,
                               rtol=0)
    assert [d["label"] for d in answer["data"]] == [f"label_{int(i)}" for i in expected.argmax(-1)]


def test_mixed_lengths_from_32_concurrent_clients_all_equal_eager(served):
    """Texts of 1 to 60 tokens (both length buckets), 32 clients at once: batched together, each answer its own."""
    words = " ".join(TEXTS).split()
    rng = random.Random(0)
    requests = [[" ".join(rng.choices(words, k=rng.randint(1, 40))) for _ in range(rng.randint(1, 3))]
                for _ in range(64)]

    def one(texts):
        return post(served, "/v1/embeddings", {"model": "embedder", "input": texts})

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, requests))
    for texts, (status, answer) in zip(requests, answers):
        assert status == 200, answer
        got = torch.tensor([d["embedding"] for d in answer["data"]])
        torch.testing.assert_close(got, encode(served, texts), atol=EMBEDDING_TOLERANCE, rtol=0)


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/embeddings", {"model": "embedder", "input": []}, 400,
     "input: the list is empty; give at least one text or token list"),
    ("/v1/embeddings", {"model": "embedder", "input": ["a", 7]}, 400,
     "input[1]: a number where input[0] is a string; give strings, token ids or token-id lists, all of one kind"),
    ("/v1/embeddings", {"model": "embedder", "input": "serve " * 70}, 400,
     "input is 72 tokens, more than this model's maximum of 64 (pooling.max_model_len, its longest length bucket); "
     "shorten it, or set truncate_prompt_tokens (at most 64, or -1 for that) to cut it"),
    ("/v1/embeddings", {"model": "gpt-4", "input": "a"}, 404,
     "the model 'gpt-4' does not exist; this server serves: classifier, embedder, reranker"),
    ("/v1/rerank", {"model": "embedder", "query": "a", "documents": []}, 400,
     "documents: the list is empty; give at least one text"),
    ("/classify", {"model": "reranker", "input": "a"}, 400,
     "model 'reranker' is a task: score model, which answers /rerank, /v1/rerank, /v2/rerank, /score, /v1/score; "
     "/classify needs a task: classify model"),
])
def test_bad_input_is_refused_with_its_message_and_the_server_serves_on(served, path, body, status, message):
    got_status, answer = post(served, path, body)
    assert (got_status, answer["error"]["message"]) == (status, message)
    status, answer = post(served, "/v1/embeddings", {"model": "embedder", "input": "still serving"})
    assert status == 200 and len(answer["data"][0]["embedding"]) == 32


def test_openai_client_raises_on_refusals(served):
    with OpenAI(base_url=served.url + "/v1", api_key="unused") as client:
        with pytest.raises(NotFoundError, match="the model 'nope' does not exist"):
            client.embeddings.create(model="nope", input="a")
        with pytest.raises(BadRequestError, match="dimensions: 12 is not one of this model's Matryoshka dimensions"):
            client.embeddings.create(model="embedder", input="a", dimensions=12)


def test_oip_v2_over_http_and_grpc_takes_token_tensors_and_answers_the_embedding(served):
    """The same model over OIP v2: inputs input_ids, attention_mask and token_type_ids (INT64, any batch and
    length), output embedding (FP32): the model is packed, so a row's attention mask numbers its texts (a padded
    row's 0/1 mask is one text) and the embedding holds one full normalised vector per text of a row, the first
    text's first."""
    batch = served.embedder.tokenizer(TEXTS[:2], padding=True, return_tensors="np")
    expected = encode(served, TEXTS[:2])
    for module, address in ((thttp, served.url.removeprefix("http://")), (tgrpc, served.grpc_url)):
        client = module.InferenceServerClient(address)
        inputs = []
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            tensor = module.InferInput(name, list(batch[name].shape), "INT64")
            tensor.set_data_from_numpy(batch[name].astype(np.int64))
            inputs.append(tensor)
        got = torch.from_numpy(client.infer("embedder", inputs).as_numpy("embedding").copy())
        client.close()
        assert got.shape == (2, 32, 32)  # rows, texts a row, dimensions
        got = got[:, 0]
        torch.testing.assert_close(got, expected, atol=EMBEDDING_TOLERANCE, rtol=0)


def test_metrics_count_pooling_requests_by_api_and_outcome(served):
    post(served, "/v1/embeddings", {"model": "embedder", "input": []})
    post(served, "/v1/score", {"model": "reranker", "text_1": "a", "text_2": ["b", "c"]})
    with urllib.request.urlopen(served.url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()

    def sample(name: str, **labels: str) -> float:
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
                 and all(f'{k}="{v}"' in line for k, v in labels.items())]
        return sum(found)

    assert sample("neuron_serve_pooling_requests_total", model="embedder", api="embeddings", code="200") >= 1
    assert sample("neuron_serve_pooling_requests_total", model="embedder", api="embeddings", code="400") >= 1
    assert sample("neuron_serve_pooling_inputs_total", model="reranker", api="score") >= 2
    assert sample("neuron_serve_prompt_tokens_total", model_name="reranker") > 0
    assert sample("neuron_serve_requests_total", model="reranker", code="200") >= 1
    assert sample("neuron_serve_core_chunks_total", model="embedder") >= 1
