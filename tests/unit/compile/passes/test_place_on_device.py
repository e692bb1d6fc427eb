"""Tensors a graph creates or captures live where its subgraph runs (compile/passes/place_on_device.py)."""

import copy

import pytest
import torch

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.compile.passes.place_on_device import place_on_device
from zoo import gpt2

TOLERANCE = 1e-5


class MakesTensors(torch.nn.Module):
    """Every way a forward() creates or captures a tensor of its own."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device="cpu").float()
        offset = torch.zeros(x.shape, device=torch.device("cpu")) + torch.ones(8) + torch.full((8,), 2.0)
        literal = torch.tensor([1.0, -1.0] * 4)  # lifted as a constant attribute
        fresh = x.new_ones(x.shape) * torch.scalar_tensor(3.0)
        moved = self.proj(x).to("cpu")
        return moved * self.scale + positions + offset + literal + fresh


def _placements(gm):
    return {str(n.kwargs.get("device")) for n in gm.graph.nodes if n.op == "call_function" and "device" in n.kwargs}


def test_pass_moves_factories_constants_and_buffers_to_the_device():
    model = MakesTensors().eval()
    x = torch.rand(2, 8)
    gm = capture(model, x).gm
    assert "cpu" in _placements(gm)
    # On the meta device no tensor is ever allocated, so a leftover CPU tensor raises.
    with pytest.raises(RuntimeError):
        copy.deepcopy(gm).to("meta")(x.to("meta"))
    moved = place_on_device(copy.deepcopy(gm), "meta").to("meta")
    assert _placements(moved) == {"meta"}
    (out,) = moved(x.to("meta"))
    assert out.device.type == "meta" and out.shape == (2, 8)
    assert _placements(gm) != {"meta"}  # the source graph is left as it was


def test_module_creating_tensors_traces_onto_the_core_and_matches_eager():
    model = MakesTensors().eval()
    x = torch.rand(2, 8)
    traced = neuron_serve.trace(model, x)
    assert [p.device for p in traced.partitions] == ["neuron"]
    ops = traced.partitions[0].op_counts
    assert {"aten::arange", "aten::zeros", "aten::full", "aten::new_ones", "aten::scalar_tensor"} <= set(ops)
    torch.testing.assert_close(traced(x), model(x), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.fixture(scope="module")
def gpt2_traced():
    torch.manual_seed(0)
    model, (ids,) = gpt2()
    return model, ids, neuron_serve.trace(model, ids, partitioner_config=neuron_serve.PartitionerConfig())


def test_gpt2_position_ids_made_in_forward_run_on_the_core(gpt2_traced):
    model, ids, traced = gpt2_traced
    assert [p.device for p in traced.partitions] == ["neuron"]
    assert traced.partitions[0].op_counts["aten::arange"] >= 1
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    torch.testing.assert_close(traced(ids).last_hidden_state, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_gpt2_subgraph_loaded_again_matches(gpt2_traced):
    model, ids, traced = gpt2_traced
    compiled = traced.first.graph_module.get_submodule(traced.partitions[0].name)
    again = compiled.load_to(compiled.device)  # the path every further core takes
    (hidden,) = again(ids) if compiled._tuple_out else (again(ids),)
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    torch.testing.assert_close(hidden, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_gpt2_artifact_round_trip(gpt2_traced, tmp_path):
    model, ids, traced = gpt2_traced
    neuron_serve.save(traced, tmp_path / "gpt2")
    loaded = neuron_serve.load(tmp_path / "gpt2")
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    torch.testing.assert_close(loaded(ids).last_hidden_state, expected, atol=TOLERANCE, rtol=TOLERANCE)
