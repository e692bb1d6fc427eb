"""Keep XLA:CPU from fusing a bias (or any addend) into a matrix-vector product.

XLA:CPU output-fuses ``add(dot, y)`` when the dot is a matrix-vector product (a
batch-1 ``linear``) and emits the fusion as its own single-threaded loop. Left as a
plain dot, the product is a library call that runs on the intra-op thread pool. On a
2-vCPU Xeon the example MLP's batch-1 call took 2.05 ms with its three biases fused
and 1.6 ms without (``x @ W`` alone: 1.5 ms). XLA fuses only an ``add``, so this pass
writes each such ``y + x @ W`` as ``x @ W - (-y)``: IEEE subtraction is addition of
the negation, so the sum is the same operation, with the negation fused into the
elementwise loop that follows the dot. The product itself comes from the library
kernel instead of the fused loop, which sums in another order (the MLP's outputs move
by at most 5e-7 from eager either way).

Only products whose result is a vector or a matrix with one row or column are
rewritten: wider ones are not output-fused. The pass serves the emulated cores;
neuronx-cc fuses on its own terms and gets the graph unchanged.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
_PRODUCTS = {aten.matmul.default, aten.mm.default}
# Ops that add a bias themselves: where the bias is, and the product without it.
_BIASED = {
    aten.linear.default: (2, lambda x, weight, bias: (aten.linear.default, (x, weight))),
    aten.addmm.default: (0, lambda bias, x, weight: (aten.mm.default, (x, weight))),
}


def _is_matvec(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value (from its recorded example) is a floating vector or a one-row/column matrix."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        return False
    shape = tuple(value.shape)
    return len(shape) <= 1 or (len(shape) == 2 and 1 in shape)


def _is_product(node: object) -> bool:
    """A matrix product, or the transpose of one (as :mod:`.row_linear` writes a one-row ``linear``)."""
    if isinstance(node, torch.fx.Node) and node.target is aten.t.default and len(node.users) == 1:
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.target in _PRODUCTS and len(node.users) == 1


def _subtract_negated(gm: torch.fx.GraphModule, node: torch.fx.Node, product: torch.fx.Node,
                      addend: torch.fx.Node) -> None:
    with gm.graph.inserting_before(node):
        negated = gm.graph.call_function(aten.neg.default, (addend,))
        out = gm.graph.call_function(aten.sub.Tensor, (product, negated))
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def subtract_matvec_addends(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, every addend of a matrix-vector product in ``gm``; returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs or not _is_matvec(node):
            continue
        if node.target is aten.add.Tensor and len(node.args) == 2:
            for product, addend in (node.args, reversed(node.args)):
                if isinstance(addend, torch.fx.Node) and _is_product(product) and product is not addend:
                    _subtract_negated(gm, node, product, addend)
                    rewritten += 1
                    break
        elif node.target in _BIASED and len(node.args) == 3:
            at, product_of = _BIASED[node.target]
            if isinstance(node.args[at], torch.fx.Node):
                op, args = product_of(*node.args)
                with gm.graph.inserting_before(node):
                    product = gm.graph.call_function(op, args)
                _subtract_negated(gm, node, product, node.args[at])
                rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
