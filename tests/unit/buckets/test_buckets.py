"""bucket_model_trace (torch-neuronx's form) and declarative sequence buckets."""

from typing import List, Tuple

import pytest
import torch

import neuron_serve
from example_models import encoder

TOLERANCE = 1e-4


class Doubler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * 2


def _model_fn():
    torch.manual_seed(1)
    return Doubler().eval(), {}


@torch.jit.script
def _script_kernel(inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    x = inputs[0]
    if x.shape[0] <= 2:
        return [torch.nn.functional.pad(x, [0, 0, 0, 2 - x.shape[0]])], torch.tensor(0)
    return [torch.nn.functional.pad(x, [0, 0, 0, 8 - x.shape[0]])], torch.tensor(1)


def _python_kernel(inputs):
    x = inputs[0]
    size = 2 if x.shape[0] <= 2 else 8
    return [torch.cat([x, x.new_zeros(size - x.shape[0], 4)])], torch.tensor(0 if size == 2 else 1)


@pytest.mark.parametrize("kernel", [_script_kernel, _python_kernel], ids=["torchscript", "python"])
def test_bucket_model_trace_picks_a_bucket_per_call(kernel):
    config = neuron_serve.BucketModelConfig(lambda: kernel)
    bucketed = neuron_serve.bucket_model_trace(_model_fn, [torch.rand(2, 4), torch.rand(8, 4)], config)
    reference, _ = _model_fn()
    assert len(bucketed.buckets) == 2
    for rows in (1, 2, 5, 8):
        x = torch.rand(rows, 4)
        out = bucketed(x)
        assert out.shape[0] == (2 if rows <= 2 else 8)
        torch.testing.assert_close(out[:rows], reference(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_func_kwargs_per_bucket_must_match_bucket_count():
    config = neuron_serve.BucketModelConfig(lambda: _python_kernel, func_kwargs=[{}])
    with pytest.raises(ValueError, match="func_kwargs has 1 entries but there are 2 buckets"):
        neuron_serve.bucket_model_trace(_model_fn, [torch.rand(2, 4), torch.rand(8, 4)], config)


def _encoder_spec():
    return neuron_serve.BucketSpec.build(
        sizes=[16, 32],
        inputs={"input_ids": 1, "attention_mask": 1},
        outputs={0: 1},  # last_hidden_state: cut back to the request's length
        input_names=["input_ids", "attention_mask"],
    )


def test_sequence_buckets_with_partitioning_and_dynamic_batch_on_an_encoder():
    model = encoder.build(layers=2, hidden=32, heads=2, vocab=64)
    example = (torch.randint(0, 64, (2, 16)), torch.ones(2, 16, dtype=torch.int64))
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::gelu"})
    bucketed = neuron_serve.dynamic_batch(
        neuron_serve.trace_buckets(model, example, _encoder_spec(), partitioner_config=config)
    )
    assert [len(b.partitions) for b in bucketed.buckets] == [5, 5]  # gelu on CPU in each of 2 layers
    for batch, length in [(1, 5), (3, 16), (5, 17), (2, 32)]:
        ids = torch.randint(0, 64, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.int64)
        out, ref = bucketed(ids, mask), model(ids, mask)
        assert out.last_hidden_state.shape == (batch, length, 32)
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, atol=TOLERANCE, rtol=TOLERANCE)


def test_input_longer_than_largest_bucket_is_refused():
    model = encoder.build(layers=1, hidden=32, heads=2, vocab=64)
    example = (torch.randint(0, 64, (1, 16)), torch.ones(1, 16, dtype=torch.int64))
    bucketed = neuron_serve.trace_buckets(model, example, _encoder_spec())
    with pytest.raises(ValueError, match=r"input 0 has size \[40\] along dim\(s\) \[1\], larger than the largest bucket \[32\]; inputs are never truncated"):
        bucketed(torch.zeros(1, 40, dtype=torch.int64), torch.ones(1, 40, dtype=torch.int64))


def test_bucket_spec_validation():
    with pytest.raises(ValueError, match="unknown input 'ids'"):
        neuron_serve.BucketSpec.build(sizes=[8], inputs={"ids": 1}, input_names=["input_ids"])
    with pytest.raises(ValueError, match="one size per bucketed dim"):
        neuron_serve.BucketSpec.build(sizes=[[8, 8]], inputs={0: 1})
