"""A tiny model whose CPU subgraph can be told to fail or stall, for fault tests.

``tests_faulty::gate`` is a custom operator that the Neuron profile does not know, so it
runs in a CPU subgraph; it passes its input through, except that a row whose first
value is FAIL_MARK raises (one request's fault) and a row whose first value is
STALL_MARK sleeps STALL_S (a request that outlives its timeout). ``delay_ms`` makes
every batch take that long, so the server's capacity is small and known.
"""

import time

import torch
from torch import nn

FAIL_MARK = -999.0
STALL_MARK = -555.0
STALL_S = 4.0
FAULT_MESSAGE = "gate refused a row marked -999 (injected fault)"


@torch.library.custom_op("tests_faulty::gate", mutates_args=())
def gate(x: torch.Tensor, delay_ms: float) -> torch.Tensor:
    first = x.reshape(x.shape[0], -1)[:, 0] if x.numel() else x.new_zeros(0)
    if bool((first == FAIL_MARK).any()):
        raise ValueError(FAULT_MESSAGE)
    if bool((first == STALL_MARK).any()):
        time.sleep(STALL_S)
    if delay_ms:
        time.sleep(delay_ms / 1000)
    return x.clone()


@gate.register_fake
def _(x: torch.Tensor, delay_ms: float) -> torch.Tensor:
    return torch.empty_like(x)


class Faulty(nn.Module):
    def __init__(self, features: int = 8, delay_ms: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(features, features)
        self.fc2 = nn.Linear(features, 4)
        self.delay_ms = float(delay_ms)

    def forward(self, x):
        x = gate(x, self.delay_ms)
        return self.fc2(torch.relu(self.fc1(x)))


def build(features: int = 8, delay_ms: float = 0.0, seed: int = 0) -> Faulty:
    torch.manual_seed(seed)
    return Faulty(features, delay_ms)
