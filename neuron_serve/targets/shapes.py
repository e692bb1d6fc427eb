"""Reading shapes and dtypes off the fake tensors torch.export leaves on each node."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols


def _vals(node: torch.fx.Node) -> Iterator[object]:
    yield node.meta.get("val")
    for arg in node.all_input_nodes:
        yield arg.meta.get("val")


def node_tensors(node: torch.fx.Node) -> Iterator[torch.Tensor]:
    """Every tensor the node reads or writes, as recorded at export."""
    for val in _vals(node):
        for leaf in pytree.tree_leaves(val):
            if isinstance(leaf, torch.Tensor):
                yield leaf


def node_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    return {t.dtype for t in node_tensors(node)}


def has_data_dependent_shape(node: torch.fx.Node) -> bool:
    """True when a shape involved depends on tensor values (an unbacked symbol)."""
    return any(free_unbacked_symbols(val) for val in _vals(node) if val is not None)
