"""Weight-separated models: trace(inline_weights_to_neff=False), replace_weights, move_trace_to_device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import neuron_serve
from neuron_serve.compile.subgraph import compile_count

ATOL = 1e-5  # XLA:CPU and eager float32 kernels differ only in summation order


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.rand(3) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def separated():
    return neuron_serve.trace(Net(0).eval(), X, inline_weights_to_neff=False)


@pytest.fixture(scope="module")
def inline():
    return neuron_serve.trace(Net(0).eval(), X)


def test_separated_trace_matches_eager_and_keeps_weights_out_of_the_executable(separated, inline):
    torch.testing.assert_close(separated(X), Net(0).eval()(X), atol=ATOL, rtol=0)
    sub = separated.first.graph_module.get_submodule("accel_0")
    # The compiled graph takes x and then the five weights as inputs; it holds no weight itself.
    assert [n.target for n in sub.source.graph.nodes if n.op == "placeholder"] == [
        "x", "w_a_weight", "w_a_bias", "w_b_weight", "w_b_bias", "w_scale"]
    assert not [n for n in sub.source.graph.nodes if n.op == "get_attr"]
    assert list(sub.weights) == ["a.weight", "a.bias", "b.weight", "b.bias", "scale"]
    inline_sub = inline.first.graph_module.get_submodule("accel_0")
    assert len([n for n in inline_sub.source.graph.nodes if n.op == "get_attr"]) == 5


def test_replace_weights_swaps_checkpoint_without_compiling(separated):
    second = Net(1).eval()
    before = compile_count()
    neuron_serve.replace_weights(separated, second.state_dict())
    try:
        assert compile_count() == before
        torch.testing.assert_close(separated(X), second(X), atol=ATOL, rtol=0)
        assert not torch.allclose(second(X), Net(0).eval()(X), atol=1e-3)  # the swap is visible
        assert compile_count() == before
    finally:
        neuron_serve.replace_weights(separated, Net(0).eval().state_dict())


def test_replace_weights_updates_cpu_partitions_too():
    # mul by the scale buffer on CPU: a CPU partition holding a weight
    config = neuron_serve.PartitionerConfig(ops_to_partition={"aten::relu", "aten::mul"})
    traced = neuron_serve.trace(Net(0).eval(), X, partitioner_config=config, inline_weights_to_neff=False)
    assert [dict(traced.first.graph_module.get_submodule(p.name).named_buffers()).keys() for p in traced.partitions
            if p.on_cpu] == [set(), {"scale"}]
    second = Net(2).eval()
    before = compile_count()
    neuron_serve.replace_weights(traced, second.state_dict())
    assert compile_count() == before
    torch.testing.assert_close(traced(X), second(X), atol=ATOL, rtol=0)


def test_replace_weights_refuses_wrong_names_shapes_dtypes(separated):
    good = Net(1).eval().state_dict()
    missing = {k: v for k, v in good.items() if k != "a.bias"}
    with pytest.raises(neuron_serve.ConfigError) as err:
        neuron_serve.replace_weights(separated, missing)
    assert str(err.value) == ("replace_weights: the state dict does not match the traced model: missing weight(s) "
                              "a.bias. It must hold exactly the weights of the traced architecture.")
    with pytest.raises(neuron_serve.ConfigError) as err:
        neuron_serve.replace_weights(separated, {**good, "c.weight": torch.zeros(1)})
    assert str(err.value) == ("replace_weights: the state dict does not match the traced model: unexpected weight(s) "
                              "c.weight. It must hold exactly the weights of the traced architecture.")
    with pytest.raises(neuron_serve.ConfigError) as err:
        neuron_serve.replace_weights(separated, {**good, "b.weight": torch.zeros(3, 9)})
    assert str(err.value) == "replace_weights: weight 'b.weight' has shape (3, 9); the traced model has (3, 8)."
    with pytest.raises(neuron_serve.ConfigError) as err:
        neuron_serve.replace_weights(separated, {**good, "scale": good["scale"].half()})
    assert str(err.value) == "replace_weights: weight 'scale' has dtype torch.float16; the traced model has torch.float32."
    # A refused state dict leaves the model's weights as they were.
    torch.testing.assert_close(separated(X), Net(0).eval()(X), atol=ATOL, rtol=0)


class Tied(torch.nn.Module):
    """An embedding shared with the output layer, as GPT-2's LM head is."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_replace_weights_takes_a_state_dict_with_tied_weights(tmp_path):
    ids = torch.tensor([[1, 2, 3]])
    traced = neuron_serve.trace(Tied(0).eval(), ids, inline_weights_to_neff=False)
    # The traced graph sees the shared tensor once; the state dict names it twice, one storage.
    torch.save(Tied(1).state_dict(), tmp_path / "tied.pt")
    neuron_serve.replace_weights(traced, torch.load(tmp_path / "tied.pt", weights_only=True))
    torch.testing.assert_close(traced(ids), Tied(1).eval()(ids), atol=ATOL, rtol=0)
    untied = {k: v.clone() for k, v in Tied(1).state_dict().items()}
    with pytest.raises(neuron_serve.ConfigError, match=r"unexpected weight\(s\) (embed|head)\.weight"):
        neuron_serve.replace_weights(traced, untied)


def test_replace_weights_refuses_inline_model(inline):
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            "replace_weights: this model's weights are compiled into its executable; trace it with "
            "neuron_serve.trace(..., inline_weights_to_neff=False) to replace weights.")):
        neuron_serve.replace_weights(inline, Net(1).state_dict())


def test_inline_weights_to_neff_must_be_bool():
    with pytest.raises(neuron_serve.ConfigError, match=re.escape(
            "trace(inline_weights_to_neff=...) must be True or False, got 'no'.")):
        neuron_serve.trace(Net(0).eval(), X, inline_weights_to_neff="no")


def test_move_trace_to_device(separated):
    neuron_serve.move_trace_to_device(separated, 0)
    sub = separated.first.graph_module.get_submodule("accel_0")
    assert str(sub.device) == "xla:0"
    torch.testing.assert_close(separated(X), Net(0).eval()(X), atol=ATOL, rtol=0)
    with pytest.raises(neuron_serve.ConfigError, match=r"move_trace_to_device: device_id must be a NeuronCore index "
                                                       r"from 0 to \d+, got 99\."):
        neuron_serve.move_trace_to_device(separated, 99)


def test_move_trace_to_another_core_then_replace_weights():
    # A second emulated core needs its own process (the device count is fixed at PJRT start-up).
    script = textwrap.dedent("""
        import torch, neuron_serve
        from neuron_serve.compile.subgraph import compile_count
        from tests.unit.test_weights import Net, X
        traced = neuron_serve.trace(Net(0).eval(), X, inline_weights_to_neff=False)
        neuron_serve.move_trace_to_device(traced, 1)
        sub = traced.first.graph_module.get_submodule("accel_0")
        print(sub.device, sorted({str(w.device) for w in sub._weights_on_device}))
        torch.testing.assert_close(traced(X), Net(0).eval()(X), atol=1e-5, rtol=0)
        before = compile_count()
        neuron_serve.replace_weights(traced, Net(3).eval().state_dict())
        torch.testing.assert_close(traced(X), Net(3).eval()(X), atol=1e-5, rtol=0)
        print(compile_count() - before, sorted({str(w.device) for w in sub._weights_on_device}))
    """)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2:] == ["xla:1 ['xla:1']", "0 ['xla:1']"]
