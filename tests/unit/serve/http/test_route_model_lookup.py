"""The server app's OpenAI and pooling routes find the model a request names: 404 naming the served ones (with a
hint when the model serves another task), 503 while it is not ready; nothing is forwarded then."""

import pytest
from fastapi.testclient import TestClient

from neuron_serve.serve.http.app import server_app

INFER = {"mlp": "ready"}
GENERATE = {"llm": "ready", "slow": "deploying"}
POOLING = {"embedder": "ready", "reranker": "deploying"}


class Adapters:
    async def entries(self):
        return {"sql": {"base": "llm", "path": "/adapters/sql"}}

    async def entry(self, name):
        return (await self.entries()).get(name)


@pytest.fixture(scope="module")
def client():
    def states(found):
        async def read():
            return found
        return read

    async def refuse(*_):
        raise AssertionError("a request the lookup refused was forwarded")

    return TestClient(server_app(states(INFER), states(GENERATE), refuse, pooling_states=states(POOLING),
                                 forward_pooling=refuse, adapters=Adapters()))


NOT_FOUND = {"type": "not_found_error", "param": "model", "code": "model_not_found"}


@pytest.mark.parametrize("path, model, status, error", [
    ("/v1/completions", "gpt-4", 404,
     {"message": "the model 'gpt-4' does not exist; this server serves: llm, slow, sql", **NOT_FOUND}),
    ("/v1/chat/completions", "embedder", 404,
     {"message": "the model 'embedder' does not exist; this server serves: llm, slow, sql ('embedder' is a pooling "
                 "model, task embed, score or classify: POST /v1/embeddings, /v1/rerank, /v1/score or /classify)",
      **NOT_FOUND}),
    ("/v1/completions", "mlp", 404,
     {"message": "the model 'mlp' does not exist; this server serves: llm, slow, sql ('mlp' is a task: infer model: "
                 "POST /v2/models/mlp/infer)", **NOT_FOUND}),
    ("/v1/completions", "slow", 503,
     {"message": "model 'slow' is not ready (deploying)", "type": "server_error", "param": None,
      "code": None}),
    ("/v1/embeddings", "gpt-4", 404,
     {"message": "the model 'gpt-4' does not exist; this server serves: embedder, reranker", **NOT_FOUND}),
    ("/v1/embeddings", "mlp", 404,
     {"message": "the model 'mlp' does not exist; this server serves: embedder, reranker ('mlp' is not a pooling "
                 "model: task embed, score or classify)", **NOT_FOUND}),
    ("/v1/rerank", "llm", 404,
     {"message": "the model 'llm' does not exist; this server serves: embedder, reranker", **NOT_FOUND}),
    ("/v1/rerank", "reranker", 503,
     {"message": "model 'reranker' is not ready (deploying)", "type": "server_error", "param": None,
      "code": None}),
])
def test_a_model_not_served_or_not_ready_is_refused_with_its_message(client, path, model, status, error):
    answer = client.post(path, json={"model": model, "prompt": "x", "input": "x", "query": "x", "documents": ["x"]})
    assert (answer.status_code, answer.json()) == (status, {"error": error})
    assert answer.headers.get("retry-after") == ("1" if status == 503 else None)
