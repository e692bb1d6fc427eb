"""A fine-tune's weights served by compiled generation models without compiling (as a built artifact's
``weights:``): one copy of record, placed once on each core and taken by every compiled model."""

from __future__ import annotations

from typing import Sequence

import torch

from .model import GenerationModel
from .slots import weights_of


def swap_weights(models: Sequence[GenerationModel], lm: torch.nn.Module, build=None) -> int:
    """Hand the compiled models of every core (``models``) the weights of ``lm`` (a fine-tune of the served model:
    same architecture, dtype and quantization), without compiling: one copy of record for all of them, placed once
    on each core; with ``build`` (compiling.GenerationBuild), the models compiled later take them too. Returns how
    many weights were replaced."""
    state = {name: tensor.clone() for name, tensor in weights_of(lm).items()}  # the caller's may change later
    replaced = 0
    for model in models:
        replaced = model.replace_weights(state)
    if build is not None:  # later compiles trace the build's model: they then take the same tensors
        build.lm.load_state_dict({name.removeprefix("lm."): t for name, t in state.items()}, strict=False,
                                 assign=True)
    return replaced
