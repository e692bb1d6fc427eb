"""OIP v2 over gRPC against a real server (guarded.yaml: bearer token, small limits),
through tritonclient.grpc and the generated stubs, with no JSON on the wire."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from http_client import Client, infer_body

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

MODEL = "guarded"
TOLERANCE = 1e-5  # XLA:CPU vs eager float32, as in test_guarded.py
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def eager():
    return faulty.build(features=8, delay_ms=0)


@pytest.fixture(scope="module")
def auth(guarded):
    return {"authorization": f"Bearer {guarded.token}"}


@pytest.fixture(scope="module")
def client(guarded):
    c = tgrpc.InferenceServerClient(guarded.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(guarded):
    channel = grpc.insecure_channel(guarded.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def rows(n=3, first=None):
    data = np.random.rand(n, 8).astype("float32")
    if first is not None:
        data[0, 0] = first
    return data


def triton_infer(client, auth, data, model=MODEL):
    x = tgrpc.InferInput("x", list(data.shape), "FP32")
    x.set_data_from_numpy(data)  # raw_input_contents
    return client.infer(model, [x], headers=auth)


def eager_out(eager, data):
    with torch.no_grad():
        return eager(torch.from_numpy(data)).numpy()


def test_every_port_answers_at_the_ready_line_and_at_the_first_ready_200(guarded):
    """The calls made, once each, the moment deploy printed its ready line and the moment
    /v2/health/ready first answered 200 (conftest.first_calls): no UNAVAILABLE from a gRPC front
    still starting (server-level calls and an unknown model's included), and HTTP agrees."""
    first = {"grpc server live": True, "grpc server ready": True, "grpc guarded ready": True,
             "grpc nope ready": "StatusCode.NOT_FOUND: model 'nope' not found", "grpc guarded infer": [1, 4],
             "http /v2/health/ready": 200, "http /v2/models/guarded": 200, "http /metrics": 200}
    assert guarded.first_calls == first
    assert guarded.first_200_calls == first


def test_health_readiness_and_metadata(client, auth, stub):
    assert client.is_server_live() and client.is_server_ready()  # open, as the HTTP probes
    assert client.is_model_ready(MODEL, headers=auth)
    server = client.get_server_metadata(headers=auth)
    assert server.name == "neuron-serve" and {"model_configuration", "statistics"} <= set(server.extensions)
    meta = client.get_model_metadata(MODEL, headers=auth)
    assert (meta.name, meta.platform.endswith("-emulated")) == (MODEL, True)
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 8])]
    assert [t.name for t in meta.outputs] == ["output_0"]


def test_raw_infer_matches_eager(client, auth, eager):
    data = rows(3)
    result = triton_infer(client, auth, data)
    response = result.get_response()
    assert len(response.raw_output_contents) == 1 and not response.outputs[0].HasField("contents")
    np.testing.assert_allclose(result.as_numpy("output_0"), eager_out(eager, data), rtol=TOLERANCE, atol=TOLERANCE)


def test_typed_contents_infer_matches_eager(stub, auth, eager):
    data = rows(2)
    request = pb.ModelInferRequest(model_name=MODEL, id="typed-1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 8])
    tensor.contents.fp32_contents.extend(data.reshape(-1).tolist())
    response = stub.ModelInfer(request, metadata=list(auth.items()), timeout=60)
    assert response.id == "typed-1" and response.model_name == MODEL
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("output_0", "FP32", [2, 4])
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 4)
    np.testing.assert_allclose(got, eager_out(eager, data), rtol=TOLERANCE, atol=TOLERANCE)


def test_config_and_statistics_twins(client, auth):
    config = client.get_model_config(MODEL, headers=auth).config
    assert config.max_batch_size == 4 and config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", model_config_pb2.TYPE_FP32, [8])]
    before = client.get_inference_statistics(MODEL, headers=auth).model_stats[0]
    for _ in range(3):
        triton_infer(client, auth, rows(2))
    after = client.get_inference_statistics(MODEL, headers=auth).model_stats[0]
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert after.inference_count - before.inference_count == 6
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns


def grpc_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value


def http_error(guarded, body) -> str:
    http = Client(guarded.url, token=guarded.token)
    try:
        return http.infer(MODEL, body).json()["error"]
    finally:
        http.close()


def test_bad_input_is_invalid_argument_with_the_http_message(client, auth, guarded):
    err = grpc_error(lambda: triton_infer(client, auth, np.zeros((2, 7), "float32")))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.message() == http_error(guarded, infer_body([[0.0] * 7] * 2))
    assert "input 'x' has shape [2, 7]" in err.message()


def test_unknown_model_is_not_found(client, auth):
    err = grpc_error(lambda: triton_infer(client, auth, rows(1), model="nope"))
    assert (err.status(), err.message()) == ("StatusCode.NOT_FOUND", "model 'nope' not found")
    assert grpc_error(lambda: client.get_model_config("nope", headers=auth)).status() == "StatusCode.NOT_FOUND"


def test_missing_or_wrong_token_is_unauthenticated(client):
    for headers, problem in ((None, "missing Authorization header"), ({"authorization": "Bearer wrong-token-000000"},
                                                                       "invalid bearer token")):
        err = grpc_error(lambda: triton_infer(client, headers, rows(1)))
        assert err.status() == "StatusCode.UNAUTHENTICATED" and problem in err.message()


def test_message_past_the_limit_is_resource_exhausted(client, auth):
    err = grpc_error(lambda: triton_infer(client, auth, np.zeros((4, 4096), "float32")))  # 64 KiB + header
    assert err.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_request_past_its_timeout_is_deadline_exceeded(client, auth):
    err = grpc_error(lambda: triton_infer(client, auth, rows(1, first=faulty.STALL_MARK)))
    assert err.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert f"request timed out after waiting {TIMEOUT_S:g}s" in err.message()
    time.sleep(faulty.STALL_S - TIMEOUT_S)  # let the stalled batch finish


def test_burst_past_the_queue_is_unavailable_then_recovers(client, auth, eager):
    def one(_):
        try:
            triton_infer(client, auth, rows(4))
            return "ok", ""
        except InferenceServerException as exc:
            return exc.status(), exc.message()

    with ThreadPoolExecutor(96) as pool:
        answers = list(pool.map(one, range(288)))
    codes = {code for code, _ in answers}
    assert codes <= {"ok", "StatusCode.UNAVAILABLE"}, codes
    refused = [m for code, m in answers if code == "StatusCode.UNAVAILABLE"]
    assert refused and all("queue full" in m for m in refused), refused[:3]
    data = rows(2)
    np.testing.assert_allclose(triton_infer(client, auth, data).as_numpy("output_0"), eager_out(eager, data),
                               rtol=TOLERANCE, atol=TOLERANCE)


def test_health_service_answers_probes(guarded):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(guarded.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "live", "ready"):  # open, as the HTTP probes
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="other"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
