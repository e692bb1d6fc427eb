"""The module a packed pooling model compiles: rows holding several texts, one vector or score per text.

Its inputs are a padded model's (input_ids, attention_mask[, token_type_ids]) but for the
attention mask, which holds each token's segment: 0 for padding, k for the row's k-th text
(a padded row's 0/1 mask is a row of one text). From it the graph builds, inside the
compiled call, what running each text alone would have given the encoder: a block-diagonal
attention mask (a text's tokens see only its own; lower-triangular within it for a decoder),
and position ids restarting at each text's first token (after the padding index for
RoBERTa-style positions). Pooling is per segment: the mean of its tokens, its first token or
its last, then the sentence-transformers modules after the pooling (Dense, Normalize) as they
are; a cross-encoder's classifier reads each pair's first token. The output holds ``segments``
vectors a row, in segment order (those of absent segments are meaningless).

Whether a model computes the same packed as alone is checked on it before it is compiled
(source.py: `exact`); one whose attention ignores a 4-D mask or whose positions are not its
inputs is served padded.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

# What a pooling mode takes of a segment's tokens: its mean, its first or its last.
MODES = ("mean", "cls", "lasttoken")


class PackedPoolingGraph(torch.nn.Module):
    """``model`` over packed rows, pooled per segment: (rows, segments, dimensions) out.

    ``pool`` is the pooling mode (MODES) of an embedder, whose ``heads`` (the modules after
    sentence-transformers' Pooling) map its ``sentence_embedding``; None for a cross-encoder, whose
    ``classifier`` maps each pair's first-token state (batch, 1, hidden) to logits, then ``heads``
    and ``activation`` as a padded cross-encoder's."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], output_key: str, segments: int,
                 position_offset: int, causal: bool, pool: str | None, heads: Sequence[torch.nn.Module],
                 result: str, feature: str = "", classifier: torch.nn.Module | None = None,
                 activation: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.output_key = output_key
        self.segments = segments
        self.position_offset = position_offset
        self.causal = causal
        self.pool = pool
        self.heads = torch.nn.ModuleList(heads)
        self.result = result
        self.feature = feature
        self.classifier = classifier
        self.activation = activation
        self.fixed = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        self.dtype = next(model.parameters()).dtype

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        given = dict(zip(self.names, inputs))
        segment = given.pop("attention_mask")
        rows, length = segment.shape
        numbers = torch.arange(1, self.segments + 1, device=segment.device)
        member = segment[:, None, :] == numbers[None, :, None]  # (rows, segments, length)
        within = torch.cumsum(member.to(torch.int64), dim=-1) - 1
        positions = (within * member).sum(1) + self.position_offset  # each text counts from its first token
        allowed = segment[:, :, None] == segment[:, None, :]  # padding sees padding only; never a text
        if self.causal:
            allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
        mask = torch.zeros(rows, 1, length, length, dtype=self.dtype, device=segment.device)
        mask = mask.masked_fill(~allowed[:, None], torch.finfo(self.dtype).min)
        output = self.model(**given, attention_mask=mask, position_ids=positions, **self.fixed, return_dict=True)
        hidden = output[self.output_key]  # (rows, length, hidden)
        if self.pool == "mean":
            chosen = member
        elif self.pool == "lasttoken":
            chosen = member & (within == member.sum(-1, keepdim=True) - 1)
        else:  # cls, and a cross-encoder's first token
            chosen = member & (within == 0)
        weights = chosen.to(hidden.dtype)
        pooled = torch.matmul(weights, hidden)  # (rows, segments, hidden)
        if self.pool == "mean":  # sentence-transformers' mean: the sum over the count, the count at least 1e-9
            pooled = pooled / weights.sum(-1, keepdim=True).clamp(min=1e-9)
        flat = pooled.reshape(rows * self.segments, pooled.shape[-1])
        if self.pool is None:
            features = {self.feature: self.classifier(flat[:, None, :])}
        else:
            features = {"sentence_embedding": flat}
        for head in self.heads:
            features = head(features)
        value = features[self.result]
        value = value if self.activation is None else self.activation(value)
        return value.reshape(rows, self.segments, -1).float()


class SequenceClassifierHead(torch.nn.Module):
    """A transformers sequence classifier's layers after its encoder, on first-token states (batch, 1, hidden):
    BERT's pooler, dropout and classifier, or a RoBERTa-style classifier reading the first token itself."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.pooler = getattr(model.base_model, "pooler", None)
        self.dropout = getattr(model, "dropout", None) if self.pooler is not None else None
        self.classifier = model.classifier

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        if self.pooler is None:
            return self.classifier(first)
        pooled = self.pooler(first)
        return self.classifier(self.dropout(pooled) if self.dropout is not None else pooled)


# Texts a compiled row holds at most: the segments of its output. A row of the longest bucket holds about 20 texts
# of median length in the traffic the embeddings benchmark models (16 tokens, log-normal); 32 leave room for shorter.
SEGMENTS = 32
# Token lengths of the texts the packing check runs packed into one row and alone (with padding after them).
PROBE_LENGTHS = (5, 24, 3)
PROBE_ROW = 36
# Largest difference allowed between a text packed and alone, by the dtype the model computes in: float32 rounding
# of matmuls of other shapes; bfloat16 and float16 round each product's result to 8 or 11 bits.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def position_offset(model: torch.nn.Module) -> int:
    """Where a text's position ids start: after the padding index for RoBERTa-style embeddings (which count a
    text's positions from padding_idx + 1), else 0."""
    embeddings = getattr(model, "embeddings", None) or getattr(getattr(model, "base_model", None), "embeddings", None)
    padding = getattr(embeddings, "padding_idx", None)
    if padding is not None and type(embeddings).__name__.startswith(("Roberta", "XLMRoberta", "Camembert", "MPNet")):
        return int(padding) + 1
    return 0


def windowed(model: torch.nn.Module) -> str | None:
    """The local (sliding-window) attention a model's config sets, which a 4-D mask given to it replaces: its
    local layers would see the whole text packed, a window of it alone."""
    config = model.config
    if getattr(config, "local_attention", None):  # ModernBERT's local layers
        return f"local_attention {config.local_attention}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding_window {config.sliding_window}"
    if getattr(config, "attention_window", None):  # Longformer's
        return f"attention_window {config.attention_window}"
    return None


def exact(packed: PackedPoolingGraph, padded: torch.nn.Module, vocab_size: int, pad_token_id: int) -> str | None:
    """None when ``packed`` gives each of three texts packed into one row what ``padded`` gives it alone, else what
    differs (eagerly, on the host, before anything compiles)."""
    window = windowed(packed.model)
    if window is not None:
        return f"its attention is local ({window}), which a block-diagonal mask given to it would replace"
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, vocab_size, (n,), generator=generator) for n in PROBE_LENGTHS]
    names = packed.names
    row = torch.full((1, PROBE_ROW), pad_token_id, dtype=torch.int64)
    segment = torch.zeros((1, PROBE_ROW), dtype=torch.int64)
    alone_ids = torch.full((len(texts), PROBE_ROW), pad_token_id, dtype=torch.int64)
    alone_mask = torch.zeros((len(texts), PROBE_ROW), dtype=torch.int64)
    at = 0
    for k, ids in enumerate(texts):
        row[0, at:at + len(ids)] = ids
        segment[0, at:at + len(ids)] = k + 1
        alone_ids[k, :len(ids)] = ids
        alone_mask[k, :len(ids)] = 1
        at += len(ids)
    inputs = {"input_ids": row, "attention_mask": segment, "token_type_ids": torch.zeros_like(row)}
    alone = {"input_ids": alone_ids, "attention_mask": alone_mask, "token_type_ids": torch.zeros_like(alone_ids)}
    try:
        with torch.inference_mode():
            got = packed(*(inputs[n] for n in names))[0, :len(texts)]
            want = padded(*(alone[n] for n in names)).reshape(len(texts), -1)
    except Exception as exc:  # noqa: BLE001 - a model refusing a 4-D mask or position ids raises its own kinds
        lines = str(exc).strip().splitlines()
        return f"it fails on a block-diagonal attention mask ({type(exc).__name__}: {lines[0] if lines else ''})"
    difference = float((got - want).abs().max())
    if not difference <= PROBE_TOLERANCE.get(packed.dtype, 1e-4):
        return (f"a text packed beside others differs from the same text alone by {difference:.3g} (its attention "
                f"or positions do not follow the block mask and position ids)")
    return None
