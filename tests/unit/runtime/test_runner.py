"""ModelRunner: takes a built model and learns its chunking and bucket choice from it."""

import asyncio

import pytest
import torch

from neuron_serve.errors import InvalidInput
from neuron_serve.runtime.runner import ModelRunner

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def runner(built):
    runner = ModelRunner(built, cores=1, name="scores")
    yield runner
    runner.close()


def test_requests_of_any_row_count_are_chunked_by_the_compiled_batch_size(runner, eager):
    assert runner.model.first.batch_size == 4
    requests = [[torch.rand(rows, 8)] for rows in (1, 3, 4, 9)]
    results = asyncio.run(runner.infer(requests))
    for (x,), (out,) in zip(requests, results):
        assert out.shape == (x.shape[0], 4)
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert [p["device"] for p in runner.partitions] == ["neuron", "cpu"]


def test_a_request_that_cannot_run_gets_its_error_and_the_others_their_results(runner, eager):
    good = torch.rand(2, 8)
    results = asyncio.run(runner.infer([[good], [torch.rand(2, 5)]]))
    torch.testing.assert_close(results[0][0], eager(good), atol=TOLERANCE, rtol=TOLERANCE)
    assert isinstance(results[1], InvalidInput)
    assert str(results[1]) == ("input 0 has shape (2, 5); with dynamic batching only dim 0 may differ from the "
                               "trace-time shape (4, 8).")
