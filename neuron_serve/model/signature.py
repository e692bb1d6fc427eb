"""A compiled model's input/output signature: names, shapes (-1 where a dim varies), dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError

DYNAMIC = -1  # a dim that varies between calls (the batch, a bucketed dim)


@dataclass(frozen=True)
class TensorSig:
    """One input or output tensor: its name, shape (``-1`` for a dynamic dim) and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def accepts(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` fits (same rank; fixed dims equal)."""
        return len(shape) == len(self.shape) and all(d == DYNAMIC or d == s for d, s in zip(self.shape, shape))

    def describe(self) -> tuple[str, list[int], str]:
        return self.name, list(self.shape), str(self.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]


def merge_shapes(shapes: Sequence[Sequence[int]], dynamic_dims: Sequence[int] = ()) -> tuple[int, ...]:
    """One shape for several compiled ones: a dim that differs, or is in ``dynamic_dims``, is -1."""
    first = tuple(shapes[0])
    merged = [d if all(len(s) == len(first) and s[i] == d for s in shapes) else DYNAMIC for i, d in enumerate(first)]
    for dim in dynamic_dims:
        if dim < len(merged):
            merged[dim] = DYNAMIC
    return tuple(merged)


def output_names(out_spec: pytree.TreeSpec, configured: Sequence[str] | None = None) -> list[str]:
    """Names of the flattened outputs: ``configured``, else the model's own keys."""
    paths = list(_leaf_paths(out_spec))
    if configured is not None:
        if len(configured) != len(paths):
            raise ConfigError(f"outputs: the model has {len(paths)} outputs {paths}, but {len(configured)} names are given.")
        return list(configured)
    names = []
    for i, path in enumerate(paths):
        name = path.strip(".[]'\"").replace("'][", ".").replace("][", ".")
        names.append(name if name and not name.isdigit() else f"output_{i}")
    return names


def _leaf_paths(spec: pytree.TreeSpec, prefix: str = ""):
    """The key path of every leaf, read from the spec alone.

    Unflattening placeholders into the spec would build the output types themselves,
    and some cannot hold placeholders (transformers' DynamicCache calls methods on
    its tensors), so the keys come from each node's context: its keys where it has
    one per child (dicts, ModelOutput), else the child's position.
    """
    if spec.is_leaf():
        yield prefix
        return
    children = spec.children_specs
    context = spec.context
    keyed = isinstance(context, (list, tuple)) and len(context) == len(children) and all(
        isinstance(k, str) for k in context
    )
    for i, child in enumerate(children):
        key = f"['{context[i]}']" if keyed else f"[{i}]"
        yield from _leaf_paths(child, prefix + key)
