"""The Python model a model.yaml's ``model.factory`` names: imported (the model.yaml's folder first on the path)
and called with ``model.kwargs``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

from ..errors import ConfigError
from .schema import ModelConfig


def build_model(config: ModelConfig, base_dir: str | Path | None = None) -> torch.nn.Module:
    """Import and call the factory; import paths resolve against ``base_dir`` first."""
    if config.model.factory is None:
        raise ConfigError("model: this model.yaml names no factory (an artifact or a pretrained directory), so "
                          "there is no Python model to build.")
    module_name, _, attr = config.model.factory.partition(":")
    if base_dir is not None and str(base_dir) not in sys.path:
        sys.path.insert(0, str(base_dir))
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"model.factory: cannot import {config.model.factory!r} ({exc}); the module must be importable "
            f"from the model.yaml's folder or the Python path."
        ) from None
    model = factory(**config.model.kwargs)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.factory: {config.model.factory!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model.eval()
