"""Weights apart from the compiled executable: torch-neuronx's weight-separated models.

A model traced with ``inline_weights_to_neff=False`` compiles its accelerator
subgraphs with parameters and buffers as inputs; the tensors stay resident on the
core and are handed to the executable on every call. :func:`replace_weights` swaps in
another checkpoint of the same architecture without compiling, and
:func:`move_trace_to_device` loads the model and its weights onto another NeuronCore.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..compile.subgraph import CompiledSubgraph
from ..errors import ConfigError
from ..model import Bucket, CompiledModel
from ..targets.pjrt import use_device, xla


def check_inline_weights(value: Any) -> bool:
    """``inline_weights_to_neff`` as trace takes it: a bool, nothing else."""
    if not isinstance(value, bool):
        raise ConfigError(f"trace(inline_weights_to_neff=...) must be True or False, got {value!r}.")
    return value


def _buckets(model: CompiledModel) -> Iterator[Bucket]:
    for index in range(len(model.buckets)):
        yield from model.grid(index)


def _parts(model: CompiledModel) -> Iterator[tuple[Bucket, str, torch.nn.Module]]:
    """(bucket, partition name, submodule) of every partition of every compiled size."""
    for bucket in _buckets(model):
        for part in bucket.partitions:
            yield bucket, part.name, bucket.graph_module.get_submodule(part.name)


def _check_model(model: Any, caller: str) -> CompiledModel:
    if not isinstance(model, CompiledModel):
        raise ConfigError(f"{caller}() takes the module returned by neuron_serve.trace() or neuron_serve.load().")
    return model


def is_weight_separated(model: CompiledModel) -> bool:
    """Whether the model's accelerator subgraphs take their weights as inputs."""
    compiled = [sub for _, _, sub in _parts(model) if isinstance(sub, CompiledSubgraph)]
    return bool(compiled) and all(not sub.inline_weights for sub in compiled)


def weight_specs(model: CompiledModel) -> dict[str, torch.Tensor]:
    """The model's current weights by state-dict name (accelerator and CPU partitions alike)."""
    found: dict[str, torch.Tensor] = {}
    for _, _, sub in _parts(model):
        if isinstance(sub, CompiledSubgraph):
            found.update(sub.weights)
        else:
            found.update(sub.named_parameters())
            found.update(sub.named_buffers())
    return found


def _storage(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype


def check_state_dict(current: dict[str, torch.Tensor], state_dict: Any) -> None:
    """Refuse (ConfigError naming the weight) a state dict whose names, shapes or dtypes differ from ``current``."""
    if not isinstance(state_dict, dict):
        raise ConfigError(f"replace_weights(state_dict=...) must be a dict of tensors (model.state_dict()), "
                          f"got {type(state_dict).__name__}.")
    missing = [n for n in current if n not in state_dict]
    # A tied weight (an embedding shared with the LM head) is traced under one name, but
    # model.state_dict() (and torch.save of it) lists it under each, sharing one storage.
    traced = {_storage(state_dict[n]) for n in current if isinstance(state_dict.get(n), torch.Tensor)}
    unexpected = [n for n, t in state_dict.items()
                  if n not in current and not (isinstance(t, torch.Tensor) and _storage(t) in traced)]
    problems = []
    if missing:
        problems.append(f"missing weight(s) {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weight(s) {', '.join(unexpected)}")
    if problems:
        raise ConfigError(f"replace_weights: the state dict does not match the traced model: {'; '.join(problems)}. "
                          "It must hold exactly the weights of the traced architecture.")
    for name, tensor in current.items():
        new = state_dict[name]
        if not isinstance(new, torch.Tensor):
            raise ConfigError(f"replace_weights: weight '{name}' is a {type(new).__name__}, not a tensor.")
        if tuple(new.shape) != tuple(tensor.shape):
            raise ConfigError(f"replace_weights: weight '{name}' has shape {tuple(new.shape)}; the traced model "
                              f"has {tuple(tensor.shape)}.")
        if new.dtype != tensor.dtype:
            raise ConfigError(f"replace_weights: weight '{name}' has dtype {new.dtype}; the traced model has "
                              f"{tensor.dtype}.")


def replace_weights(neuron_model: CompiledModel, state_dict: dict[str, torch.Tensor]) -> CompiledModel:
    """Swap in another checkpoint of the traced architecture; nothing is compiled.

    As in torch-neuronx, only models traced with ``inline_weights_to_neff=False`` can
    take new weights. ``state_dict`` must have exactly the traced weights' names,
    shapes and dtypes (``model.state_dict()`` of the same architecture); a mismatch is a
    ConfigError naming the weight. Modifies the model in place and returns it.
    """
    model = _check_model(neuron_model, "replace_weights")
    if not is_weight_separated(model):
        raise ConfigError("replace_weights: this model's weights are compiled into its executable; trace it with "
                          "neuron_serve.trace(..., inline_weights_to_neff=False) to replace weights.")
    current = weight_specs(model)
    check_state_dict(current, state_dict)
    # One copy of record for every executable (they then share one copy on each core); the caller's tensors may
    # change afterwards.
    state_dict = {name: state_dict[name].detach().clone() for name in current}
    with torch.no_grad():
        for _, _, sub in _parts(model):
            if isinstance(sub, CompiledSubgraph):
                sub.set_weights(state_dict)
                continue
            for name, tensor in [*sub.named_parameters(), *sub.named_buffers()]:
                tensor.copy_(state_dict[name])
    return model


def move_trace_to_device(neuron_model: CompiledModel, device_id: int) -> CompiledModel:
    """Load the model's executables and weights onto NeuronCore ``device_id``; in place.

    The calling thread then drives that core (torch-xla replays an executable on the
    thread's default device), as torch-neuronx's model runs where it was moved.
    """
    model = _check_model(neuron_model, "move_trace_to_device")
    torch_xla = xla()
    import torch_xla.runtime as xr  # noqa: PLC0415

    count = xr.addressable_device_count()
    if isinstance(device_id, bool) or not isinstance(device_id, int) or not 0 <= device_id < count:
        raise ConfigError(f"move_trace_to_device: device_id must be a NeuronCore index from 0 to {count - 1}, "
                          f"got {device_id!r}.")
    device = torch_xla.device(device_id)
    use_device(device)
    for bucket, name, sub in list(_parts(model)):
        if isinstance(sub, CompiledSubgraph) and str(sub.device) != str(device):
            setattr(bucket.graph_module, name, sub.load_to(device))
    for state in model._device_states():  # input_output_aliases: the state follows its executables
        if str(state.device) != str(device):
            state.to(device)
    return model
