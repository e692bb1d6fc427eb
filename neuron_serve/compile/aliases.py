"""input_output_aliases at trace time: which module tensors are state, and how they flow.

torch-neuronx's ``trace(model, x, input_output_aliases={model.cache: 1})`` marks a
parameter or buffer of the model as a state tensor: it lives on the device across
calls, the compiled graph takes it as an input, and output 1 is its new value, written
back over it after every call. Here each state's reads (``get_attr`` nodes of the
captured graph) become trailing graph inputs before partitioning, so no pass folds it
into the executable as a constant, and the partition plan is checked so the state only
ever meets accelerator subgraphs: it never crosses to the host on a call. With
``bucket_model_trace``'s ``shared_state_buffer`` every bucket model's states are bound
to one :class:`~neuron_serve.model.state.DeviceState` (through the views of
``shared_state_buffer_preprocessor``: see state_view.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..errors import ConfigError
from ..model.state import Alias, DeviceState

STATE_PREFIX = "state_"


@dataclass(frozen=True)
class StateSpec:
    """One aliased state tensor: its name in the module, its initial value, the output that updates it."""

    name: str
    tensor: torch.Tensor
    output: int


def check_aliases(func: Any, aliases: Any, caller: str = "trace") -> list[StateSpec]:
    """``input_output_aliases`` as torch-neuronx takes it, checked; in the dict's order.

    Each key must be a parameter or buffer of ``func`` (an nn.Module), each value a
    non-negative int (the index of the flattened output that is the state's new value).
    """
    if aliases is None or (isinstance(aliases, dict) and not aliases):
        return []
    field = f"{caller}(input_output_aliases=...)"
    if not isinstance(aliases, dict):
        raise ConfigError(f"{field} must be a dict {{state tensor: output index}}, got {type(aliases).__name__}.")
    if not isinstance(func, torch.nn.Module):
        raise ConfigError(f"{field}: the state tensors must be parameters or buffers of the traced module, but "
                          f"the traced function is a {type(func).__name__}, not a torch.nn.Module.")
    owned = {**dict(func.named_parameters()), **dict(func.named_buffers())}
    specs: list[StateSpec] = []
    for tensor, index in aliases.items():
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{field}: key {tensor!r} is a {type(tensor).__name__}, not a tensor of the module.")
        name = next((n for n, t in owned.items() if t is tensor), None)
        if name is None:
            raise ConfigError(f"{field}: a key (shape {tuple(tensor.shape)}, {tensor.dtype}) is not a parameter or "
                              f"buffer of {type(func).__name__}; use the module's own tensor, e.g. model.cache, "
                              f"not a copy of it.")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"{field}: state '{name}' maps to {index!r}; give the index of the output (an int "
                              f">= 0) that holds its new value.")
        specs.append(StateSpec(name, tensor.detach(), index))
    used: dict[int, str] = {}
    for spec in specs:
        if spec.output in used:
            raise ConfigError(f"{field}: states '{used[spec.output]}' and '{spec.name}' both map to output "
                              f"{spec.output}; each state needs its own output.")
        used[spec.output] = spec.name
    return specs


def lift_states(gm: torch.fx.GraphModule, states: list[StateSpec]) -> None:
    """Turn every read of a state tensor in ``gm`` into a trailing placeholder, in ``states`` order.

    Modifies ``gm`` in place (the attributes are removed from it).
    """
    names = {s.name for s in states}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    inputs: dict[str, torch.fx.Node] = {}
    for spec in states:
        ctx = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(
            next(iter(gm.graph.nodes)))
        with ctx:
            anchor = gm.graph.placeholder(STATE_PREFIX + spec.name.replace(".", "_"))
        anchor.meta["val"] = spec.tensor
        inputs[spec.name] = anchor
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in names:
            node.replace_all_uses_with(inputs[node.target])
            gm.graph.erase_node(node)
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if hasattr(module, attr):
            delattr(module, attr)
    gm.graph.lint()
    gm.recompile()


def check_outputs(gm: torch.fx.GraphModule, states: list[StateSpec], caller: str = "trace") -> None:
    """Each state's output exists and has the state's shape and dtype (from the captured graph)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    field = f"{caller}(input_output_aliases=...)"
    for spec in states:
        if spec.output >= len(flat):
            raise ConfigError(f"{field}: state '{spec.name}' maps to output {spec.output}, but the model has "
                              f"{len(flat)} output(s) (indices 0 to {len(flat) - 1}, flattened).")
        value = flat[spec.output]
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if not isinstance(val, torch.Tensor):
            raise ConfigError(f"{field}: output {spec.output}, mapped to state '{spec.name}', is not a tensor.")
        if tuple(val.shape) != tuple(spec.tensor.shape) or val.dtype != spec.tensor.dtype:
            raise ConfigError(f"{field}: state '{spec.name}' has shape {tuple(spec.tensor.shape)} and dtype "
                              f"{spec.tensor.dtype}, but output {spec.output} has shape {tuple(val.shape)} and dtype "
                              f"{val.dtype}; the output must be the state's new value.")


def _producer(node: Any) -> tuple[str | None, int]:
    """(partition, output index) of a top-graph value: a partition call or a getitem of one."""
    if isinstance(node, torch.fx.Node) and node.op == "call_module":
        return node.target, 0
    if isinstance(node, torch.fx.Node) and node.op == "call_function":
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.op == "call_module":
            return source.target, node.args[1]
    return None, 0


def plan_state_flow(gm: torch.fx.GraphModule, states: list[StateSpec], num_inputs: int,
                    accel_prefix: str) -> tuple[list[Alias], dict[str, set[int]], dict[str, list[int]]]:
    """Check that states meet only accelerator subgraphs; say how they run.

    Returns the aliases (state slot, flat output index), each accelerator partition's
    outputs that stay on the device (the states' new values), and each partition's
    inputs whose device buffer its executable may reuse for an output (the state it
    alone reads and updates: XLA's input/output aliasing).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][num_inputs:]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = list(output.args[0])
    keep: dict[str, set[int]] = {}
    donate: dict[str, list[int]] = {}
    aliases = []
    for slot, (spec, node) in enumerate(zip(states, placeholders)):
        readers = [u for u in node.users if u.op != "output"]
        for user in readers:
            if not (user.op == "call_module" and user.target.startswith(accel_prefix)):
                raise ConfigError(f"input_output_aliases: state '{spec.name}' is read by {user.target}, which runs "
                                  f"on CPU; state tensors live on the NeuronCore and must only be read by operators "
                                  f"it supports (see the partition log).")
        value = flat[spec.output]
        aliases.append(Alias(slot, spec.output))
        if value is node:  # returned unchanged
            continue
        part, index = _producer(value)
        if part is None or not part.startswith(accel_prefix):
            raise ConfigError(f"input_output_aliases: output {spec.output}, the new value of state '{spec.name}', is "
                              f"computed on CPU ({part or 'outside any partition'}); it must be computed by operators "
                              f"the NeuronCore supports so the state never leaves it.")
        others = [u for u in value.users if u is not output]
        if others:
            raise ConfigError(f"input_output_aliases: output {spec.output}, the new value of state '{spec.name}', is "
                              f"also read by {', '.join(str(u.target) for u in others)}; a state's new value may "
                              f"only be returned.")
        keep.setdefault(part, set()).add(index)
        if [u.target for u in readers] == [part]:
            donate.setdefault(part, []).append(list(readers[0].args).index(node))
    return aliases, keep, donate


def shared_state(buffer: list[torch.Tensor] | None) -> DeviceState | None:
    """The one device-resident state every bucket model reads and updates, from ``shared_state_buffer``."""
    if buffer is None:
        return None
    for i, tensor in enumerate(buffer):
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"BucketModelConfig(shared_state_buffer=...): entry {i} is a {type(tensor).__name__}, "
                              f"not a tensor.")
    return DeviceState([f"shared_state_buffer[{i}]" for i in range(len(buffer))], buffer)


def bind_shared(states: list[StateSpec], buffer: list[torch.Tensor], bucket: int) -> list[StateSpec]:
    """Bucket ``bucket``'s aliased tensors, in order, as the shared buffer's entries (same shapes and dtypes)."""
    if len(states) != len(buffer):
        raise ConfigError(f"bucket_model_trace: bucket {bucket}'s model aliases {len(states)} state tensor(s) "
                          f"(input_output_aliases returned by func) but shared_state_buffer has {len(buffer)}; "
                          f"each shared entry is the initial value of one aliased tensor, in order.")
    bound = []
    for spec, initial in zip(states, buffer):
        if tuple(initial.shape) != tuple(spec.tensor.shape) or initial.dtype != spec.tensor.dtype:
            raise ConfigError(f"bucket_model_trace: bucket {bucket}'s state '{spec.name}' has shape "
                              f"{tuple(spec.tensor.shape)} and dtype {spec.tensor.dtype}, but its shared_state_buffer "
                              f"entry has shape {tuple(initial.shape)} and dtype {initial.dtype}.")
        bound.append(StateSpec(spec.name, initial.detach(), spec.output))
    return bound
