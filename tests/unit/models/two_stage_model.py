"""Two accelerator partitions around a CPU one: Linear, aten::sort (CPU in the Neuron profile), Linear."""

import torch
from torch import nn


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x):
        return self.second(torch.sort(self.first(x)).values)


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TwoStage().eval()


class RowSums(nn.Module):
    """Sums each row (zero padding along dim 1 leaves the sums as they are), then scales them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([[2.0, -1.0]]))

    def forward(self, x):
        return x.sum(dim=1, keepdim=True) * self.scale


def row_sums() -> nn.Module:
    return RowSums().eval()


def unseeded() -> nn.Module:
    """TwoStage with weights of a draw no other call repeats: a model whose answers only its own weights give."""
    return TwoStage().eval()
