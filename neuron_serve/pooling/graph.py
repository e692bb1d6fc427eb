"""The module a pooling model compiles: the transformer, the sentence-transformers modules after it, the activation.

Everything after the transformer (pooling, Dense projections, normalisation, a
cross-encoder's activation) runs inside the compiled graph, so what crosses back from the
core is one vector or a few scores a row, not a hidden state per token. Measured on a
MiniLM-sized embedder (bench/embed_placement.py; docs/guides/embeddings.md): the compiled
call costs the same either way, within the noise, while pooling on the host adds half a
millisecond to tens of milliseconds of host CPU a call and 32 to 128 times the bytes crossing
back (3 MiB instead of 24 KiB at 16 rows of 128 tokens). The modules are sentence-transformers' own, so the graph computes what its
``encode`` and ``predict`` compute.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch


class PoolingGraph(torch.nn.Module):
    """``model``'s ``output_key`` output, as ``feature`` of sentence-transformers' features, through ``heads``;
    their ``result`` feature, through ``activation`` when given.

    Takes its inputs positionally in ``names`` order (what the bucket kernel and dynamic
    batching pass), and the model by keyword.
    """

    def __init__(self, model: torch.nn.Module, names: Sequence[str], output_key: str, feature: str,
                 heads: Sequence[torch.nn.Module], result: str, activation: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.output_key = output_key
        self.feature = feature
        self.heads = torch.nn.ModuleList(heads)
        self.result = result
        self.activation = activation
        # A decoder would build a KV cache on every call, which nothing here reads.
        self.fixed = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        given = dict(zip(self.names, inputs))
        output = self.model(**given, **self.fixed, return_dict=True)
        features = {self.feature: output[self.output_key], "attention_mask": given["attention_mask"]}
        for head in self.heads:
            features = head(features)
        value = features[self.result]
        value = value if self.activation is None else self.activation(value)
        return value.float()  # embeddings and scores leave in float32, whatever the model computes in
