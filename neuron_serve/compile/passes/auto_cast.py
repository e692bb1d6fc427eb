"""Reproduce neuronx-cc's ``--auto-cast`` / ``--auto-cast-type`` on an accelerator subgraph.

neuronx-cc with ``--auto-cast matmult`` computes matrix multiplications and
convolutions with their FP32 operands cast to ``--auto-cast-type`` (bf16 by default)
and partial sums kept in FP32; ``--auto-cast all`` does so for every FP32 operator. So a
user sees that accuracy effect before deploying, this pass rounds each FP32 operand of
a matching operator to the cast type, and its FP32 result too: a round trip
(``x.to(bf16).to(float32)``) that XLA keeps, because narrowing is not value-preserving.
Computing on the rounded values in FP32 is what the hardware's FP32 accumulation does,
and it works for every cast type, fp8 included, on any XLA backend.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

# ATen operators neuronx-cc's ``matmult`` mode casts: matrix multiplications and convolutions.
MATMULT_OPS = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm",
    "aten::addbmm", "aten::mv", "aten::addmv", "aten::dot", "aten::einsum", "aten::tensordot",
    "aten::convolution", "aten::_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d",
    "aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d",
    "aten::scaled_dot_product_attention",
})
# Casts themselves and shape-only operators: rounding around them changes nothing but the graph.
_NEVER = frozenset({
    "aten::_to_copy", "aten::to", "prims::convert_element_type", "aten::detach", "aten::clone",
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::alias", "aten::lift_fresh_copy",
})
_CAST = torch.ops.aten._to_copy.default
SOURCE = torch.float32  # auto-cast only narrows FP32, as neuronx-cc does


def _op(node: torch.fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else None


def _is_fp32(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == SOURCE


def _value(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """The example value of ``node``: its recorded ``val``, or the attribute a get_attr names."""
    if "val" in node.meta:
        return node.meta["val"]
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj
    return None


def _matches(node: torch.fx.Node, mode: str) -> bool:
    if node.op != "call_function":
        return False
    op = _op(node)
    if op is None or op in _NEVER:
        return False
    return op in MATMULT_OPS if mode == "matmult" else mode == "all"


def _round(graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    narrow = graph.call_function(_CAST, (value,), {"dtype": dtype})
    return graph.call_function(_CAST, (narrow,), {"dtype": SOURCE})


def auto_cast(gm: torch.fx.GraphModule, mode: str, dtype: torch.dtype) -> int:
    """Round FP32 operands and results of ``mode``'s operators ("matmult" or "all") to ``dtype``.

    Mutates ``gm``; returns how many operators were cast (0 for mode "none").
    """
    if mode == "none":
        return 0
    graph = gm.graph
    cast = 0
    for node in list(graph.nodes):
        if not _matches(node, mode):
            continue
        operands = [a for a in node.all_input_nodes if _is_fp32(_value(gm, a))]
        value = node.meta.get("val")
        results = [node] if _is_fp32(value) else [
            u for u in node.users if u.target is operator.getitem and _is_fp32(u.meta.get("val"))
        ]
        if not operands and not results:
            continue
        with graph.inserting_before(node):
            rounded = {a: _round(graph, a, dtype) for a in operands}
        node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: rounded.get(a, a))
        for result in results:
            users = list(result.users)
            with graph.inserting_after(result):
                narrow = graph.call_function(_CAST, (result,), {"dtype": dtype})
            with graph.inserting_after(narrow):
                back = graph.call_function(_CAST, (narrow,), {"dtype": SOURCE})
            for user in users:
                user.replace_input_with(result, back)
        cast += 1
    graph.lint()
    gm.recompile()
    return cast
