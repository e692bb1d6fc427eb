"""Capture and compile failures reach the user as one typed error: construct, line, fix."""

import copy
import os

import pytest
import torch

import neuron_serve
from neuron_serve.analysis.capture import capture
from neuron_serve.analysis.explain_failure import compile_error
from neuron_serve.targets.pjrt import xla
from zoo import tv_ssdlite


def test_detector_names_the_data_dependent_branch_and_what_to_do():
    import torchvision.ops.boxes  # noqa: PLC0415

    model, example = tv_ssdlite()
    with pytest.raises(neuron_serve.UnsupportedModelError) as info:
        neuron_serve.trace(model, example, partitioner_config=neuron_serve.PartitionerConfig())
    assert str(info.value) == (
        "torch.export cannot capture the model: Python control flow depends on the input's values at "
        f"boxes.py(97): if boxes.numel() == 0: ({torchvision.ops.boxes.__file__}). The condition "
        "(Eq(4*Min(300, u0) + 4*Min(300, u1), 0)) is a size computed from tensor contents (after an operator such "
        "as nonzero, boolean-mask indexing or a score threshold), so no one graph holds for every input. Rewrite "
        "that branch without Python control flow (torch.cond, or torch._check to state which case holds), or "
        "trace only the part of the model before it and run the rest in eager PyTorch."
    )
    # No traceback from inside torch.export is chained to what the user sees.
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_capture_failure_prints_no_partial_graph(capfd):
    model, example = tv_ssdlite()
    with pytest.raises(neuron_serve.UnsupportedModelError):
        neuron_serve.analyze(model, example)
    assert "def forward" not in capfd.readouterr().err


class PositionEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(16, 4)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        return x + self.table(positions).sum(-1)


def test_compile_failure_names_the_operator_its_line_and_the_fix():
    from torch_xla._dynamo.dynamo_bridge import extract_compiled_graph  # noqa: PLC0415

    x = torch.rand(2, 8)
    gm = capture(PositionEmbedding().eval(), x).gm
    device = xla().device()
    # Without place_on_device the CPU position ids meet the resident weights: torch-xla refuses.
    with pytest.raises(Exception) as raw:
        extract_compiled_graph(copy.deepcopy(gm).to(device), [x.to(device)])
    error = compile_error(raw.value, gm, "accel_0")
    assert isinstance(error, neuron_serve.UnsupportedModelError)
    line = PositionEmbedding.forward.__code__.co_firstlineno + 2
    assert str(error) == (
        f"torch-xla could not compile subgraph accel_0: aten::embedding at test_explain_failure.py({line}): "
        f"return x + self.table(positions).sum(-1) ({os.path.abspath(__file__)}) failed with RuntimeError: "
        "Expected XLA tensor. Got: torch.LongTensor. Run it on CPU: PartitionerConfig(ops_to_partition="
        "{'aten::embedding'})."
    )


class Holder:
    """A result type torch.export does not know how to flatten."""

    def __init__(self, value):
        self.value = value


class ReturnsHolder(torch.nn.Module):
    def forward(self, x):
        return Holder(x * 2)


def test_unknown_output_type_names_the_type_and_how_to_register_it():
    with pytest.raises(neuron_serve.UnsupportedModelError) as info:
        neuron_serve.trace(ReturnsHolder(), torch.rand(2, 3))
    assert str(info.value) == (
        f"torch.export cannot capture the model: ReturnsHolder.forward returns a {Holder.__module__}.Holder, which "
        "it cannot flatten into tensors. Register Holder as a pytree node (torch.utils._pytree.register_pytree_node)"
        ", or return plain tensors, tuples, lists or dicts."
    )
