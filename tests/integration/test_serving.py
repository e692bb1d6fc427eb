"""The served models over HTTP, through the clients users already have."""

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as triton

ROOT_DEPLOYMENTS = __import__("pathlib").Path(__file__).resolve().parents[2] / "deployments"
sys.path.insert(0, str(ROOT_DEPLOYMENTS))
from example_models import encoder, mlp  # noqa: E402

TOLERANCE = 1e-5
ENCODER_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def mlp_model():
    return mlp.build()


@pytest.fixture(scope="module")
def encoder_model():
    return encoder.build(layers=4, hidden=256)


def http(server, method, path, body=None, headers=None):
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


MLP_OUTPUTS = [{"name": "output_0", "datatype": "FP32", "shape": [-1, 10]}]


def client(server):
    return triton.InferenceServerClient(server.url.removeprefix("http://"), concurrency=8)


def test_health_and_metadata(server):
    assert http(server, "GET", "/v2/health/live") == (200, b'{"live":true}')
    assert http(server, "GET", "/v2/health/ready")[0] == 200
    status, body = http(server, "GET", "/v2")
    meta = json.loads(body)
    assert status == 200 and meta["models"] == ["encoder", "mlp"] and meta["emulated"] is True
    c = client(server)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("mlp")
    model = c.get_model_metadata("mlp")
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 784]}]
    assert model["outputs"] == MLP_OUTPUTS
    assert [p["device"] for p in model["parameters"]["partitions"]] == ["neuron", "cpu"]
    assert model["parameters"]["batch_sizes"] == [1, 4, 16, 32, 64]  # deployments/mlp.yaml
    assert model["parameters"]["cores"] == 2


def test_deploy_prints_a_line_per_compiled_model_and_the_placement_not_the_operator_lists(server):
    # The placement lines end each replica's background compile, which may have just ended.
    log = server.output(*(rf"neuron_serve: placement of {model} " for model in ("mlp", "encoder")))
    for model, placement in [
        ("mlp", "5 accelerator subgraphs, 5 CPU subgraphs; operators: 30 on the accelerator, 5 on CPU (aten::sort)"),
        ("encoder", "accelerator subgraphs, 0 CPU subgraphs;"),
    ]:
        prefix = rf"^\(ServeReplica:{model}:model pid=\d+\) neuron_serve: "
        steps = re.findall(prefix + rf"compiled {model}\b.* \((\d+) of (\d+)\) in [\d.]+ s$", log, re.MULTILINE)
        total = int(steps[0][1])
        assert [(int(k), int(n)) for k, n in steps] == [(k, total) for k in range(1, total + 1)], steps
        summaries = re.findall(prefix + rf"placement of {model} \({total} compiled models\): (.*)$", log, re.MULTILINE)
        assert len(summaries) == 1 and placement in summaries[0] and summaries[0].endswith("; --verbose lists them")
    # deployments/mlp.yaml's 5 sizes: the replica is ready on the largest (any batch runs in it), the
    # other 4 compile in the background.
    assert re.search(r"neuron_serve: compiled mlp batch 64 \(1 of 5\)", log)
    assert re.search(r"neuron_serve: model mlp built in [\d.]+s; ready on 1 of 5 compiled models, the other 4 "
                     r"compile in the background", log)
    assert re.search(r"neuron_serve: model mlp: background compile finished [\d.]+ s after the build began: 5 "
                     r"compiled models(?!,)", log)  # and no ", N failed"
    for operator_list in ("Num Partitions", "The following operat", "aten::linear:", "subgraph accel_0"):
        assert operator_list not in log  # those are --verbose's


def test_unknown_model_is_404_with_json_error(server):
    for method, path in [("GET", "/v2/models/nope"), ("GET", "/v2/models/nope/ready"), ("POST", "/v2/models/nope/infer")]:
        status, body = http(server, method, path, body=b"{}" if method == "POST" else None)
        assert status == 404 and json.loads(body) == {"error": "model 'nope' not found"}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_infer_matches_eager(server, mlp_model, binary):
    x = torch.rand(3, 784)
    inp = triton.InferInput("x", [3, 784], "FP32")
    inp.set_data_from_numpy(x.numpy(), binary_data=binary)
    out = triton.InferRequestedOutput("output_0", binary_data=binary)
    result = client(server).infer("mlp", [inp], outputs=[out])
    torch.testing.assert_close(torch.from_numpy(result.as_numpy("output_0").copy()), mlp_model(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert client(server).get_model_metadata("mlp")["outputs"] == MLP_OUTPUTS  # after a request as before


def test_encoder_sequence_buckets_over_http(server, encoder_model):
    c = client(server)
    for length in (7, 40, 128):
        ids = torch.randint(0, 1000, (2, length))
        mask = torch.ones(2, length, dtype=torch.int64)
        inputs = []
        for name, t in (("input_ids", ids), ("attention_mask", mask)):
            i = triton.InferInput(name, list(t.shape), "INT64")
            i.set_data_from_numpy(t.numpy(), binary_data=True)
            inputs.append(i)
        result = c.infer("encoder", inputs)
        ref = encoder_model(ids, mask)
        hidden = torch.from_numpy(result.as_numpy("last_hidden_state").copy())
        assert hidden.shape == (2, length, 256)
        torch.testing.assert_close(hidden, ref.last_hidden_state, atol=ENCODER_TOLERANCE, rtol=ENCODER_TOLERANCE)
        torch.testing.assert_close(
            torch.from_numpy(result.as_numpy("pooler_output").copy()), ref.pooler_output, atol=ENCODER_TOLERANCE, rtol=ENCODER_TOLERANCE
        )


def test_concurrent_requests_each_get_their_own_answer(server, mlp_model):
    rows = [torch.rand(1 + i % 3, 784) for i in range(96)]

    def send(x):
        inp = triton.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x.numpy(), binary_data=True)
        return torch.from_numpy(client(server).infer("mlp", [inp]).as_numpy("output_0").copy())

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(send, rows))
    for x, out in zip(rows, outputs):
        torch.testing.assert_close(out, mlp_model(x), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "not valid JSON"),
        (json.dumps({"inputs": [{"name": "y", "shape": [1, 784], "datatype": "FP32", "data": [0.0] * 784}]}).encode(), "'y'"),
        (json.dumps({"inputs": [{"name": "x", "shape": [1, 784], "datatype": "INT64", "data": [0] * 784}]}).encode(), "FP32"),
        (json.dumps({"inputs": [{"name": "x", "shape": [1, 5], "datatype": "FP32", "data": [0.0] * 5}]}).encode(), "784"),
        (json.dumps({"inputs": [{"name": "x", "shape": [1, 784], "datatype": "FP32", "data": [0.0] * 3}]}).encode(), "784"),
        (json.dumps({"inputs": [{"name": "x", "shape": [65, 784], "datatype": "FP32", "data": [0.0] * 65 * 784}]}).encode(), "[65, 784]"),
    ],
    ids=["malformed-json", "wrong-name", "wrong-dtype", "wrong-shape", "wrong-length", "too-many-rows"],
)
def test_bad_requests_are_400_with_a_message_and_the_server_keeps_serving(server, mlp_model, body, fragment):
    status, reply = http(server, "POST", "/v2/models/mlp/infer", body, {"Content-Type": "application/json"})
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert fragment in error
    test_tritonclient_infer_matches_eager(server, mlp_model, binary=True)


def _series(text, name):
    pattern = re.compile(rf"^{name}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$", re.M)
    out = []
    for m in pattern.finditer(text):
        labels = dict(kv.split("=", 1) for kv in m["labels"].split(","))
        out.append(({k: v.strip('"') for k, v in labels.items()}, float(m["value"])))
    return out


def test_metrics_count_requests_and_cores_share_the_work(server):
    before = http(server, "GET", "/metrics")[1].decode()
    ok_before = sum(v for l, v in _series(before, "neuron_serve_requests_total") if l["model"] == "mlp" and l["code"] == "200")
    chunks_before = {l["core"]: v for l, v in _series(before, "neuron_serve_core_chunks_total") if l["model"] == "mlp"}
    sizes_before = {int(l["batch_size"]): v for l, v in _series(before, "neuron_serve_batch_size_chunks_total")
                    if l["model"] == "mlp"}
    padding_before = sum(v for l, v in _series(before, "neuron_serve_padding_rows_total") if l["model"] == "mlp")
    sent = 120
    x = np.random.rand(32, 784).astype(np.float32)

    def send(_):
        inp = triton.InferInput("x", [32, 784], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        client(server).infer("mlp", [inp])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, range(sent)))
    # A request is counted once its answer has gone out, so the last few may be counted a moment
    # after their clients have them: read until every one is (or the deadline passes).
    deadline = time.monotonic() + 10
    while True:
        after = http(server, "GET", "/metrics")[1].decode()
        ok_after = sum(v for l, v in _series(after, "neuron_serve_requests_total")
                       if l["model"] == "mlp" and l["code"] == "200")
        if ok_after - ok_before >= sent or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ok_after - ok_before == sent
    chunks = {l["core"]: v - chunks_before.get(l["core"], 0) for l, v in _series(after, "neuron_serve_core_chunks_total") if l["model"] == "mlp"}
    sizes = {int(l["batch_size"]): v - sizes_before.get(int(l["batch_size"]), 0)
             for l, v in _series(after, "neuron_serve_batch_size_chunks_total") if l["model"] == "mlp"}
    padding = sum(v for l, v in _series(after, "neuron_serve_padding_rows_total") if l["model"] == "mlp") - padding_before
    # Every row sent ran in a compiled size, and what the sizes ran beyond them is the padding counted.
    assert sum(size * n for size, n in sizes.items()) - padding == sent * 32
    assert set(sizes) <= {1, 4, 16, 32, 64}
    assert set(chunks) == {"0", "1"}
    assert sum(chunks.values()) == sum(sizes.values())  # one per chunk, on whichever core ran it
    # Both cores take a share: a chunk goes to the core that ran last while it is idle (runtime/cores.py), so
    # the split follows how often eight clients overlap, even only under a loaded machine (30 and 42 seen).
    assert min(chunks.values()) >= 0.25 * sum(chunks.values()), chunks
    assert "neuron_serve_partition_seconds_bucket" in after and 'device="cpu"' in after
    # The per-call cost of every compiled size, timed at load, is what chose those sizes.
    costs = {int(l["batch_size"]): v for l, v in _series(after, "neuron_serve_batch_size_cost_seconds") if l["model"] == "mlp"}
    assert set(costs) == {1, 4, 16, 32, 64} and all(v > 0 for v in costs.values())


def test_replicas_run_at_normal_priority(server):
    # Ray's default worker niceness (15) would let any other process on the host take
    # the CPU from requests in flight.
    pids = server.replica_pids("mlp")
    assert pids and {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {0}


def test_openapi_document_lists_the_oip_routes(server):
    status, body = http(server, "GET", "/openapi.json")
    paths = json.loads(body)["paths"]
    assert status == 200
    assert {"/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/{name}/infer"} <= set(paths)
