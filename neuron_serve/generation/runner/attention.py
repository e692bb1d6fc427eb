"""Grouped-query attention without copying the keys and values per query head.

transformers' eager attention first repeats each key/value head for the query heads
that share it (``repeat_kv``), so a decode step of a grouped-query model (Llama,
Mistral, Qwen2 with fewer key/value heads than query heads) materializes every layer's
cache prefix that many times over before reading it. This attention multiplies each
group of query heads by its one key/value head instead: the same products, no copy.
It is registered with transformers' ``AttentionInterface`` and used only for the
compile, and only for architectures whose eager attention is exactly this computation
(scaled scores, an additive mask, softmax in float32, no soft-capping or sinks).

A prefill's attention is causal over the prompt's own keys, so half of its scores are
masked out. Given ``prefill_blocks`` n, its query rows go in n blocks, block i against
the keys of blocks 0..i only: the scores it skips are all masked, so the output is the
same with (n + 1) / 2n of the products. This is for a core that computes one operation
at a time (a NeuronCore, or an emulated one on one XLA:CPU thread): there a 480-token
prompt of a 4-layer Qwen2 (512 bucket) took 12.0 ms where it took 14.0, a 310-token one
8.3 where 9.8 (8 blocks: no better; a 128 bucket: no gain). Where XLA:CPU splits each
operation over 2 threads, the smaller products lost (9.1 to 9.5 ms, 6.0 to 7.0), so
there a prefill attends whole.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

NAME = "neuron_serve_grouped"
# Model types whose eager attention is Llama's (``eager_attention_forward``), kwargs aside.
SAME_AS_LLAMA = frozenset({"llama", "mistral", "qwen2", "qwen3"})
PREFILL_BLOCKS, BLOCKED_FROM = 4, 256  # a prefill of at least BLOCKED_FROM tokens attends in PREFILL_BLOCKS blocks


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      prefill_blocks: int = 0, mixed_rows: int = 0, mixed_masks: tuple | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """Llama's eager attention with the query heads of a key/value head folded into its rows.

    query (batch, heads, q, head_dim); key, value (batch, kv_heads, k, head_dim); mask
    (batch, 1, q, k), additive. Returns (batch, q, heads, head_dim) and no weights.
    ``prefill_blocks``: the keys are the queries' own positions under a causal mask; see
    the module docstring.
    """
    if dropout:  # generation compiles in eval mode, where transformers passes 0
        raise ValueError(f"grouped_attention runs in eval mode only; got dropout={dropout}")
    if mixed_rows:
        return _mixed(query, key, value, mixed_rows, mixed_masks, scaling), None
    q, k = query.shape[2], key.shape[2]
    if prefill_blocks > 1 and q == k and q >= BLOCKED_FROM:
        size, outs = q // prefill_blocks, []
        for i in range(prefill_blocks):
            start, end = i * size, (q if i == prefill_blocks - 1 else (i + 1) * size)
            mask = None if attention_mask is None else attention_mask[:, :, start:end, :end]
            outs.append(_grouped(query[:, :, start:end], key[:, :, :end], value[:, :, :end], mask, scaling))
        return torch.cat(outs, dim=1), None
    return _grouped(query, key, value, attention_mask, scaling), None


def _mixed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: int, masks: tuple,
           scaling: float) -> torch.Tensor:
    """A mixed call's attention (mixed.py): query (1, heads, rows + tokens, head_dim), its first ``rows`` tokens each
    a decode row against its own context, the rest a chunk against the last one; key, value (rows + 1, kv_heads,
    context, head_dim); masks (rows, 1, 1, context) and (1, 1, tokens, context). Returns (1, rows + tokens, heads,
    head_dim)."""
    decode_mask, chunk_mask = masks
    heads, head_dim = query.shape[1], query.shape[3]
    decoded = _grouped(query[0, :, :rows].transpose(0, 1)[:, :, None], key[:rows], value[:rows], decode_mask, scaling)
    chunk = _grouped(query[:, :, rows:], key[rows:], value[rows:], chunk_mask, scaling)
    return torch.cat([decoded.reshape(1, rows, heads, head_dim), chunk], dim=1)


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
             scaling: float) -> torch.Tensor:
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
    return out.transpose(1, 2).contiguous()


def applies(lm: torch.nn.Module) -> bool:
    """Whether ``lm``'s eager attention is Llama's (with as many key/value heads as query heads, or fewer)."""
    return getattr(lm.config, "model_type", None) in SAME_AS_LLAMA


def prefill_blocks() -> int:
    """The blocks a prefill attends in on this process's cores (see the module docstring); 0: whole."""
    from ...targets.pjrt import computes_in_sequence  # noqa: PLC0415

    return PREFILL_BLOCKS if computes_in_sequence() else 0


def in_use(lm: torch.nn.Module) -> bool:
    """Whether ``lm`` attends with :func:`grouped_attention` (within :func:`grouped_for_compile`)."""
    return getattr(lm.config, "_attn_implementation", None) == NAME


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
