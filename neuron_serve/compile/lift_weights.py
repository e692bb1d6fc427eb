"""Lift a subgraph's parameters and buffers into graph inputs (weights apart from the executable).

With ``inline_weights_to_neff=False`` the compiled executable must not hold the weights
as constants: it takes them as inputs, so another checkpoint of the same architecture
can be swapped in by handing it other tensors, without compiling again.
"""

from __future__ import annotations

import re

import torch
import torch.fx


# torch.export's names for the constants it lifts out of a forward (a ``torch.tensor(...)`` literal, a random
# stream's seeds): part of the program, not of any checkpoint, so they stay in the graph.
_CONSTANT = re.compile(r"(^|\.)(lifted_tensor_\d+|_tensor_constant\d+)$")


def lift_weights(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Turn every get_attr of a parameter or buffer of ``gm`` into a trailing placeholder.

    Modifies ``gm`` in place (the attributes are removed from it) and returns the
    lifted tensors by their state-dict name, in the order the new inputs take them.
    torch.export's own constants stay in the graph.
    """
    named = {name: tensor for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]
             if not _CONSTANT.search(name)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # A partition's inputs can come after nodes that read weights (a state tensor's input
    # is the last); inputs depend on nothing, so gather them first and add the weights after.
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    if first is not None:
        for node in placeholders:
            first.prepend(node)
    anchor = placeholders[-1] if placeholders else None
    lifted: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target not in named:
            continue
        if node.target not in inputs:
            if anchor is None:
                ctx = gm.graph.inserting_before(next(iter(gm.graph.nodes)))
            else:
                ctx = gm.graph.inserting_after(anchor)
            with ctx:
                anchor = gm.graph.placeholder("w_" + node.target.replace(".", "_"))
            anchor.meta = dict(node.meta)
            inputs[node.target] = anchor
            lifted[node.target] = named[node.target].detach()
        node.replace_all_uses_with(inputs[node.target])
        gm.graph.erase_node(node)
    for name in lifted:
        owner, _, attr = name.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, attr)
    gm.graph.lint()
    # The modules that held only weights are empty now; each copy of the graph (one a core, one a compiled model)
    # would carry the model's whole module tree for nothing.
    gm.delete_all_unused_submodules()
    gm.recompile()
    return lifted
