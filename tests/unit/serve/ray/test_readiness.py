"""Ready means every port answers: the server app's readiness waits, beside its models' states,
for deploy to have seen every port answer for each model (serve.ray.readiness)."""

import asyncio

from fastapi.testclient import TestClient

from neuron_serve.serve.http.app import server_app
from neuron_serve.serve.ray import readiness


def client(states: dict[str, str], silent: set[str] | None) -> TestClient:
    async def model_states():
        return states

    async def unchecked(models):
        return set(models) & silent

    return TestClient(server_app(model_states, unchecked=None if silent is None else unchecked))


def test_ready_and_health_wait_for_every_models_ports():
    waiting = client({"a": "ready", "b": "ready"}, {"b"})
    answer = waiting.get("/v2/health/ready")
    assert answer.status_code == 503
    assert answer.json() == {"ready": False, "error": "models ready, but not every port answers for them yet "
                                                      "(HTTP, gRPC, metrics): ['b']"}
    assert waiting.get("/health").status_code == 503
    for ready in (client({"a": "ready", "b": "ready"}, set()), client({"a": "ready"}, None)):
        assert ready.get("/v2/health/ready").json() == {"ready": True}
        assert ready.get("/health").status_code == 200
    loading = client({"a": "deploying"}, set())
    assert loading.get("/v2/health/ready").json()["error"] == "models not ready: {'a': 'deploying'}"


def test_the_record_is_read_again_soon_while_a_model_is_missing(monkeypatch):
    reads = []
    record = {"a"}

    def read():
        reads.append(set(record))
        return set(record)

    def age(seconds: float) -> None:  # the record as if read ``seconds`` earlier
        stamp, checked = readiness._checked_cache
        readiness._checked_cache = (stamp - seconds, checked)

    monkeypatch.setattr(readiness, "_read", read)
    monkeypatch.setattr(readiness, "_checked_cache", (float("-inf"), set()))

    async def scenario():
        assert await readiness.unchecked(["a"]) == set()
        assert await readiness.unchecked(["a"]) == set() and len(reads) == 1  # cached
        assert await readiness.unchecked(["a", "b"]) == {"b"} and len(reads) == 1  # read just now
        record.add("b")
        age(readiness.POLL_S)
        assert await readiness.unchecked(["a", "b"]) == set() and len(reads) == 2  # one missing: read again soon
        age(readiness.POLL_S)
        assert await readiness.unchecked(["a", "b"]) == set() and len(reads) == 2  # none missing: kept longer

    asyncio.run(scenario())
