"""gRPC calls for both models of the two-model server (mlp and encoder) over many fresh
connections. The kernel spreads the connections over both models' replicas (one shared
port), so one of each connection's two calls lands on the other model's replica: it
relays it to a replica of the named model (its private port), not through Ray Serve's
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


def test_calls_for_both_models_over_new_connections_are_relayed_not_served_by_handle(server, models):
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

    # Each connection reached one model's replica: its call for the other model was relayed.
    assert more(("mlp", "relay")) + more(("encoder", "relay")) == CONNECTIONS, after
    assert more(("mlp", "serve")) == more(("encoder", "serve")) == 0, after  # none through the Serve handle
