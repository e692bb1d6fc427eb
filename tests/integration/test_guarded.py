"""Authentication, limits, typed errors and overload over real HTTP (guarded.yaml).

The model (tests/integration/models/faulty.py) runs a CPU gate that raises for a row
whose first value is -999 and stalls for one starting with -555; every batch takes
about 20 ms, so the server's capacity is small and known.
"""

import json
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from http_client import Client, infer_body, outputs

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

MODEL = "guarded"
TOLERANCE = 1e-5  # XLA:CPU vs eager float32 for two small linear layers
QUEUE = 16  # batching.max_queue_size in guarded.yaml
RUNNING = 2 * 1 * 4  # two batches per core, one core, max_batch_size 4
TIMEOUT_S = 2.0  # batching.request_timeout_s


@pytest.fixture(scope="module")
def eager():
    return faulty.build(features=8, delay_ms=0)


@pytest.fixture(scope="module")
def api(guarded):
    client = Client(guarded.url, token=guarded.token)
    yield client
    client.close()


def expected(eager, rows):
    with torch.no_grad():
        return eager(torch.tensor(rows, dtype=torch.float32))


def assert_json_error(answer, status, text):
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["content-type"] == "application/json"
    assert text in answer.json()["error"]


# -- authentication ----------------------------------------------------------------


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"),
    ("GET", f"/v2/models/{MODEL}"), ("GET", f"/v2/models/{MODEL}/ready"), ("POST", f"/v2/models/{MODEL}/infer"),
    ("GET", "/v2/models/other"), ("POST", "/v2/models/other/infer"),
])
def test_every_route_but_health_needs_the_token(api, method, path):
    body = json.dumps(infer_body([[0.5] * 8])).encode() if method == "POST" else None
    for headers, problem in [({}, "missing Authorization header"),
                             ({"Authorization": "Bearer wrong-token-0123456789"}, "invalid bearer token"),
                             ({"Authorization": f"Basic {api.token}"}, "invalid bearer token"),
                             ({"Authorization": f"Bearer {api.token}x"}, "invalid bearer token")]:
        answer = api.request(method, path, body, headers, auth=False)
        assert_json_error(answer, 401, f"unauthorized: {problem}")
        assert answer.headers["www-authenticate"] == 'Bearer realm="neuron-serve"'
    assert api.request(method, path, body).status in (200, 404)


def test_health_probes_stay_open(api):
    assert api.request("GET", "/v2/health/live", auth=False).status == 200
    assert api.request("GET", "/v2/health/ready", auth=False).status == 200


def test_with_the_token_inference_matches_eager(api, eager):
    rows = [[0.1 * i + j for i in range(8)] for j in range(3)]
    answer = api.infer(MODEL, infer_body(rows))
    assert answer.status == 200, answer.body
    torch.testing.assert_close(torch.tensor(outputs(answer)), expected(eager, rows), atol=TOLERANCE, rtol=TOLERANCE)


# -- limits --------------------------------------------------------------------------


LIMIT = 65536  # http.max_request_bytes in guarded.yaml


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_past_the_limit_is_413(api, chunked):
    body = json.dumps(infer_body([[0.5] * 8] * 2000)).encode()
    assert len(body) > LIMIT
    answer = api.infer(MODEL, body, chunked=chunked)
    assert_json_error(answer, 413, f"exceeds the limit of {LIMIT} bytes")


def test_binary_body_past_the_limit_is_413(api):
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3000, 8],
                                     "parameters": {"binary_data_size": 3000 * 8 * 4}}]}).encode()
    body = header + bytes(3000 * 8 * 4)
    answer = api.infer(MODEL, body, {"Inference-Header-Content-Length": str(len(header))})
    assert_json_error(answer, 413, f"exceeds the limit of {LIMIT} bytes")


@pytest.mark.parametrize("shape,text", [
    ([2**62, 8], "has more than max_elements=32 elements, the most one input of this model holds"),
    ([5, 8], "has more than max_elements=32 elements"),  # past batching.max_batch_size rows
    ([2**64, 8], "has more than max_elements=32"),
    ([-1, 8], "shape dimension 0 is -1 (a number); dimensions must be non-negative integers"),
    ([1] * 65 + [8], "more than 64"),
])
def test_huge_or_negative_dims_are_refused_before_allocating(api, shape, text):
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": [0.5] * 8}]}
    assert_json_error(api.infer(MODEL, body), 400, text)


def test_binary_header_length_that_lies_is_400(api):
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 8],
                                     "parameters": {"binary_data_size": 32}}]}).encode()
    body = header + struct.pack("<8f", *range(8))
    for length, text in [(len(body) + 1, "but the request body is only"), (len(header) - 3, "not valid JSON"),
                         (-4, "must not be negative"), ("ten", "must be an integer")]:
        answer = api.infer(MODEL, body, {"Inference-Header-Content-Length": str(length)})
        assert_json_error(answer, 400, text)


# -- typed errors: a model fault, a timeout ---------------------------------------------


def test_cpu_subgraph_fault_fails_only_its_request(api, eager):
    """The marked request gets 500 with the gate's message; requests batched with it succeed."""
    good = [[[0.1 * j + 0.05] * 8] for j in range(7)]
    bad = [[faulty.FAIL_MARK] + [0.0] * 7]
    barrier = threading.Barrier(8)

    def send(rows):
        barrier.wait()
        return api.infer(MODEL, infer_body(rows))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, good + [bad]))
    api.close()
    assert_json_error(answers[-1], 500, faulty.FAULT_MESSAGE)
    for rows, answer in zip(good, answers[:-1]):
        assert answer.status == 200, answer.body
        torch.testing.assert_close(torch.tensor(outputs(answer)), expected(eager, rows), atol=TOLERANCE, rtol=TOLERANCE)


def test_request_past_its_timeout_is_504(api):
    answer = api.infer(MODEL, infer_body([[faulty.STALL_MARK] + [0.0] * 7]))
    assert_json_error(answer, 504, f"request timed out after waiting {TIMEOUT_S:g}s")
    assert answer.seconds >= TIMEOUT_S  # it waited its deadline (how soon after: bench/overload.py)
    time.sleep(faulty.STALL_S - TIMEOUT_S)  # let the stalled batch finish before the next test


# -- overload (latency and memory figures of the same burst: bench/overload.py) ------------


def test_burst_past_the_queue_bound_gets_503_then_recovers(api, guarded, eager):
    pids = guarded.replica_pids(MODEL)
    assert pids
    capacity = QUEUE + RUNNING  # requests the replica holds at once: queued plus running
    burst = 5 * capacity
    barrier = threading.Barrier(burst)
    rows = [[[0.001 * i] * 8] for i in range(burst)]

    def send(r):
        barrier.wait()
        return api.infer(MODEL, infer_body(r))

    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(send, rows))
    api.close()
    codes = [a.status for a in answers]
    ok = [i for i, c in enumerate(codes) if c == 200]
    refused = [a for a in answers if a.status == 503]
    assert set(codes) <= {200, 503}, codes
    assert refused and len(ok) >= capacity // 2
    for answer in refused:
        assert_json_error(answer, 503, "queue full")
    for i in ok:  # accepted requests completed with their own results
        torch.testing.assert_close(torch.tensor(outputs(answers[i])), expected(eager, rows[i]),
                                   atol=TOLERANCE, rtol=TOLERANCE)
    assert guarded.replica_pids(MODEL) == pids  # nothing crashed or restarted
    after = api.infer(MODEL, infer_body(rows[0]))  # and it serves again
    assert after.status == 200, after.body
    torch.testing.assert_close(torch.tensor(outputs(after)), expected(eager, rows[0]), atol=TOLERANCE, rtol=TOLERANCE)
