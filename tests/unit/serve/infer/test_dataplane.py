"""ModelDataPlane over a built model, with no Ray and no HTTP server: metadata and inference."""

import asyncio
import json

import pytest
import torch

from neuron_serve import metrics
from neuron_serve.errors import InvalidInput
from neuron_serve.serve.infer.http import infer as rest_infer
from neuron_serve.serve.infer.plane import ModelDataPlane

TOLERANCE = 1e-5

INPUTS = [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]
OUTPUTS = [{"name": "scores", "datatype": "FP32", "shape": [-1, 4]}]


def body(x: torch.Tensor) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.flatten().tolist()}]}).encode()


async def serve(config, built, calls):
    """Start a data plane, run ``calls(plane)``, stop it; returns what the calls returned."""
    plane = ModelDataPlane(config, built, replica="test")
    plane.start()
    try:
        return await calls(plane)
    finally:
        await plane.stop()


def test_metadata_gives_the_compiled_signature_before_and_after_requests(config, built, eager):
    async def calls(plane):
        before = plane.metadata()
        x = torch.rand(6, 8)
        content, _ = await rest_infer(plane, body(x), {})
        return before, plane.metadata(), x, json.loads(content)

    before, after, x, response = asyncio.run(serve(config, built, calls))
    assert before["inputs"] == after["inputs"] == INPUTS
    assert before["outputs"] == after["outputs"] == OUTPUTS
    assert before["parameters"]["cores"] == 1
    [out] = response["outputs"]
    assert out["name"] == "scores" and out["shape"] == [6, 4]
    torch.testing.assert_close(torch.tensor(out["data"]).reshape(6, 4), eager(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_a_request_of_the_wrong_shape_is_refused_and_the_plane_keeps_serving(config, built, eager):
    async def calls(plane):
        with pytest.raises(InvalidInput, match=r"input 'x' .*shape \[2, 5\].*expected \[-1, 8\]"):
            await rest_infer(plane, body(torch.rand(2, 5)), {})
        x = torch.rand(1, 8)
        content, _ = await rest_infer(plane, body(x), {})
        return x, json.loads(content)

    x, response = asyncio.run(serve(config, built, calls))
    out = torch.tensor(response["outputs"][0]["data"]).reshape(1, 4)
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_more_rows_than_max_batch_size_are_refused_before_decoding(config, built):
    async def calls(plane):
        with pytest.raises(InvalidInput, match=r"shape \[17, 8\] has more than max_elements=128 elements"):
            await rest_infer(plane, body(torch.rand(17, 8)), {})

    asyncio.run(serve(config, built, calls))


def test_build_time_and_cache_hits_reach_the_metrics(config, built):
    asyncio.run(serve(config, built, lambda plane: asyncio.sleep(0)))
    count = metrics.COMPILE_TIME.labels(model="scores", replica="test")._sum.get()
    assert count >= built.build_info.seconds > 0


def test_a_lone_request_on_an_idle_replica_runs_without_waiting_max_queue_delay(config, built, eager):
    # A 2 s delay: a lone request that waited for company would take at least that long.
    patient = config.model_copy(update={"batching": config.batching.model_copy(update={"max_queue_delay_ms": 2000})})
    labels = {"model": "scores", "replica": "lone"}

    async def calls():
        plane = ModelDataPlane(patient, built, replica="lone")
        plane.start()
        try:
            queued_before = metrics.QUEUE_TIME.labels(**labels)._sum.get()
            started = asyncio.get_running_loop().time()
            x = torch.rand(1, 8)
            content, _ = await rest_infer(plane, body(x), {})
            took = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0)  # metrics are applied on the loop's next turn
            return x, json.loads(content), took, metrics.QUEUE_TIME.labels(**labels)._sum.get() - queued_before
        finally:
            await plane.stop()

    x, response, took, queued = asyncio.run(calls())
    torch.testing.assert_close(torch.tensor(response["outputs"][0]["data"]).reshape(1, 4), eager(x),
                               atol=TOLERANCE, rtol=TOLERANCE)
    assert took < 1.0 and queued < 0.5, (took, queued)


def test_request_metrics_are_recorded_after_the_answer_not_before(config, built):
    labels = {"model": "scores", "replica": "deferred"}

    def served() -> float:
        return metrics.REQUESTS.labels(**labels, code="200")._value.get()

    async def calls():
        plane = ModelDataPlane(config, built, replica="deferred")
        plane.start()
        try:
            before = served()
            await rest_infer(plane, body(torch.rand(2, 8)), {})
            at_answer = served()  # the handler is about to write the answer: nothing recorded yet
            await asyncio.sleep(0)
            return before, at_answer, served()
        finally:
            await plane.stop()

    before, at_answer, after = asyncio.run(calls())
    assert (at_answer - before, after - before) == (0, 1)
