"""A bucket_model_trace model with a torch.jit.script kernel, saved, then served from `model: {artifact}`.

The kernel pads the sequence to the bucket that fits (8 or 16); the server must take
any length up to 16 as the kernel does, and pick the bucket the kernel picks.
"""

import asyncio
import json
from typing import List, Tuple

import pytest
import torch
from torch import nn

import neuron_serve
from neuron_serve.assembly.from_config import build
from neuron_serve.config.schema import parse_config
from neuron_serve.runtime.runner import ModelRunner
from neuron_serve.serve.infer.http import infer as rest_infer
from neuron_serve.serve.infer.plane import ModelDataPlane

TOLERANCE = 1e-5


class Energy(nn.Module):
    """Sums tanh over the sequence: zero padding leaves the result unchanged."""

    def forward(self, x):
        return torch.tanh(x).sum(dim=-1, keepdim=True) * 3


@torch.jit.script
def pad_to_bucket(inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    x = inputs[0]
    length = x.shape[1]
    size = 8 if length <= 8 else 16
    return [torch.nn.functional.pad(x, [0, size - length])], torch.tensor(0 if size == 8 else 1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = neuron_serve.bucket_model_trace(
        lambda: (Energy(), {}), [torch.rand(1, 8), torch.rand(1, 16)], neuron_serve.BucketModelConfig(lambda: pad_to_bucket)
    )
    path = neuron_serve.save(model, tmp_path_factory.mktemp("artifact") / "energy")
    config = parse_config({"name": "energy", "model": {"artifact": str(path)}, "inputs": [{"name": "x", "shape": [1, 8]}]})
    return config, build(config)


def test_the_artifact_keeps_its_kernel_and_signature(served):
    _, built = served
    assert len(built.buckets) == 2 and [b.batch_size for b in built.buckets] == [1, 1]
    signature = built.signature()
    assert [(s.name, s.shape) for s in signature.inputs] == [("x", (-1, -1))]  # dynamic batch, bucketed length
    assert [(s.name, s.shape) for s in signature.outputs] == [("output_0", (-1, 1))]


def test_the_runner_pads_each_request_as_the_kernel_does_and_answers_like_eager(served):
    _, built = served
    runner = ModelRunner(built, cores=1)
    try:
        requests = [[torch.rand(1, 5)], [torch.rand(1, 12)], [torch.rand(2, 5)], [torch.rand(1, 16)]]
        results = asyncio.run(runner.infer(requests))
    finally:
        runner.close()
    for (x,), (out,) in zip(requests, results):
        torch.testing.assert_close(out, Energy()(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_the_data_plane_accepts_a_length_5_request(served):
    config, built = served
    x = torch.rand(1, 5)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 5], "data": x.flatten().tolist()}]})

    async def infer():
        plane = ModelDataPlane(config, built, replica="test")
        plane.start()
        try:
            return plane.metadata(), json.loads((await rest_infer(plane, body.encode(), {}))[0])
        finally:
            await plane.stop()

    metadata, response = asyncio.run(infer())
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]
    out = torch.tensor(response["outputs"][0]["data"]).reshape(1, 1)
    torch.testing.assert_close(out, Energy()(x), atol=TOLERANCE, rtol=TOLERANCE)
