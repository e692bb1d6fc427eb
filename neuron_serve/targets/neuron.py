"""The `neuron` target: torch-xla evidence plus the Neuron operator-support profile."""

from __future__ import annotations

from importlib import resources

import torch
import torch.fx
import yaml

from .base import Decision, Target
from .shapes import has_data_dependent_shape, node_dtypes

_DTYPE_NAMES = {"complex64": torch.complex64, "complex128": torch.complex128, "float64": torch.float64}


def load_profile(name: str = "neuron") -> dict:
    text = resources.files(__package__).joinpath("profiles", f"{name}.yaml").read_text()
    return yaml.safe_load(text)


class NeuronTarget(Target):
    name = "neuron"
    device_label = "Device.NEURON"
    failure_stage = "neuronx-cc"

    def __init__(self) -> None:
        profile = load_profile()
        self.unsupported_ops = {e["op"]: e["reason"] for e in profile["unsupported_ops"]}
        self.unsupported_dtypes = {_DTYPE_NAMES[e["dtype"]]: e["reason"] for e in profile["unsupported_dtypes"]}
        self.data_dependent_ops = {e["op"] for e in profile["data_dependent_ops"]}

    def profile_decision(self, op: str, node: torch.fx.Node) -> Decision | None:
        if op in self.unsupported_ops:
            return Decision(False, self.failure_stage, self.unsupported_ops[op])
        for dtype in node_dtypes(node):
            if dtype in self.unsupported_dtypes:
                return Decision(False, self.failure_stage, f"{self.unsupported_dtypes[dtype]} ({dtype})")
        if op in self.data_dependent_ops or has_data_dependent_shape(node):
            return Decision(
                False, self.failure_stage, "output shape depends on input values; compiled graphs need fixed shapes"
            )
        return None
