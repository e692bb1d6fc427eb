"""Stacked Linear+ReLU layers of given widths: a model to split into pipeline stages."""

import torch
from torch import nn


def build(widths: tuple[int, ...] = (64, 64, 64, 64, 64), seed: int = 0) -> nn.Module:
    """Layers from widths[i] to widths[i + 1], weights fixed by ``seed`` so a test's eager copy is identical."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers).eval()
