"""TracedModule: the partitioned, compiled model that trace() returns."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import batching
from .errors import InvalidInput
from .partition.plan import Partition


class TracedModule(torch.nn.Module):
    """Runs accelerator subgraphs compiled through torch-xla and CPU subgraphs in torch.

    Called like the original model with CPU tensors; returns CPU tensors in the
    original output structure. ``partitions`` lists each subgraph with its device and
    operator counts; ``report`` is the analyze report of the model.
    """

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        *,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        input_shapes: list[tuple[torch.Size | None, torch.dtype | None]],
        output_shapes: list[torch.Size | None],
        partitions: list[Partition],
        report: dict,
        target: str,
    ) -> None:
        super().__init__()
        self.graph_module = graph
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.input_shapes = input_shapes
        self.output_shapes = output_shapes
        self.dynamic_batch_enabled = False
        self.batch_size: int | None = None
        # How dynamic-batch chunks are run; the serving runtime spreads them over cores.
        self.map_chunks = None
        self.partitions = partitions
        self.report = report
        self.target = target
        # (shape, dtype) of each partition's inputs at trace time; save() re-exports with them.
        self.stage_inputs: dict[str, list[tuple[tuple[int, ...], torch.dtype] | None]] = {}

    @property
    def partition_devices(self) -> list[str]:
        return [p.device for p in self.partitions]

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
            return batching.run_dynamic(self.run_flat, flat, shapes, self.batch_size, self.map_chunks)
        self.check_shapes(flat)
        return self.run_flat(flat)

    def run_flat(self, flat: list[Any]) -> Any:
        with torch.no_grad():
            outputs = self.graph_module(*flat)
        return pytree.tree_unflatten(list(outputs), self.out_spec)
