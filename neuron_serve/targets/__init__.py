"""Accelerator targets, chosen by name."""

from __future__ import annotations

import functools

from ..errors import ConfigError
from .base import Decision, Target
from .neuron import NeuronTarget
from .xla import XlaTarget

_TARGETS = {"neuron": NeuronTarget, "xla": XlaTarget}
TARGET_NAMES = tuple(_TARGETS)


@functools.cache
def get_target(name: str) -> Target:
    """The target called ``name``; unknown names are refused with the valid ones."""
    try:
        return _TARGETS[name]()
    except KeyError:
        raise ConfigError(f"Unknown target {name!r}; choose one of: {', '.join(TARGET_NAMES)}.") from None


__all__ = ["Decision", "Target", "TARGET_NAMES", "get_target"]
