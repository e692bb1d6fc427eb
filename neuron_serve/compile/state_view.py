"""shared_state_buffer_preprocessor: each bucket model sees its own view of the shared state.

torch-neuronx's preprocessor maps (input shapes, shared buffer, bucket index) to the
state a bucket model takes, e.g. a maximum-length KV cache sliced to the bucket's
length. Here the preprocessing is compiled into the bucket's executable: a wrapper
module holds the whole shared buffer as its state, applies the preprocessor to it,
runs the bucket model on the views (``torch.func.functional_call`` puts them in place
of the model's state tensors) and writes the model's new values back into the views of
a copy of the buffer, which is returned as the new shared state. The executable thus
takes and returns the whole buffer on the device; nothing crosses to the host.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError
from .aliases import StateSpec

FIELD = "BucketModelConfig(shared_state_buffer_preprocessor=...)"
SHARED_PREFIX = "shared_state_buffer_"


def preprocessor(factory: Any) -> Callable | None:
    """The preprocessor ``factory()`` returns (as bucket_kernel, the config holds a function making it)."""
    if factory is None:
        return None
    if not callable(factory):
        raise ConfigError(f"{FIELD} must be a function returning the preprocessor (e.g. lambda: my_scripted_fn), "
                          f"got {type(factory).__name__}.")
    made = factory()
    if not callable(made):
        raise ConfigError(f"{FIELD}: the function returned a {type(made).__name__}, not the preprocessor; give a "
                          f"function returning a torch.jit.script function (shapes, state_buffer, bucket index).")
    return made


def input_shapes(args: tuple) -> list[list[int]]:
    """The preprocessor's first argument: the shape of each (padded) input tensor of the bucket."""
    flat, _ = pytree.tree_flatten(args)
    return [list(t.shape) for t in flat if isinstance(t, torch.Tensor)]


def _views(preprocess: Callable, shapes: list[list[int]], buffer: list[torch.Tensor], index: int) -> list:
    views = preprocess(shapes, list(buffer), torch.tensor(index))
    if not isinstance(views, (list, tuple)) or not all(isinstance(v, torch.Tensor) for v in views):
        raise ConfigError(f"{FIELD}: for bucket {index} the preprocessor returned {type(views).__name__}; it must "
                          f"return a list of tensors, one view of each shared_state_buffer entry.")
    return list(views)


class SharedStateView(torch.nn.Module):
    """A bucket model run on the preprocessor's views of the whole shared buffer (its state).

    Returns the model's outputs with each aliased output replaced by the whole shared
    entry, updated: the state the executable aliases.
    """

    def __init__(self, model: torch.nn.Module, states: list[StateSpec], buffer: list[torch.Tensor],
                 preprocess: Callable, shapes: list[list[int]], index: int) -> None:
        super().__init__()
        self.model = model
        self.names = [s.name for s in states]
        self.outputs = [s.output for s in states]
        self.preprocess = preprocess
        self.shapes = shapes
        self.index = index
        for k, tensor in enumerate(buffer):
            self.register_buffer(f"{SHARED_PREFIX}{k}", tensor.detach().clone())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        shared = [getattr(self, f"{SHARED_PREFIX}{k}") for k in range(len(self.names))]
        views = self.preprocess(self.shapes, shared, torch.tensor(self.index))
        out = torch.func.functional_call(self.model, dict(zip(self.names, views)), args, kwargs, strict=False)
        flat, spec = pytree.tree_flatten(out)
        updated = [t.clone() for t in shared]
        # The preprocessor's outputs are views, so it locates where each new value lands.
        for view, output in zip(self.preprocess(self.shapes, updated, torch.tensor(self.index)), self.outputs):
            view.copy_(flat[output])
        for k, output in enumerate(self.outputs):
            flat[output] = updated[k]
        return pytree.tree_unflatten(flat, spec)


def wrap(model: torch.nn.Module, states: list[StateSpec], buffer: list[torch.Tensor], preprocess: Callable,
         args: tuple, index: int) -> tuple[SharedStateView, list[StateSpec]]:
    """Bucket ``index``'s model taking the whole shared buffer as state; checks the preprocessor's views.

    The bucket model's k-th aliased tensor must have the shape and dtype of the
    preprocessor's k-th tensor (its example state), a view of shared entry k.
    """
    shapes = input_shapes(args)
    views = _views(preprocess, shapes, buffer, index)
    if len(views) != len(buffer):
        raise ConfigError(f"{FIELD}: for bucket {index} the preprocessor returned {len(views)} tensor(s), but "
                          f"shared_state_buffer has {len(buffer)}; return one view of each entry, in order.")
    if len(states) != len(buffer):
        raise ConfigError(f"bucket_model_trace: bucket {index}'s model aliases {len(states)} state tensor(s) "
                          f"(input_output_aliases returned by func) but shared_state_buffer has {len(buffer)}; "
                          f"each preprocessed shared entry is one aliased tensor, in order.")
    for k, (spec, view, entry) in enumerate(zip(states, views, buffer)):
        if tuple(view.shape) != tuple(spec.tensor.shape) or view.dtype != spec.tensor.dtype:
            raise ConfigError(f"{FIELD}: for bucket {index} the preprocessor made shared_state_buffer[{k}] shape "
                              f"{tuple(view.shape)} and dtype {view.dtype}, but the bucket model's state "
                              f"'{spec.name}' has shape {tuple(spec.tensor.shape)} and dtype {spec.tensor.dtype}.")
        if view.untyped_storage().data_ptr() != entry.untyped_storage().data_ptr():
            raise ConfigError(f"{FIELD}: for bucket {index} tensor {k} the preprocessor returned is not a view of "
                              f"shared_state_buffer[{k}] (a slice, narrow, select or view of it), so the bucket "
                              f"model's updates could not land back in the shared state; return views, not copies.")
    wrapper = SharedStateView(model, states, buffer, preprocess, shapes, index).eval()
    bound = [StateSpec(f"{SHARED_PREFIX}{k}", entry.detach(), spec.output)
             for k, (spec, entry) in enumerate(zip(states, buffer))]
    return wrapper, bound
