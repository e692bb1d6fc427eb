"""Give weight matrices the layout their matrix multiplications read, once, before compiling.

``aten.linear(x, W, b)`` computes ``x @ W.T``. Lowered as is, the compiled executable
transposes every weight on every call: XLA does not fold a transpose of a parameter,
and its CPU matrix-vector kernels need the transposed layout materialised. For a
batch-1 call of the app note's MLP that copy is 25 times the multiplication itself
(a 784x4096 and a 4096x2048 weight, about 45 ms against 1.8 ms). This pass does the
transpose once at load: each ``linear`` whose weight is a constant of the subgraph
becomes ``matmul(x, W_T) + b`` with ``W_T`` stored contiguous, and every
``t``/``transpose``/``permute`` of a constant becomes a constant of its own. The
originals are dropped when nothing else reads them, so no weight is held twice.

Weights lifted into inputs (``inline_weights_to_neff=False``) are not constants of
the graph; :func:`fold_input_layout` gives each such weight that only ``linear``
reads the same treatment, with the caller storing it transposed on the device once,
when the weights are loaded or replaced.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten
_LAYOUT_OPS = {aten.t.default, aten.transpose.int, aten.permute.default}
DERIVED = "derived_from"  # gm.meta key: folded constant -> (source attribute, layout op, its arguments)


def _attr(gm: torch.fx.GraphModule, target: str) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads (parameter, buffer or lifted constant), if any."""
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _unlinear(gm: torch.fx.GraphModule) -> bool:
    """Rewrite ``linear(x, W, b)`` with a constant ``W`` as ``matmul(x, t(W)) + b``."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.linear.default or node.kwargs:
            continue
        x, weight, bias = (*node.args, None)[:3]
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
            continue
        value = _attr(gm, weight.target)
        if value is None or value.dim() != 2:
            continue
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(aten.matmul.default, (x, gm.graph.call_function(aten.t.default, (weight,))))
            if bias is not None:
                out = gm.graph.call_function(aten.add.Tensor, (out, bias))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _fold_layouts(gm: torch.fx.GraphModule) -> set[str]:
    """Replace each layout op on a constant by a contiguous constant; return the originals read."""
    sources = set()
    for node in list(gm.graph.nodes):
        if node.target not in _LAYOUT_OPS:
            continue
        source = node.args[0]
        if not (isinstance(source, torch.fx.Node) and source.op == "get_attr"):
            continue
        value = _attr(gm, source.target)
        if value is None:
            continue
        folded = node.target(value.detach(), *node.args[1:]).contiguous()
        name = f"{source.target.replace('.', '_')}__{node.name}"
        gm.register_buffer(name, folded)
        # Where each folded constant came from, so a sharding plan written for the source
        # weights follows it (compile/sharding.py).
        gm.meta.setdefault(DERIVED, {})[name] = (source.target, node.target.__name__.split(".")[0], node.args[1:])
        with gm.graph.inserting_before(node):
            constant = gm.graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        gm.graph.erase_node(node)
        sources.add(source.target)
    return sources


def _drop_unread(gm: torch.fx.GraphModule, targets: set[str]) -> None:
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets - read:
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, leaf)


def fold_weight_layout(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Pre-transpose constant weights of ``gm`` in place (see the module docstring); returns ``gm``."""
    _unlinear(gm)
    sources = _fold_layouts(gm)
    if sources:
        gm.graph.eliminate_dead_code()
        _drop_unread(gm, sources)
        gm.recompile()
    return gm


def fold_input_layout(gm: torch.fx.GraphModule, weights: list[torch.Tensor]) -> set[int]:
    """Make ``linear`` read the trailing ``weights`` inputs of ``gm`` pre-transposed; in place.

    A 2-D weight input read only as the weight of ``linear`` then takes ``W.t()``
    (the caller passes it so, contiguous) and each ``linear(x, W, b)`` becomes
    ``matmul(x, W_T) + b``. Returns the indices, within ``weights``, of the inputs
    that now take the transposed tensor.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = len(placeholders) - len(weights)
    transposed = set()
    for index, (node, value) in enumerate(zip(placeholders[first:], weights)):
        users = list(node.users)
        if value.dim() != 2 or not users or any(
                u.target is not aten.linear.default or u.kwargs or len(u.args) < 2 or u.args[1] is not node
                or node in (u.args[0], *u.args[2:]) for u in users):
            continue
        for user in users:
            x, bias = user.args[0], (*user.args, None)[2]
            with gm.graph.inserting_before(user):
                out = gm.graph.call_function(aten.matmul.default, (x, node))
                if bias is not None:
                    out = gm.graph.call_function(aten.add.Tensor, (out, bias))
            out.meta = dict(user.meta)
            user.replace_all_uses_with(out)
            gm.graph.erase_node(user)
        for key in ("val", "tensor_meta", "example_value"):  # the input's shape changed
            node.meta.pop(key, None)
        transposed.add(index)
    if transposed:
        gm.recompile()
    return transposed
