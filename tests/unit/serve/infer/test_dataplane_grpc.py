"""A gRPC ModelInfer through a model replica's data plane (no Ray, no network): it reaches
the model as tensors, with no JSON written or parsed on the way, and answers in raw bytes."""

import asyncio
import json

import jiter
import numpy as np
import torch
from tritonclient.grpc import service_pb2 as pb

from neuron_serve.serve.grpc import service as grpc_service
from neuron_serve.serve.infer.plane import ModelDataPlane
from neuron_serve.serve.protocols import oip_rest

TOLERANCE = 1e-5


class Calls:
    """Counts the calls of the functions it wraps; each still runs."""

    def __init__(self, monkeypatch, *targets):
        self.count = 0
        for owner, name in targets:
            real = getattr(owner, name)

            def counted(*args, _real=real, **kwargs):
                self.count += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


def test_raw_contents_reach_the_model_without_json(config, built, eager, monkeypatch):
    x = torch.rand(3, 8)
    request = pb.ModelInferRequest(model_name="scores", id="no-json")
    request.inputs.add(name="x", datatype="FP32", shape=[3, 8])
    request.raw_input_contents.append(x.numpy().astype("<f4").tobytes())
    payload = request.SerializeToString()

    async def calls():
        plane = ModelDataPlane(config, built, replica="test")
        plane.start()
        try:
            await grpc_service.replica_call(plane, "infer", payload)  # warm: first-call costs are not counted
            await asyncio.sleep(0)  # ... nor its metrics, applied on the loop's next turn (a label's first use encodes a JSON key)
            json_calls = Calls(monkeypatch, (json, "loads"), (json, "dumps"), (jiter, "from_json"))
            rest_calls = Calls(monkeypatch, (oip_rest, "parse_infer_request"), (oip_rest, "encode_response"))
            answer = await grpc_service.replica_call(plane, "infer", payload)
            return answer, json_calls.count, rest_calls.count
        finally:
            await plane.stop()

    (status, response), json_count, rest_count = asyncio.run(calls())
    assert status == "ok" and (json_count, rest_count) == (0, 0)
    assert (response.id, response.outputs[0].name, list(response.outputs[0].shape)) == ("no-json", "scores", [3, 4])
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(3, 4)
    torch.testing.assert_close(torch.from_numpy(got.copy()), eager(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_a_bad_grpc_request_answers_the_http_message(config, built):
    request = pb.ModelInferRequest(model_name="scores")
    request.inputs.add(name="x", datatype="FP32", shape=[2, 5])
    request.raw_input_contents.append(b"\0" * 40)

    async def calls():
        plane = ModelDataPlane(config, built, replica="test")
        plane.start()
        try:
            return await grpc_service.replica_call(plane, "infer", request.SerializeToString())
        finally:
            await plane.stop()

    assert asyncio.run(calls()) == ("error", 400, "input 'x' has shape [2, 5]; expected [-1, 8]")
