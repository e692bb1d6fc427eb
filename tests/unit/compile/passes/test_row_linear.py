"""A one-row ``linear`` is computed as the weight times a column on the emulated cores
(compile/passes/row_linear.py)."""

import copy
import re

import torch

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.compile.passes.row_linear import weight_times_column

TOLERANCE = 1e-5
aten = torch.ops.aten


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4, bias=False)).eval()


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_each_one_row_linear_becomes_the_weight_times_a_column():
    model, x = _model(), torch.rand(1, 64)
    gm = copy.deepcopy(capture(model, x).gm)
    assert weight_times_column(gm) == 2
    ops = _ops(gm)
    assert aten.linear.default not in ops
    assert ops.count(aten.mm.default) == 2 and ops.count(aten.t.default) == 4
    assert ops.count(aten.add.Tensor) == 1  # the first layer's bias; the second has none
    out = gm(x)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, model(x),
                               atol=TOLERANCE, rtol=TOLERANCE)


def test_a_linear_of_several_rows_is_left_as_it_is():
    gm = capture(_model(), torch.rand(4, 64)).gm
    before = _ops(gm)
    assert weight_times_column(gm) == 0
    assert _ops(gm) == before


def test_the_compiled_batch_1_model_multiplies_each_weight_by_a_column_and_equals_eager():
    model, x = _model(), torch.rand(1, 64)
    traced = neuron_serve.trace(model, x)
    hlo = traced.first.graph_module.accel_0.hlo_text()
    dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(f32\[([\d,]+)\]", hlo)
    assert dots == [("32,1", "32,64"), ("4,1", "4,32")]  # (result, first operand): weight [N, K] times x [K, 1]
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)
