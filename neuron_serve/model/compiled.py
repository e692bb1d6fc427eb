"""CompiledModel: what every producer returns and every consumer takes.

``trace`` (one bucket), ``trace_buckets``, ``bucket_model_trace`` and ``load`` return
it; ``save``, ``dynamic_batch``, the runtime and the server take it. It carries all a
consumer needs to know about what was compiled: its buckets (each with the batch size
it was compiled for, and the same shape compiled at every other batch size: a grid of
shape bucket x batch size), the bucket kernel that picks one per call (a
:class:`~neuron_serve.buckets.shape.BucketSpec`'s, or the user's, plain or
``torch.jit.script``), whether dynamic batching is on, and its input/output
signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..buckets import batch_sizes, dynamic_batch
from ..buckets.shape import BucketSpec
from ..errors import InvalidInput
from .bucket import Bucket, Partition
from .signature import Signature, TensorSig, merge_shapes, output_names


@dataclass
class BuildInfo:
    """How the model was built, for logs and metrics (set by ``build``)."""

    seconds: float = 0.0
    cache_hits: dict[str, int] = field(default_factory=dict)
    artifact: str | None = None
    compiles: int = 0  # subgraph executables compiled by the build (not counting loads onto cores)
    weights: str | None = None  # the checkpoint swapped in (model.yaml 'weights')


class CompiledModel(torch.nn.Module):
    """A partitioned, compiled model: one or more buckets and the kernel choosing between them.

    Called like the original model with CPU tensors; returns CPU tensors in the
    original output structure. Without a kernel there is one bucket, called directly.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        *,
        kernel: Callable | None = None,
        spec: BucketSpec | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        num_inputs: int | None = None,
        smaller: Sequence[Sequence[Bucket]] | None = None,
    ) -> None:
        super().__init__()
        if not buckets:
            raise ValueError("a compiled model needs at least one bucket")
        self.buckets = torch.nn.ModuleList(buckets)
        # Per shape bucket, the same shape compiled at the smaller batch sizes (the
        # bucket itself holds the largest). A finished build compiles every shape bucket at
        # the same sizes; a model still compiling in the background may hold some sizes of
        # one bucket and not of another. (Buckets of bucket_model_trace may differ in dim 0,
        # each compiled at its one size.)
        self.smaller = torch.nn.ModuleList(torch.nn.ModuleList(s) for s in (smaller or [[] for _ in buckets]))
        if len(self.smaller) != len(self.buckets):
            raise ValueError("a compiled model needs the smaller batch sizes of every bucket, or none")
        # Seconds per call of each compiled size; the runner measures them when it loads,
        # a plain call without them counts rows (the least padding).
        self.costs: dict[int, float] | None = None
        self.spec = spec
        self.kernel = spec.kernel if spec is not None and kernel is None else kernel
        tensors = [i for i, (shape, _) in enumerate(self.buckets[0].input_shapes) if shape is not None]
        # The tensor inputs the caller passes.
        self._tensor_inputs = tensors[:num_inputs] if num_inputs is not None else tensors
        self.num_inputs = len(self._tensor_inputs)
        self.input_names = list(input_names) if input_names else [f"input_{i}" for i in range(self.num_inputs)]
        self.output_names = list(output_names) if output_names else _output_names(self.buckets[0])
        self.build_info = BuildInfo()
        # Pipelined models: copy the pipeline onto every further group of cores (torch's saturate_host).
        self.saturate_host = True

    # -- what was compiled ------------------------------------------------------------

    @property
    def first(self) -> Bucket:
        return self.buckets[0]

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes the shape buckets are compiled at, smallest first: every bucket's when
        they all have the same (a finished build), else any bucket's; the first's when the buckets
        differ in dim 0 (bucket_model_trace's)."""
        if self.spec is None and not any(len(s) for s in self.smaller):
            return [b.batch_size for b in self.grid(0)]
        return sorted({b.batch_size for i in range(len(self.buckets)) for b in self.grid(i)})

    def grid(self, bucket: int) -> list[Bucket]:
        """Shape bucket ``bucket`` at each compiled batch size, smallest first."""
        return sorted([*self.smaller[bucket], self.buckets[bucket]], key=lambda b: b.batch_size)

    @property
    def partitions(self) -> list[Partition] | list[list[Partition]]:
        """A single bucket's partitions; with several buckets, one list per bucket."""
        if self.kernel is None:
            return self.first.partitions
        return [b.partitions for b in self.buckets]

    @property
    def partition_devices(self) -> list[str]:
        """The device of each partition, in execution order (of the first bucket)."""
        return [p.device for p in self.first.partitions]

    @property
    def pipelined(self) -> bool:
        """Traced with placement mode pipeline: its accelerator partitions are stages placed on cores."""
        return any(p.is_stage for p in self.first.partitions)

    @property
    def pipeline_span(self) -> int:
        """Cores one copy of the model spans: 1 when replicated, else the most stages' cores of any compiled shape."""
        return 1 + max(p.core for i in range(len(self.buckets)) for b in self.grid(i) for p in b.partitions)

    @property
    def report(self) -> dict:
        return self.first.report

    def held_weights(self) -> dict[str, Any]:
        """The weights every compiled model takes, by name and device, as held on each (Bucket.held_weights)."""
        return {(name, weight.device): weight for i in range(len(self.buckets)) for b in self.grid(i)
                for name, weight in b.held_weights().items()}

    @property
    def target(self) -> str:
        return self.first.target

    @property
    def stateful(self) -> bool:
        """Whether the model keeps state tensors on the core across calls (input_output_aliases)."""
        return any(b.stateful for i in range(len(self.buckets)) for b in self.grid(i))

    @property
    def states(self) -> list[torch.Tensor]:
        """The state tensors on the core, as torch-neuronx's ``traced.states``: each bucket's, shared ones once.

        They always hold the current state (``.cpu()`` reads one); ``load_states`` overwrites them.
        """
        found: list[torch.Tensor] = []
        for state in self._device_states():
            found.extend(state.tensors)
        return found

    def load_states(self, values: Sequence[torch.Tensor]) -> None:
        """Overwrite the state tensors (in ``states`` order) from the host, e.g. to reset a KV cache."""
        values = list(values)
        if len(values) != len(self.states):
            raise ValueError(f"load_states: the model has {len(self.states)} state tensors; got {len(values)}")
        for state in self._device_states():
            state.load(values[:len(state)])
            values = values[len(state):]

    def copy_state_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` of every state tensor over row ``dst`` (dim 0), on the core (a KV-cache slot move)."""
        for state in self._device_states():
            state.copy_row(src, dst)

    def _device_states(self) -> list:
        seen: list = []
        for bucket in self.buckets:
            if bucket.state is not None and all(bucket.state is not s for s in seen):
                seen.append(bucket.state)
        return seen

    @property
    def dynamic_batch_enabled(self) -> bool:
        return all(b.dynamic_batch_enabled for i in range(len(self.buckets)) for b in self.grid(i))

    def signature(self) -> Signature:
        """Names, shapes (-1 where a dim varies: batch, bucketed dims) and dtypes."""
        batch_dim = [0] if self.dynamic_batch_enabled or len(self.batch_sizes) > 1 else []
        inputs = []
        for i, name in zip(self._tensor_inputs, self.input_names):
            shapes = [b.input_shapes[i][0] for b in self.buckets]
            dims = batch_dim + (self.spec.inputs.get(i, []) if self.spec is not None else [])
            inputs.append(TensorSig(name, merge_shapes(shapes, dims), self.first.input_shapes[i][1]))
        outputs = []
        for i, name in enumerate(self.output_names):
            shapes = [b.output_shapes[i] for b in self.buckets]
            dims = batch_dim + (self.spec.outputs.get(i, []) if self.spec is not None else [])
            if None in shapes:  # not a tensor
                continue
            outputs.append(TensorSig(name, merge_shapes(shapes, dims), self.first.output_dtypes[i] or torch.float32))
        return Signature(tuple(inputs), tuple(outputs))

    def max_row_elements(self) -> int:
        """The most elements one row of any input can hold (in the largest bucket)."""
        return max(
            int(torch.Size(shape[1:]).numel()) for b in self.buckets for shape, _ in b.input_shapes if shape is not None
        )

    # -- running ----------------------------------------------------------------------

    def place(self, inputs: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """The bucket that runs rows ``inputs`` and the inputs it takes (padded).

        Raises InvalidInput when the inputs do not fit that bucket in any dim but dim 0
        (the rows, which the runtime chunks by the bucket's batch size).
        """
        if self.kernel is None:
            dynamic_batch.check_batch(list(inputs), [shape for shape, _ in self.first.input_shapes])
            return 0, list(inputs)
        padded, index = self.kernel(list(inputs))
        bucket = int(index)
        if not 0 <= bucket < len(self.buckets):
            raise InvalidInput(f"the bucket kernel chose bucket {bucket}, but there are {len(self.buckets)}.")
        padded = list(padded)
        dynamic_batch.check_batch(padded, [shape for shape, _ in self.buckets[bucket].input_shapes])
        return bucket, padded

    def unpad(self, outputs: Any, inputs: Sequence[torch.Tensor]) -> Any:
        """Cut the outputs of a padded call back to the request's sizes (declared buckets only)."""
        if self.spec is None:
            return outputs
        return self.spec.unpad(outputs, self.spec.request_sizes(inputs))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.kernel is None:
            if len(self.batch_sizes) == 1:
                return self.first(*args, **kwargs)
            return self.run_sizes(0, self.first.flatten(args, kwargs))
        bucket, padded = self.place(args)
        if len(self.batch_sizes) == 1:
            return self.unpad(self.buckets[bucket](*padded), args)
        return self.unpad(self.run_sizes(bucket, padded), args)

    def run_sizes(self, bucket: int, flat: list[Any]) -> Any:
        """Run rows ``flat`` on shape bucket ``bucket`` as the cheapest compiled sizes (one after another).

        Without dynamic batching a call must have exactly one compiled size's rows.
        """
        grid = {b.batch_size: b for b in self.grid(bucket)}
        shapes = [shape for shape, _ in self.buckets[bucket].input_shapes]
        rows = dynamic_batch.check_batch(flat, shapes)
        if not self.dynamic_batch_enabled:
            if rows not in grid:
                raise InvalidInput(f"the call has {rows} rows; the model is compiled for batch sizes "
                                   f"{sorted(grid)}. Enable dynamic_batch to accept any number of rows.")
            return grid[rows].run_flat(flat)
        costs = self.costs or {size: float(size) for size in grid}
        chunks = batch_sizes.split(flat, rows, batch_sizes.plan(rows, costs))
        return dynamic_batch.join_chunks([grid[size].run_flat(chunk) for size, chunk, _ in chunks], rows)


def _output_names(bucket: Bucket) -> list[str]:
    return output_names(bucket.out_spec)
