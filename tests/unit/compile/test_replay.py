"""A compiled subgraph replays its executable straight through ``_run_cached_graph``
(compile/replay.py) where the dynamo bridge would add nothing, and through the bridge
where it would: outputs equal eager either way."""

import torch
import torch.fx

import neuron_serve
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.targets.pjrt import xla

TOLERANCE = 1e-5


class _Bridge(Exception):
    pass


def _refuse_the_bridge(compiled: CompiledSubgraph, monkeypatch) -> None:
    """Make a call through the bridge's graph fail, so a passing call proves it went direct."""
    def bridge(*args):
        raise _Bridge("called through the dynamo bridge")
    monkeypatch.setattr(compiled._compiled, "forward", bridge)


class _Two(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


class _One(_Two):
    def forward(self, a):
        return self.fn(a)


def _subgraph(fn, *example):
    module = (_One if len(example) == 1 else _Two)(fn)
    return CompiledSubgraph(torch.fx.symbolic_trace(module), list(example))


def test_the_mlp_subgraph_runs_direct_and_equals_eager(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    traced = neuron_serve.trace(model, torch.rand(1, 64))
    compiled = traced.first.graph_module.accel_0
    assert compiled._replay is not None
    _refuse_the_bridge(compiled, monkeypatch)
    for seed in range(3):  # new inputs each call, not the traced ones
        x = torch.rand(1, 64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


def test_several_outputs_come_back_in_the_graphs_order(monkeypatch):
    x, y = torch.rand(3, 5), torch.rand(3, 5)
    compiled = _subgraph(lambda a, b: (a * b, a - b, (a + b).sum(1)), x, y)
    assert compiled._replay is not None
    _refuse_the_bridge(compiled, monkeypatch)
    got = compiled(y, x)
    want = (y * x, y - x, (y + x).sum(1))
    assert len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_tensor_made_inside_the_graph_is_passed_as_the_bridge_passes_it(monkeypatch):
    compiled = _subgraph(lambda a: a * torch.arange(4, dtype=torch.float32) + 1, torch.rand(2, 4))
    assert compiled._replay is not None
    _refuse_the_bridge(compiled, monkeypatch)
    x = torch.rand(2, 4)
    torch.testing.assert_close(compiled(x), x * torch.arange(4, dtype=torch.float32) + 1)


def test_an_output_that_is_an_input_keeps_the_bridge():
    x = torch.rand(2, 3)
    compiled = _subgraph(lambda a, b: (a + b, b), x, x)
    assert compiled._replay is None
    a, b = torch.rand(2, 3), torch.rand(2, 3)
    got = compiled(a, b)
    torch.testing.assert_close(got[0], a + b)
    torch.testing.assert_close(got[1], b)


def test_an_input_with_a_pending_computation_goes_through_the_bridge_and_is_right():
    compiled = _subgraph(lambda a: a * 3, torch.rand(4))
    assert compiled._replay is not None
    x = torch.rand(4)
    pending = x.to(compiled.device) + 1  # not yet computed: the bridge materializes it first
    assert xla()._XLAC._check_tensor_need_materialization([pending]) == [True]
    torch.testing.assert_close(compiled(pending), (x + 1) * 3, atol=TOLERANCE, rtol=TOLERANCE)
