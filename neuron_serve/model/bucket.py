"""One bucket of a compiled model: the partitioned graph compiled at one input shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..buckets import dynamic_batch
from ..errors import InvalidInput
from ..targets import xla_state
from . import graph
from .state import Alias, DeviceState

Shape = tuple[int, ...]


@dataclass
class Partition:
    """One subgraph of the top graph, as the planner made it."""

    index: int  # 1-based, in execution order, as the log numbers them
    name: str  # submodule name in the split graph
    device: str  # the target's name, or "cpu"
    device_label: str  # "Device.NEURON" / "Device.CPU"
    op_counts: dict[str, int]
    # Pipelined models: the core (within one pipeline copy) that runs this stage, the memory
    # the stage holds there and the activation bytes arriving from before it.
    core: int = 0
    memory_bytes: int | None = None
    bytes_in: int | None = None

    @property
    def size(self) -> int:
        return sum(self.op_counts.values())

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def is_stage(self) -> bool:
        """A stage of a pipelined model (placed by memory on a core of its pipeline)."""
        return self.memory_bytes is not None

    def describe(self) -> dict:
        described = {"index": self.index, "device": self.device, "op_counts": dict(self.op_counts), "size": self.size}
        if self.is_stage:
            described.update(core=self.core, memory_bytes=self.memory_bytes, bytes_in=self.bytes_in)
        return described


def leading_dim(shapes: list[torch.Size | None]) -> int:
    """Rows per call of a graph traced on ``shapes``: dim 0 of its first tensor input (1 for scalars)."""
    for shape in shapes:
        if shape is not None:
            return shape[0] if len(shape) else 1
    return 1


class Bucket(torch.nn.Module):
    """Runs accelerator subgraphs compiled through torch-xla and CPU subgraphs in torch.

    Called with the flattened inputs' structure it was traced with (CPU tensors);
    returns CPU tensors in the original output structure.
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        *,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        input_shapes: list[tuple[torch.Size | None, torch.dtype | None]],
        output_shapes: list[torch.Size | None],
        output_dtypes: list[torch.dtype | None] | None = None,
        partitions: list[Partition],
        report: dict,
        target: str,
        stage_inputs: dict[str, list[tuple[Shape, torch.dtype] | None]] | None = None,
        batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.graph_module = graph_module
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.input_shapes = input_shapes
        self.output_shapes = output_shapes
        self.output_dtypes = output_dtypes or [None] * len(output_shapes)
        self.partitions = partitions
        self.report = report
        self.target = target
        # (shape, dtype) of each partition's inputs at trace time; save() re-exports with them.
        self.stage_inputs = stage_inputs or {}
        # Rows one compiled call takes: the chunk size of dynamic batching and of serving.
        self.batch_size = batch_size if batch_size is not None else leading_dim([s for s, _ in input_shapes])
        self.dynamic_batch_enabled = False
        # input_output_aliases: state tensors on the core, passed after the inputs and
        # updated from the outputs ``aliases`` name after every call (see model/state.py).
        self.state: DeviceState | None = None
        self.aliases: list[Alias] = []
        # What compiling it kept of host memory (its code and bookkeeping; assembly/host_memory.kept), when measured.
        self.host_bytes: int | None = None

    @property
    def stateful(self) -> bool:
        return self.state is not None

    def held_weights(self) -> dict[str, Any]:
        """The weights its executables take as inputs, by name, as held on their device (compile/core_weights.py:
        one tensor a core, shared by every compiled model that takes it); none when they are compiled in."""
        held: dict[str, Any] = {}
        for module in self.graph_module.children():
            held.update(getattr(module, "held_weights", None) or {})
        return held

    def flatten(self, args: tuple, kwargs: dict) -> list[Any]:
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise InvalidInput(
                f"inputs do not have the structure the model was traced with: expected {self.in_spec}, got {spec}"
            )
        return flat

    def check_shapes(self, flat: list[Any]) -> None:
        for i, (value, (shape, dtype)) in enumerate(zip(flat, self.input_shapes)):
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            if value.shape != shape or value.dtype != dtype:
                raise InvalidInput(
                    f"input {i} has shape {tuple(value.shape)} and dtype {value.dtype}; the model was "
                    f"traced with shape {tuple(shape)} and dtype {dtype}. Trace with buckets or enable "
                    f"dynamic_batch to accept other shapes."
                )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.flatten(args, kwargs)
        if self.dynamic_batch_enabled:
            shapes = [shape for shape, _ in self.input_shapes]
            return dynamic_batch.run_dynamic(self.run_flat, flat, shapes, self.batch_size)
        self.check_shapes(flat)
        return self.run_flat(flat)

    def run_flat(self, flat: list[Any]) -> Any:
        call = graph.call_submodule(self.graph_module)
        with torch.no_grad():
            if self.state is None:
                outputs = graph.run(self.graph_module, flat, call)
            else:
                # From the call that donates the state's buffers to the update that replaces them, the state
                # tensors hold no data: no other XLA work (a trace's sync sees every live tensor) may run between.
                with xla_state.exclusive():
                    outputs = graph.run(self.graph_module, [*flat, *self.state.tensors], call)
                    for alias in self.aliases:
                        self.state.update(alias.slot, outputs[alias.output])
                        # As torch-neuronx: the aliased output is the state itself, on the core.
                        outputs[alias.output] = self.state.tensors[alias.slot]
        return pytree.tree_unflatten(outputs, self.out_spec)
