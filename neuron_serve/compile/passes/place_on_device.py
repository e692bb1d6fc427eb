"""Place every tensor an accelerator subgraph creates or captures on that subgraph's device.

torch.export records the device of each tensor a model makes inside ``forward``
(``torch.arange(n)`` becomes ``aten.arange(..., device=cpu)``, ``x.to("cpu")`` becomes
``aten._to_copy(..., device=cpu)``) and keeps constants it lifts (``torch.tensor(...)``
literals, non-persistent buffers) as plain attributes of the GraphModule, which
``Module.to(device)`` does not move because they are neither parameters nor buffers.
Run on a core, such a subgraph mixes CPU and XLA tensors and torch-xla refuses it
("Expected XLA tensor. Got: torch.LongTensor"). This pass rewrites each CPU device
argument to ``device`` and moves each captured tensor there, so the subgraph runs
wholly where it is compiled: on the first core, on every further core, and after an
artifact is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


def _device_slot(node: torch.fx.Node) -> tuple[int | str, Any] | None:
    """Where ``node`` passes a ``device`` argument (position or keyword) and its value.

    Returns None for operators without a ``device`` argument. A factory operator (one
    with no tensor argument) given no device would allocate on the default (CPU)
    device, so it is reported with value None; an operator with a tensor argument
    given no device follows that tensor, which is already on the core.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    if "device" not in names:
        return None
    index = names.index("device")
    if "device" in node.kwargs:
        return "device", node.kwargs["device"]
    if index < len(node.args):
        return index, node.args[index]
    takes_tensor = any(isinstance(a.type, torch.TensorType) for a in schema.arguments)
    return (None if takes_tensor else ("device", None))


def _retarget(node: torch.fx.Node, slot: int | str, device: torch.device) -> None:
    if isinstance(slot, str):
        node.kwargs = {**node.kwargs, slot: device}
    else:
        args = list(node.args)
        args[slot] = device
        node.args = tuple(args)


def _move_captured_tensors(gm: torch.fx.GraphModule, device: torch.device) -> None:
    # Parameters and buffers follow Module.to(); lifted constants are plain attributes.
    registered = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor) and id(value) not in registered and value.device != device:
            setattr(owner, name, value.to(device))


def place_on_device(gm: torch.fx.GraphModule, device: Any) -> torch.fx.GraphModule:
    """Rewrite ``gm`` in place so every tensor it creates or captures lives on ``device``.

    Device arguments naming another device type (``device=cpu`` in ``arange``,
    ``zeros``, ``full``, ``scalar_tensor``, ``new_*``, ``_to_copy``, ``to``) and
    factory calls without a device become ``device``; tensor constants and plain
    tensor attributes are moved there. Parameters and buffers are left to
    ``gm.to(device)``. Returns ``gm``.
    """
    device = torch.device(device)
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        slot = _device_slot(node)
        if slot is None:
            continue
        where, value = slot
        current = torch.device(value) if isinstance(value, (str, torch.device)) else value
        if current != device:
            _retarget(node, where, device)
            changed = True
    _move_captured_tensors(gm, device)
    if changed:
        gm.recompile()
    return gm
