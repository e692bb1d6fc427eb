"""State tensors resident on a core across calls (torch-neuronx's ``input_output_aliases``).

A :class:`DeviceState` holds the state tensors on the core. A stateful bucket hands
them to its graph after the caller's inputs; its compiled executable reads them and
returns their new values, which stay on the device and are written back over the
state after the call (``_replace_xla_tensor``: the state tensor now holds the output's
buffer, which XLA made the state's own buffer where the executable aliases them). The
same tensor objects thus always hold the current state, and nothing crosses to the
host. Buckets of ``bucket_model_trace`` with ``shared_state_buffer`` share one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..targets import xla_state
from ..targets.pjrt import xla


@dataclass(frozen=True)
class Alias:
    """State slot ``slot`` takes the graph's flat output ``output`` as its new value after each call."""

    slot: int
    output: int


class DeviceState:
    """Named state tensors on one device, updated in place from a compiled executable's outputs."""

    def __init__(self, names: Sequence[str], initial: Sequence[torch.Tensor], device: Any = None) -> None:
        torch_xla = xla()
        self.names = list(names)
        self.device = device if device is not None else torch_xla.device()
        with torch.no_grad(), xla_state.exclusive():
            self.tensors = [t.detach().to(self.device) for t in initial]

    def __len__(self) -> int:
        return len(self.tensors)

    def update(self, slot: int, value: torch.Tensor) -> None:
        """Make state ``slot`` hold ``value`` (an executable's output on this device)."""
        current = self.tensors[slot]
        if value is current:
            return
        with xla_state.exclusive():
            if value.device.type != "xla":  # computed on the host (the trace-time check keeps this from happening)
                value = value.to(self.device)
            xla()._XLAC._replace_xla_tensor(current, value)

    def copy_row(self, src: int, dst: int, count: int | None = None) -> None:
        """Copy index ``src`` of every state tensor's first dimension over index ``dst``, on the device (of the
        first ``count`` tensors only, when given).

        One small executable (compiled once: the indices are its inputs) that updates the
        state in place, so nothing crosses to the host but the two indices. Run it from the
        thread that drives this device.
        """
        torch_xla = xla()
        tensors = self.tensors[:count]
        with torch.no_grad(), xla_state.exclusive():  # its pending graph must not meet a trace's sync or clear
            index = torch.tensor([src, dst], dtype=torch.long).to(self.device)
            for t in tensors:
                t.index_copy_(0, index[1:], t.index_select(0, index[:1]))
            torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)

    def write_row(self, row: int, values: Sequence[torch.Tensor], start: int = 0) -> None:
        """Write ``values`` (host tensors, one per state tensor from ``start`` on, each the shape of one index of
        its first dimension) at index ``row`` of those state tensors, on the device: one small executable, the
        index its input, compiled the first time and replayed after. Run it from the thread that drives this
        device."""
        torch_xla = xla()
        tensors = self.tensors[start:start + len(values)]
        with torch.no_grad(), xla_state.exclusive():
            index = torch.tensor([row], dtype=torch.long).to(self.device)
            for t, value in zip(tensors, values):
                t.index_copy_(0, index, value.to(t.dtype)[None].to(self.device))
            torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)

    def cpu(self) -> list[torch.Tensor]:
        """A host copy of every state tensor (one transfer each; for inspection, not per call)."""
        return [t.cpu() for t in self.tensors]

    def load(self, values: Sequence[torch.Tensor]) -> None:
        """Overwrite the state with ``values`` from the host (same shapes and dtypes), e.g. to reset a cache."""
        if len(values) != len(self.tensors):
            raise ValueError(f"the state has {len(self.tensors)} tensors ({', '.join(self.names)}); got {len(values)}")
        for name, current, value in zip(self.names, self.tensors, values):
            if tuple(value.shape) != tuple(current.shape) or value.dtype != current.dtype:
                raise ValueError(f"state '{name}' has shape {tuple(current.shape)} and dtype {current.dtype}; got "
                                 f"{tuple(value.shape)} and {value.dtype}")
        with torch.no_grad(), xla_state.exclusive():
            for slot, value in enumerate(values):
                self.update(slot, value.detach().to(self.device))

    def to(self, device: Any) -> None:
        """Move the state onto ``device`` (another core), as new tensors there."""
        with torch.no_grad(), xla_state.exclusive():
            self.tensors = [t.cpu().to(device) for t in self.tensors]
        self.device = device
