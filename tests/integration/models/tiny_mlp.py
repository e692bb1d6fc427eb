"""A two-layer MLP small enough to build quickly on every replica of a multi-node test."""

import torch
from torch import nn


def build(features: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0) -> nn.Module:
    """The model, with weights fixed by ``seed`` so the test's eager copy is identical."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes)).eval()
