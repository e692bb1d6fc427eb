"""Weights are transposed once at load, not on every call (compile/passes/fold_weight_layout.py)."""

import copy
import re

import pytest
import torch

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.compile.passes.fold_weight_layout import fold_weight_layout

TOLERANCE = 1e-5


class Layers(torch.nn.Module):
    """A linear with and without bias, a 3-D input, and a weight read twice (tied)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h), h @ self.a.weight  # self.a.weight also read untransposed


def test_every_constant_weight_is_stored_transposed_and_outputs_are_unchanged():
    model = Layers().eval()
    x = torch.rand(2, 3, 8)
    gm = capture(model, x).gm
    folded = fold_weight_layout(copy.deepcopy(gm))
    ops = [n.target for n in folded.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linear.default not in ops
    assert not {torch.ops.aten.t.default, torch.ops.aten.permute.default} & set(ops)
    stored = dict(folded.named_buffers()) | dict(folded.named_parameters())
    # a.weight (16x8) is also read as is, so it is kept beside its transpose; b.weight (8x16) only transposed.
    assert sorted(tuple(t.shape) for t in stored.values() if t.dim() == 2) == [(8, 16), (16, 8), (16, 8)]
    assert "a.weight" in stored and "b.weight" not in stored
    for got, want in zip(folded(x), model(x)):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


def _matrices(hlo: str) -> set[str]:
    """The parameters of ``hlo`` with two dimensions above 1: those a transpose would copy."""
    return {name for name, dims in re.findall(r"(%p\d+\.\d+) = \w+\[([\d,]*)\]\S* parameter", hlo)
            if sum(int(d) > 1 for d in dims.split(",") if d) >= 2}


def test_the_compiled_program_reads_weights_without_transposing_them():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.rand(1, 64)
    traced = neuron_serve.trace(model, x)
    hlo = traced.first.graph_module.accel_0.hlo_text()
    # A transpose whose operand is a weight would run on every call (the one-row input's is free).
    params = _matrices(hlo)
    transposed = re.findall(r"transpose\([^)]*?(%p\d+\.\d+)\)", hlo)
    assert params and not set(transposed) & params
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


# At one row the product is the weight times a column (passes/row_linear.py), which reads the
# weight as nn.Linear stores it.
@pytest.mark.parametrize("rows, stored", [(4, [(64, 32), (32,), (32, 4), (4,)]),
                                          (1, [(32, 64), (32,), (4, 32), (4,)])])
def test_lifted_weights_are_transposed_once_when_loaded_not_per_call(rows, stored):
    # inline_weights_to_neff=False: the weights are inputs of the executable, stored as the products read
    # them on the device when loaded or replaced.
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()

    x = torch.rand(rows, 64)
    traced = neuron_serve.trace(build(0), x, inline_weights_to_neff=False)
    sub = traced.first.graph_module.accel_0
    hlo = sub.hlo_text()
    params = set(re.findall(r"(%p\d+\.\d+) = \S+ parameter", hlo))
    transposed = re.findall(r"transpose\([^)]*?(%p\d+\.\d+)\)", hlo)
    assert len(params) == 5 and not set(transposed) & _matrices(hlo)  # x and four weights, none transposed per call
    assert [tuple(w.shape) for w in sub._weights_on_device] == stored
    torch.testing.assert_close(traced(x), build(0)(x), atol=TOLERANCE, rtol=TOLERANCE)
    neuron_serve.replace_weights(traced, build(1).state_dict())
    torch.testing.assert_close(traced(x), build(1)(x), atol=TOLERANCE, rtol=TOLERANCE)
