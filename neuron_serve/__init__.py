"""neuron-serve: torch-neuronx's compile pipeline on torch.fx and torch-xla, and a server.

The public API is named like ``torch_neuronx`` so code ports by changing an import.
Names are imported on first use, so a process that only serves a built model (the
runtime, the data plane) never loads the compiler through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

_PUBLIC = {
    "analyze": ".api",
    "trace": ".api",
    "trace_buckets": ".api",
    "bucket_model_trace": ".api",
    "dynamic_batch": ".api",
    "save": ".assembly.artifact",
    "load": ".assembly.artifact",
    "BucketModelConfig": ".buckets.shape",
    "BucketSpec": ".buckets.shape",
    "CompiledModel": ".model",
    "ConfigError": ".errors",
    "PartitionError": ".errors",
    "UnsupportedModelError": ".errors",
    "PartitionerConfig": ".partition.config",
    "ModelPlacement": ".partition.placement",
    "replace_weights": ".assembly.weights",
    "move_trace_to_device": ".assembly.weights",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'neuron_serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

