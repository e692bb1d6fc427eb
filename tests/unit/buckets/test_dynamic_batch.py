"""dynamic_batch(): any batch size through a model traced at one batch size."""

import pytest
import torch

import neuron_serve
from example_models import encoder
from reference_models import MLP

TOLERANCE = 1e-5


class Net(torch.nn.Module):
    """The reference's dynamic_batch example."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 3)

    def forward(self, x):
        return self.conv(x) + 1


def test_reference_example_batch_8_through_batch_1_trace():
    net = Net().eval()
    traced = neuron_serve.trace(net, torch.rand(1, 1, 3, 3))
    assert neuron_serve.dynamic_batch(traced) is traced
    batch = torch.rand(8, 1, 3, 3)
    torch.testing.assert_close(traced(batch), net(batch), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("batch", [1, 3, 4, 5, 11])
def test_partitioned_model_any_batch(batch):
    model = MLP(layers=[32, 16]).eval()
    traced = neuron_serve.dynamic_batch(
        neuron_serve.trace(model, torch.rand(4, 784), partitioner_config=neuron_serve.PartitionerConfig())
    )
    assert [p.device for p in traced.partitions] == ["neuron", "cpu"]
    x = torch.rand(batch, 784)
    out = traced(x)
    assert out.shape == (batch, 10)
    torch.testing.assert_close(out, model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_non_batch_dim_change_is_refused_naming_both_shapes():
    traced = neuron_serve.dynamic_batch(neuron_serve.trace(torch.nn.Linear(5, 2), torch.rand(2, 5)))
    traced(torch.rand(3, 5))
    with pytest.raises(ValueError) as info:
        traced(torch.rand(2, 7))
    assert str(info.value) == (
        "input 0 has shape (2, 7); with dynamic batching only dim 0 may differ from the trace-time shape (2, 5)."
    )


def test_inputs_with_different_batch_are_refused():
    model = encoder.build(layers=1, hidden=32, heads=2, vocab=50)
    ids, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.int64)
    traced = neuron_serve.dynamic_batch(neuron_serve.trace(model, (ids, mask)))
    with pytest.raises(ValueError, match="input 1 has dim 0 = 2 but an earlier input has 3"):
        traced(torch.randint(0, 50, (3, 8)), mask)
    ids5, mask5 = torch.randint(0, 50, (5, 8)), torch.ones(5, 8, dtype=torch.int64)
    out, ref = traced(ids5, mask5), model(ids5, mask5)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-4, rtol=1e-4)


def test_models_that_cannot_be_chunked_are_refused_when_enabled():
    class Pair(torch.nn.Module):
        def forward(self, a, b):
            return a.sum(0) + b.sum(0)

    traced = neuron_serve.trace(Pair(), (torch.rand(1, 2), torch.rand(3, 2)))
    with pytest.raises(ValueError, match="dynamic_batch needs the same dim 0 on every input; input 0 has dim 0 = 1, input 1 has dim 0 = 3"):
        neuron_serve.dynamic_batch(traced)

    class Reduce(torch.nn.Module):
        def forward(self, x):
            return x.sum(0)

    traced = neuron_serve.trace(Reduce(), torch.rand(4, 3))
    with pytest.raises(ValueError, match=r"output 0 has shape \(3,\), whose dim 0 is not the batch size 4"):
        neuron_serve.dynamic_batch(traced)
