"""What a target is: which operators it runs, and what its device is called."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx


@dataclass(frozen=True)
class Decision:
    """Whether one operator runs on the accelerator, and if not, why."""

    supported: bool
    failure_at: str | None = None  # the stage that refused it, as the analyze report names it
    reason: str | None = None

    @classmethod
    def ok(cls) -> "Decision":
        return cls(True)


class Target:
    """Base of the accelerator targets; subclasses add known compiler limits."""

    name: str = ""
    device_label: str = ""  # as torch-neuronx logs it: "Device.NEURON"

    def profile_decision(self, op: str, node: torch.fx.Node) -> Decision | None:
        """A decision from known compiler limits, or None to ask torch-xla."""
        return None

    @property
    def emulated(self) -> bool:
        from .pjrt import emulated  # noqa: PLC0415

        return emulated()
