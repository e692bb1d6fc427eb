"""Compute a one-row ``linear`` as the weight times a column, for XLA:CPU.

``linear(x, W, b)`` with ``x`` of one row is ``x @ W.T + b``, a matrix-vector product.
XLA:CPU computes the dot ``x[1, K] @ W.T[K, N]`` slower than the same sums written
``W[N, K] @ x.T[K, 1]``: on a 2-vCPU Xeon the example MLP's three batch-1 layers took
1.42 to 1.52 ms the first way and 1.26 to 1.29 ms the second (biases subtracted
negated both times, see :mod:`.matvec_addend`; medians of 1000). So, on the emulated
cores, each such ``linear`` becomes ``t(mm(W, t(x))) + b``: both transposes move no
data (a one-row matrix and a one-column one have the same layout), and ``W`` keeps
the layout ``nn.Linear`` stores it in, so :mod:`.fold_weight_layout` leaves it alone.

Run it before the layout passes; :func:`.matvec_addend.subtract_matvec_addends` then
keeps the bias out of the product. neuronx-cc gets the graph unchanged.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def _shape(node: object) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) and value.dtype.is_floating_point else None


def weight_times_column(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, every ``linear`` of a one-row ``x`` in ``gm``; returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten.linear.default or node.kwargs or len(node.args) < 2:
            continue
        x, weight, bias = (*node.args, None)[:3]
        rows, columns = _shape(x), _shape(weight)
        if rows is None or columns is None or len(rows) != 2 or rows[0] != 1 or len(columns) != 2:
            continue
        graph = gm.graph
        with graph.inserting_before(node):
            column = graph.call_function(aten.t.default, (x,))
            product = graph.call_function(aten.mm.default, (weight, column))
            out = graph.call_function(aten.t.default, (product,))
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
        out.meta = dict(node.meta)
        if bias is not None:  # the product's row has the result's shape too
            out.args[0].meta = dict(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
