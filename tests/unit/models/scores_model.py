"""Linear layers on the accelerator, then aten::sort, which the Neuron profile puts on CPU."""

import torch
from torch import nn


class SortedScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return torch.sort(self.layers(x)).values


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SortedScores().eval()
