"""Capture a model as one flat ATen graph with torch.export.

The graph keeps torch.export's pre-dispatch ATen operators (aten::linear,
aten::log_softmax, ...), the level torch-neuronx reports at, rather than the core-ATen
decomposition. Parameters become get_attr nodes, user inputs and outputs are flat,
and the pytree specs restore the caller's structure (tuples, dicts, model outputs).
"""

from __future__ import annotations

import contextlib
import io
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from .explain_failure import capture_error

# Nodes that are bookkeeping, not arithmetic: the reference counts neither them nor
# getitem when it reports "N of M arithmetic operations".
_NON_COMPUTE_TARGETS = {
    operator.getitem,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


@dataclass
class CapturedGraph:
    """A flat GraphModule plus what it takes to call it like the original model."""

    gm: torch.fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    flat_inputs: list[torch.Tensor]


class _FunctionModule(torch.nn.Module):
    """Lets a plain function be exported like a module."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def as_args(example_inputs: Any) -> tuple:
    """torch-neuronx accepts a tensor or a tuple of tensors as example_inputs."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def is_compute_node(node: torch.fx.Node) -> bool:
    """True for the nodes counted as arithmetic operations."""
    return node.op == "call_function" and node.target not in _NON_COMPUTE_TARGETS


def op_name(node: torch.fx.Node) -> str:
    """'aten::linear' for aten.linear.default; the name torch-neuronx prints."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(node.target, "__name__", str(node.target))


@contextlib.contextmanager
def _quiet_failures():
    """Hold back what export writes to stderr; replay it unless export fails.

    On failure torch.export prints the whole partial graph (thousands of lines) to
    stderr before raising; the error raised instead names the construct and its line.
    """
    held = io.StringIO()
    with contextlib.redirect_stderr(held):
        yield
    sys.stderr.write(held.getvalue())


def capture(func: Callable, example_inputs: Any, example_kwargs: dict | None = None) -> CapturedGraph:
    """Export ``func`` on ``example_inputs`` into a :class:`CapturedGraph`."""
    module = func if isinstance(func, torch.nn.Module) else _FunctionModule(func)
    args = as_args(example_inputs)
    try:
        with torch.no_grad(), _quiet_failures():
            exported = torch.export.export(module, args, kwargs=example_kwargs, strict=False)
    except Exception as exc:  # torch raises many types; the user needs the construct and its line
        raise capture_error(exc, module) from None
    gm = exported.module()
    _forget_export_proxies()
    in_spec, out_spec = gm._in_spec, gm._out_spec
    _strip_guards(gm)
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat in, flat out
    gm.graph.eliminate_dead_code()
    gm.recompile()
    flat_inputs, _ = pytree.tree_flatten((args, dict(example_kwargs or {})))
    return CapturedGraph(gm=gm, in_spec=in_spec, out_spec=out_spec, flat_inputs=flat_inputs)


def _forget_export_proxies() -> None:
    """torch.export leaves its last trace's graph reachable from a module-level map (fake tensor id -> proxy), so
    a process that compiled keeps a whole extra copy of its last model's graph; the export is done with it."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor  # noqa: PLC0415

    leftover = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(leftover, dict):
        leftover.clear()


def _strip_guards(gm: torch.fx.GraphModule) -> None:
    # ep.module() checks input shapes with a guard submodule; trace-time shapes are
    # enforced by the compiled model itself, so the guard only adds a Python call.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _NON_COMPUTE_TARGETS - {operator.getitem} and not node.users:
            gm.graph.erase_node(node)
