"""Shape buckets: one compiled model per input-shape bucket, one bucket per request.

Two forms share one runtime (:class:`neuron_serve.model.CompiledModel`):

- torch-neuronx's ``BucketModelConfig`` + ``bucket_model_trace``: a user kernel maps
  the inputs to (padded inputs, bucket index);
- the declarative :class:`BucketSpec` (also what model.yaml's ``buckets`` section
  builds): bucket sizes along named input dims, the smallest bucket that fits is
  chosen, inputs are padded with a configured value, outputs unpadded along declared
  dims, and an input larger than the largest bucket is refused, never truncated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError, InvalidInput


@dataclass
class BucketModelConfig:
    """torch-neuronx's bucket configuration; ``bucket_kernel()`` returns the kernel.

    The kernel takes the list of input tensors and returns (padded inputs, bucket
    index tensor). It may be a plain Python function or a ``torch.jit.script`` one.
    """

    bucket_kernel: Callable[[], Callable]
    shared_state_buffer: list[torch.Tensor] | None = None
    shared_state_buffer_preprocessor: Callable[[], Callable] | None = None
    func_kwargs: dict | list[dict] | None = None

    def __init__(self, bucket_kernel, *, shared_state_buffer=None, shared_state_buffer_preprocessor=None, func_kwargs=None):
        if not callable(bucket_kernel):
            raise ConfigError("BucketModelConfig.bucket_kernel must be a function returning the bucket kernel.")
        if shared_state_buffer_preprocessor is not None and shared_state_buffer is None:
            raise ConfigError("BucketModelConfig.shared_state_buffer_preprocessor needs a shared_state_buffer.")
        self.bucket_kernel = bucket_kernel
        self.shared_state_buffer = list(shared_state_buffer) if shared_state_buffer is not None else None
        self.shared_state_buffer_preprocessor = shared_state_buffer_preprocessor
        self.func_kwargs = func_kwargs

    def kwargs_for(self, bucket: int, count: int) -> dict:
        if self.func_kwargs is None:
            return {}
        if isinstance(self.func_kwargs, dict):
            return dict(self.func_kwargs)
        if len(self.func_kwargs) != count:
            raise ConfigError(
                f"BucketModelConfig.func_kwargs has {len(self.func_kwargs)} entries but there are {count} buckets; "
                f"give one dict per bucket, or a single dict for all."
            )
        return dict(self.func_kwargs[bucket])


def as_dims(value: int | Sequence[int]) -> list[int]:
    """A dim (or size) given as "an int or a list of ints", as a list: the one place it is normalised."""
    return [value] if isinstance(value, int) else list(value)


@dataclass
class BucketSpec:
    """Buckets along named input dims, e.g. sequence length 32/64/128.

    ``inputs`` maps an input (position, or name given ``input_names``) to the dim(s) it
    is bucketed along; ``sizes`` lists the buckets (an int per bucket, or one int per
    bucketed dim); ``pad_values`` the value inputs are padded with (default 0);
    ``outputs`` maps an output leaf (its index in the flattened outputs) to the dim(s)
    cut back to the request's size.
    """

    sizes: list[list[int]]
    inputs: dict[int, list[int]]
    pad_values: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        sizes: Sequence[int | Sequence[int]],
        inputs: dict[int | str, int | Sequence[int]],
        *,
        pad_values: dict[int | str, float] | None = None,
        outputs: dict[int, int | Sequence[int]] | None = None,
        input_names: Sequence[str] | None = None,
    ) -> "BucketSpec":
        def index(key: int | str) -> int:
            if isinstance(key, int):
                return key
            if input_names is None or key not in input_names:
                raise ConfigError(f"buckets.inputs: unknown input {key!r}; inputs are {list(input_names or [])}.")
            return list(input_names).index(key)

        rows = [as_dims(s) for s in sizes]
        dims = {index(k): as_dims(v) for k, v in inputs.items()}
        if not rows:
            raise ConfigError("buckets.sizes: give at least one bucket.")
        width = {len(r) for r in rows} | {len(d) for d in dims.values()}
        if len(width) != 1:
            raise ConfigError("buckets: every bucket in 'sizes' needs one size per bucketed dim of each input.")
        if any(s < 1 for r in rows for s in r):
            raise ConfigError(f"buckets.sizes: sizes must be >= 1, got {sizes}.")
        rows = sorted(rows, key=lambda r: (tuple(r)))
        return cls(
            sizes=rows,
            inputs=dims,
            pad_values={index(k): v for k, v in (pad_values or {}).items()},
            outputs={int(k): as_dims(v) for k, v in (outputs or {}).items()},
        )

    def example_inputs(self, example: Sequence[torch.Tensor], bucket: int) -> tuple[torch.Tensor, ...]:
        """The example inputs resized to bucket ``bucket`` (padded or cut), for tracing."""
        resized = list(example)
        for i, dims in self.inputs.items():
            t = resized[i]
            for dim, size in zip(dims, self.sizes[bucket]):
                t = t.narrow(dim, 0, min(size, t.shape[dim]))
                t = _pad(t, dim, size, self.pad_values.get(i, 0))
            resized[i] = t
        return tuple(resized)

    def request_sizes(self, inputs: Sequence[torch.Tensor]) -> list[int]:
        sizes: list[int] | None = None
        for i, dims in self.inputs.items():
            got = [inputs[i].shape[d] for d in dims]
            if sizes is not None and got != sizes:
                raise InvalidInput(f"bucketed inputs disagree on their sizes: input {i} has {got}, expected {sizes}.")
            sizes = got
        return sizes or []

    def choose(self, inputs: Sequence[torch.Tensor]) -> tuple[int, list[int]]:
        sizes = self.request_sizes(inputs)
        for bucket, limits in enumerate(self.sizes):
            if all(s <= limit for s, limit in zip(sizes, limits)):
                return bucket, sizes
        i, dims = next(iter(self.inputs.items()))
        raise InvalidInput(
            f"input {i} has size {sizes} along dim(s) {dims}, larger than the largest bucket {self.sizes[-1]}; "
            f"inputs are never truncated: add a larger bucket or send shorter inputs."
        )

    def kernel(self, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The bucket kernel of this spec, in torch-neuronx's (padded, index) form."""
        bucket, _ = self.choose(inputs)
        padded = list(inputs)
        for i, dims in self.inputs.items():
            for dim, size in zip(dims, self.sizes[bucket]):
                padded[i] = _pad(padded[i], dim, size, self.pad_values.get(i, 0))
        return padded, torch.tensor(bucket)

    def unpad(self, outputs: Any, sizes: list[int]) -> Any:
        if not self.outputs:
            return outputs
        leaves, spec = pytree.tree_flatten(outputs)
        for leaf_index, dims in self.outputs.items():
            for dim, size in zip(dims, sizes):
                leaves[leaf_index] = leaves[leaf_index].narrow(dim, 0, size)
        return pytree.tree_unflatten(leaves, spec)


def _pad(t: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=dim)
