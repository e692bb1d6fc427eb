"""Accelerator targets, chosen by name.

The targets (and torch with them) load on first use: the serving processes that only ask whether the cores are
emulated (``targets.pjrt``: the server app, Serve's HAProxy manager) import this package without them.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import Target

_TARGETS = {"neuron": (".neuron", "NeuronTarget"), "xla": (".xla", "XlaTarget")}
TARGET_NAMES = tuple(_TARGETS)
_LAZY = {"Decision": ".base", "Target": ".base"}


@functools.cache
def get_target(name: str) -> Target:
    """The target called ``name``; unknown names are refused with the valid ones."""
    try:
        module, cls = _TARGETS[name]
    except KeyError:
        raise ConfigError(f"Unknown target {name!r}; choose one of: {', '.join(TARGET_NAMES)}.") from None
    return getattr(importlib.import_module(module, __name__), cls)()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = ["Decision", "Target", "TARGET_NAMES", "get_target"]
