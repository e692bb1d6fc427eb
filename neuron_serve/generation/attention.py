"""Grouped-query attention without copying the keys and values per query head.

transformers' eager attention first repeats each key/value head for the query heads
that share it (``repeat_kv``), so a decode step of a grouped-query model (Llama,
Mistral, Qwen2 with fewer key/value heads than query heads) materializes every layer's
cache prefix that many times over before reading it. This attention multiplies each
group of query heads by its one key/value head instead: the same products, no copy.
It is registered with transformers' ``AttentionInterface`` and used only for the
compile, and only for architectures whose eager attention is exactly this computation
(scaled scores, an additive mask, softmax in float32, no soft-capping or sinks).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

NAME = "neuron_serve_grouped"
# Model types whose eager attention is Llama's (``eager_attention_forward``), kwargs aside.
SAME_AS_LLAMA = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Llama's eager attention with the query heads of a key/value head folded into its rows.

    query (batch, heads, q, head_dim); key, value (batch, kv_heads, k, head_dim); mask
    (batch, 1, q, k), additive. Returns (batch, q, heads, head_dim) and no weights.
    """
    if dropout:  # generation compiles in eval mode, where transformers passes 0
        raise ValueError(f"grouped_attention runs in eval mode only; got dropout={dropout}")
    batch, heads, q, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    # Query heads h = kv * group + g share key/value head kv: rows (g, q) of one matmul.
    folded = query.reshape(batch, kv_heads, group * q, head_dim)
    scores = torch.matmul(folded, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        k = scores.shape[-1]
        scores = (scores.reshape(batch, kv_heads, group, q, k) + attention_mask[:, :, None]).reshape(
            batch, kv_heads, group * q, k)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).reshape(batch, heads, q, head_dim)
    return out.transpose(1, 2).contiguous(), None


def applies(lm: torch.nn.Module) -> bool:
    """Whether ``lm`` shares key/value heads and its eager attention is Llama's."""
    config = lm.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return getattr(config, "model_type", None) in SAME_AS_LLAMA and kv_heads < heads


@contextmanager
def grouped_for_compile(lm: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``lm`` attends with :func:`grouped_attention` where it applies; restored after."""
    if not applies(lm) or not callable(getattr(lm, "set_attn_implementation", None)):
        yield
        return
    from transformers import AttentionInterface  # noqa: PLC0415 - only generation imports transformers

    AttentionInterface.register(NAME, grouped_attention)
    before = lm.config._attn_implementation
    lm.set_attn_implementation(NAME)
    try:
        yield
    finally:
        lm.set_attn_implementation(before)
