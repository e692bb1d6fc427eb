"""A batch-1 product's addend is subtracted negated, so XLA:CPU keeps the product a library call
(compile/passes/matvec_addend.py)."""

import copy
import re

import torch

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.compile.passes.matvec_addend import subtract_matvec_addends

TOLERANCE = 1e-5
aten = torch.ops.aten


class ThreeForms(torch.nn.Module):
    """A bias reaches a product as ``linear``'s bias, ``addmm``'s input and a plain ``+``."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.w = torch.nn.Parameter(torch.rand(16, 4))
        self.c = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        h = torch.relu(self.a(x))
        return torch.addmm(self.c, h, self.w), self.c + h @ self.w, h + h  # the last adds no product


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_each_addend_of_a_batch_1_product_becomes_a_negated_subtrahend():
    model = ThreeForms().eval()
    x = torch.rand(1, 8)
    gm = capture(model, x).gm
    rewritten = copy.deepcopy(gm)
    assert subtract_matvec_addends(rewritten) == 3
    ops = _ops(rewritten)
    assert aten.addmm.default not in ops
    assert ops.count(aten.sub.Tensor) == 3 and ops.count(aten.neg.default) == 3
    assert ops.count(aten.add.Tensor) == 1  # h + h stays
    assert all(len(n.args) == 2 for n in rewritten.graph.nodes if n.target is aten.linear.default)  # no bias left
    for got, want in zip(rewritten(x), model(x)):
        torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


def test_products_of_several_rows_are_left_as_they_are():
    gm = capture(ThreeForms().eval(), torch.rand(4, 8)).gm
    before = _ops(gm)
    assert subtract_matvec_addends(gm) == 0
    assert _ops(gm) == before


def _biases_subtracted(hlo: str) -> int:
    """How many of ``hlo``'s dots have their bias subtracted; asserts that none has it added.

    A dot counts through a transpose or reshape of it (a one-row ``linear`` is computed as
    the weight times a column, compile/passes/row_linear.py)."""
    dots = set(re.findall(r"(%dot\.\d+) = ", hlo))
    for name, operand in re.findall(r"(%(?:transpose|reshape|bitcast)\.\d+) = \S+ \w+\((?:\S+ )?(%[\w.]+)\)", hlo):
        if operand in dots:
            dots.add(name)
    def taking_a_dot(op):
        return [operands for operands in re.findall(rf"= \S+ {op}\(([^)]*)\)", hlo)
                if set(re.findall(r"%[\w.]+", operands)) & dots]
    assert not taking_a_dot("add")
    return len(taking_a_dot("subtract"))


def test_the_compiled_batch_1_mlp_subtracts_its_biases_and_equals_eager():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.rand(1, 64)
    traced = neuron_serve.trace(model, x)
    hlo = traced.first.graph_module.accel_0.hlo_text()
    assert _biases_subtracted(hlo) == 2
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_lifted_biases_are_subtracted_too_and_replaced_weights_still_apply():
    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()

    x = torch.rand(1, 64)
    traced = neuron_serve.trace(build(0), x, inline_weights_to_neff=False)
    assert _biases_subtracted(traced.first.graph_module.accel_0.hlo_text()) == 2
    torch.testing.assert_close(traced(x), build(0)(x), atol=TOLERANCE, rtol=TOLERANCE)
    neuron_serve.replace_weights(traced, build(1).state_dict())
    torch.testing.assert_close(traced(x), build(1)(x), atol=TOLERANCE, rtol=TOLERANCE)
