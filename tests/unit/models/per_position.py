"""A sequence model that works on each position alone, so zero padding along the sequence never
changes the real positions: the same answer whichever sequence bucket runs it.

``fail_at``: capture fails when the sequence is that long, as a model would whose operator
cannot compile at one shape (a test of a background compile that fails).
"""

import torch
from torch import nn


class PerPosition(nn.Module):
    def __init__(self, width: int, fail_at: int | None) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)
        self.fail_at = fail_at

    def forward(self, x):
        if x.shape[1] == self.fail_at:
            raise NotImplementedError(f"no kernel for sequences of length {self.fail_at}")
        return self.outer(torch.sort(torch.relu(self.inner(x)), dim=-1).values)


def build(width: int = 8, fail_at: int | None = None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return PerPosition(width, fail_at).eval()
