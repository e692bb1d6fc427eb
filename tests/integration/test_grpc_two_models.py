"""gRPC calls for both models of the two-model server (mlp and encoder) over many fresh
connections. HAProxy holds the gRPC port and sends each call to a replica of the model its
message names: none is relayed by another model's replica or goes through Ray Serve's
handle, and every answer equals eager PyTorch."""

import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deployments"))
from example_models import encoder, mlp  # noqa: E402

TOLERANCE = 1e-5  # as test_kserve_client.py: XLA:CPU vs eager float32
ENCODER_TOLERANCE = 1e-4
CONNECTIONS = 24  # each a new TCP connection with one call per model


@pytest.fixture(scope="module")
def models():
    return {"mlp": mlp.build(), "encoder": encoder.build(layers=4, hidden=256)}


def forwarded(server) -> dict[tuple[str, str], float]:
    """neuron_serve_grpc_forwarded_total by (model, via), from the server's /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for labels, value in re.findall(r"^neuron_serve_grpc_forwarded_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[(named["model"], named["via"])] = float(value)
    return found


def requests(x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, pb.ModelInferRequest]:
    """mlp in typed contents (as W1-grpc sends), encoder in raw_input_contents."""
    to_mlp = pb.ModelInferRequest(model_name="mlp", id="mlp-call")
    to_mlp.inputs.add(name="x", datatype="FP32", shape=list(x.shape)).contents.fp32_contents.extend(
        x.reshape(-1).tolist())
    to_encoder = pb.ModelInferRequest(model_name="encoder", id="encoder-call")
    for name, tensor in (("input_ids", ids), ("attention_mask", mask)):
        to_encoder.inputs.add(name=name, datatype="INT64", shape=list(tensor.shape))
        to_encoder.raw_input_contents.append(tensor.numpy().astype("<i8").tobytes())
    return {"mlp": to_mlp, "encoder": to_encoder}


def outputs(response: pb.ModelInferResponse) -> dict[str, torch.Tensor]:
    return {out.name: torch.from_numpy(np.frombuffer(raw, dtype="<f4").reshape(list(out.shape)).copy())
            for out, raw in zip(response.outputs, response.raw_output_contents)}


def on_a_new_connection(server, calls: dict[str, pb.ModelInferRequest]) -> dict[str, pb.ModelInferResponse]:
    # A local subchannel pool: a new connection, not one grpc shares between channels.
    channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return {model: stub.ModelInfer(request, timeout=120) for model, request in calls.items()}
    finally:
        channel.close()


# Apart: the first 200 of a server started beside another server's compiles and the unit tests once came
# before HAProxy counted the server app's gRPC listener up (server-level calls got UNAVAILABLE). The serial run's
# mlp and encoder server (conftest.examples_server), which the documentation's examples then use.
@pytest.mark.serial
def test_every_port_answers_for_both_models_at_the_ready_line_and_at_the_first_ready_200(examples_server):
    """The calls made, once each, the moment deploy printed its ready line and the moment
    /v2/health/ready first answered 200 (conftest.first_calls): HAProxy's gRPC front already
    routes the server app and both models, and HTTP agrees."""
    server = examples_server
    first = {"grpc server live": True, "grpc server ready": True, "grpc mlp ready": True, "grpc encoder ready": True,
             "grpc nope ready": "StatusCode.NOT_FOUND: model 'nope' not found", "grpc mlp infer": [1, 10],
             "http /v2/health/ready": 200, "http /v2/models/mlp": 200, "http /metrics": 200}
    assert server.first_calls == first
    assert server.first_200_calls == first


def test_calls_for_both_models_over_new_connections_reach_their_models_replicas(server, models):
    x, ids = torch.rand(2, 784), torch.randint(0, 1000, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.int64)
    calls = requests(x, ids, mask)
    before = forwarded(server)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: on_a_new_connection(server, calls), range(CONNECTIONS)))
    after = forwarded(server)

    with torch.no_grad():
        want_mlp = models["mlp"](x)
        ref = models["encoder"](ids, mask)
    for answer in answers:
        assert (answer["mlp"].model_name, answer["mlp"].id) == ("mlp", "mlp-call")
        assert (answer["encoder"].model_name, answer["encoder"].id) == ("encoder", "encoder-call")
        torch.testing.assert_close(outputs(answer["mlp"])["output_0"], want_mlp, atol=TOLERANCE, rtol=TOLERANCE)
        got = outputs(answer["encoder"])
        for name in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(got[name], getattr(ref, name), atol=ENCODER_TOLERANCE, rtol=ENCODER_TOLERANCE)

    def more(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Every call went straight to its model's replica: none relayed, none through the Serve handle.
    assert all(more((model, via)) == 0 for model in ("mlp", "encoder") for via in ("relay", "serve")), after


MODELS = ROOT / "tests" / "integration" / "models"


@pytest.fixture(scope="module")
def shared_port(server_factory, tmp_path_factory):
    """Two small models behind Serve's own proxy (no HAProxy): their replicas share the gRPC port."""
    tmp = tmp_path_factory.mktemp("shared-port")
    for name, factory in (("tiny", "tiny_mlp:build"), ("small", "tiny_mlp:build")):
        (tmp / f"{name}.yaml").write_text(f"name: {name}\nmodel:\n  factory: {factory}\ninputs:\n"
                                          "  - name: x\n    shape: [4, 16]\n")
    srv = server_factory([str(tmp / "tiny.yaml"), str(tmp / "small.yaml")], tmp,
                         env={"PYTHONPATH": str(MODELS)}, args=("--ingress", "proxy"))
    yield srv
    srv.stop()


def test_without_haproxy_the_other_models_calls_are_relayed_not_served_by_handle(shared_port):
    """The kernel spreads connections over both models' replicas (SO_REUSEPORT), so one of
    each connection's two calls lands on the other model's replica, which relays it to the
    named model's private port."""
    x = torch.rand(4, 16).numpy()
    calls = {}
    for model in ("tiny", "small"):
        calls[model] = pb.ModelInferRequest(model_name=model, id=f"{model}-call")
        calls[model].inputs.add(name="x", datatype="FP32", shape=[4, 16]).contents.fp32_contents.extend(
            x.reshape(-1).tolist())
    before = forwarded(shared_port)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: on_a_new_connection(shared_port, calls), range(CONNECTIONS)))
    after = forwarded(shared_port)
    sys.path.insert(0, str(MODELS))
    import tiny_mlp  # noqa: PLC0415

    with torch.no_grad():
        want = tiny_mlp.build()(torch.from_numpy(x))
    for answer in answers:
        assert [(a.model_name, a.id) for a in answer.values()] == [("tiny", "tiny-call"), ("small", "small-call")]
        for model in ("tiny", "small"):
            torch.testing.assert_close(outputs(answer[model])["output_0"], want, atol=TOLERANCE, rtol=TOLERANCE)

    def more(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert more(("tiny", "relay")) + more(("small", "relay")) == CONNECTIONS, after
    assert more(("tiny", "serve")) == more(("small", "serve")) == 0, after  # none through the Serve handle
