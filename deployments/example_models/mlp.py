"""The MLP of the torch-neuronx graph partitioner app note, with its unsupported sort."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, input_size=28 * 28, output_size=10, layers=(4096, 2048)):
        super().__init__()
        self.fc1 = nn.Linear(input_size, layers[0])
        self.fc2 = nn.Linear(layers[0], layers[1])
        self.fc3 = nn.Linear(layers[1], output_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        f1 = self.fc1(x)
        r1 = self.relu(f1)
        f2 = self.fc2(r1)
        r2 = self.relu(f2)
        f3 = self.fc3(r2)
        out = torch.log_softmax(f3, dim=1)
        sort_out, _ = torch.sort(out)
        return sort_out


def build(input_size=28 * 28, output_size=10, layers=(4096, 2048), seed=0):
    torch.manual_seed(seed)
    return MLP(input_size, output_size, tuple(layers))
