"""The models of the torch-neuronx reference documents, verbatim but for imports."""

import torch
import torch.nn as nn


class MLP(nn.Module):
    """Graph partitioner app note, "Default Usage" and "ops to partition"."""

    def __init__(self, input_size=28 * 28, output_size=10, layers=[4096, 2048]):
        super(MLP, self).__init__()
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


class SandwichMLP(MLP):
    """Graph partitioner app note, "Specifying requirements": sort between layers."""

    def forward(self, x):
        f1 = self.fc1(x)
        r1 = self.relu(f1)
        sort_r1, _ = torch.sort(r1)
        f2 = self.fc2(sort_r1)
        r2 = self.relu(f2)
        f3 = self.fc3(r2)
        out = torch.log_softmax(f3, dim=1)
        return out


class UnsupportedModel(torch.nn.Module):
    """Analyze for Training tutorial, unsupported.py: fft, then a complex multiply."""

    def forward(self, x):
        y = torch.fft.fft(x)
        x = x + 10
        return x * y



def line_of(code: str) -> int:
    """The line number of ``code`` in this file, for call-site assertions."""
    with open(__file__) as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip() == code:
                return number
    raise LookupError(code)
