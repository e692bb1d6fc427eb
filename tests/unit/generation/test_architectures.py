"""Real architectures and input/output structures trace and match eager PyTorch."""

import pytest
import torch

import neuron_serve
from example_models import convnet, encoder

TOLERANCE = 1e-4


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_transformer_encoder_matches_eager():
    model = encoder.build(layers=2, hidden=64, heads=4, vocab=100)
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 10:] = 0
    traced = neuron_serve.trace(model, (ids, mask))
    assert [p.device for p in traced.partitions] == ["neuron"]
    out, ref = traced(ids, mask), model(ids, mask)
    _close(out.last_hidden_state, ref.last_hidden_state)
    _close(out.pooler_output, ref.pooler_output)


def test_convnet_matches_eager():
    model = convnet.build()
    images = torch.rand(2, 3, 32, 32)
    traced = neuron_serve.trace(model, images)
    assert "aten::conv2d" in traced.partitions[0].op_counts
    _close(traced(images).logits, model(images).logits)


class TwoInTwoOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)
        self.b = torch.nn.Linear(6, 4)

    def forward(self, x, y):
        hx, hy = self.a(x), self.b(y)
        return hx + hy, torch.sort(hx * hy, dim=1).values


class DictOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return {"scores": torch.softmax(h, dim=-1), "nested": (h.sum(dim=1), [h.max(dim=1).values])}


def test_multiple_inputs_and_tuple_outputs_across_partitions():
    model = TwoInTwoOut().eval()
    x, y = torch.rand(3, 8), torch.rand(3, 6)
    traced = neuron_serve.trace(model, (x, y), partitioner_config=neuron_serve.PartitionerConfig())
    assert [p.device for p in traced.partitions] == ["neuron", "cpu"]
    out, ref = traced(x, y), model(x, y)
    assert isinstance(out, tuple) and len(out) == 2
    _close(out, ref)


def test_dict_and_nested_outputs_keep_their_structure():
    model = DictOut().eval()
    x = torch.rand(5, 8)
    out, ref = neuron_serve.trace(model, x)(x), model(x)
    assert set(out) == {"scores", "nested"} and isinstance(out["nested"][1], list)
    _close(out, ref)


def test_plain_function_traces():
    def func(x, y):
        return 2 * x + y

    x, y = torch.rand(3), torch.rand(3)
    _close(neuron_serve.trace(func, (x, y))(x, y), func(x, y))


def test_wrong_shape_is_refused_with_both_shapes():
    traced = neuron_serve.trace(torch.nn.Linear(4, 2), torch.rand(3, 4))
    with pytest.raises(ValueError, match=r"input 0 has shape \(5, 4\).*traced with shape \(3, 4\)"):
        traced(torch.rand(5, 4))
