"""A model whose compute and memory sit in different layers: four rounds of matrix products
(little weight, most of the time) then four large tables (most of the weight, little time).
Splitting it by memory and by latency gives different stages, which the pipeline balance
test and ``bench.pipeline`` compare."""

import torch
from torch import nn


class ComputeThenTables(nn.Module):
    def __init__(self, rounds: int = 4, tables: int = 4, width: int = 256, rows: int = 4096):
        super().__init__()
        self.rounds = rounds
        self.tables = nn.ParameterList(nn.Parameter(torch.randn(rows, width) * 0.1) for _ in range(tables))

    def forward(self, x):
        for _ in range(self.rounds):
            x = torch.tanh(x @ x.transpose(0, 1) @ x / x.shape[0])
        for table in self.tables:
            x = x + table[0]
        return x
