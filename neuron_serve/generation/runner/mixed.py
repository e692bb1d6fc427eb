"""The mixed form of :class:`~.slots.SlotLM`: decode rows and a chunk of one prompt in one compiled call.

Chunked prefill, as vLLM v1 and Sarathi-Serve run it: a step that decodes every running sequence also
writes the next chunk of a waiting prompt, so a long prompt never holds the running streams for its whole
prefill. The call is one sequence for the model: ``rows`` tokens, row r's next token at its position (row r is
cache slot r, as in a decode call; a free row carries token 0 at the slot's last position), then the chunk's
``tokens`` tokens at their positions in the chunk's slot (padding repeats its last token at its position, so it
writes what that token writes). Every layer's MLP and projections run once over all of them; each token's key
and value is written at (its slot, its position); attention splits them again (``attention.py``): each decode
row against the first ``context`` positions of its slot (the decode call's static slice), the chunk's tokens
against its slot's (a gather of one slot), causal by position. The logits kept are each row's and the chunk's
last token's: the chunk that ends a prompt gives its first output token.

Only for models whose attention is Llama's (``attention.applies``): the split needs its attention function.
"""

from __future__ import annotations

import torch

from ..precision import kv_cache


class MixedCache(kv_cache.CacheLayers):
    """transformers' cache interface (``update``) of one mixed call: ``rows`` decode rows then a chunk, each token
    at (``token_slots[i]``, ``positions[i]``); attention gets ``rows + 1`` contexts of ``context`` positions (the
    rows' slots, then the chunk's). The new caches are collected in ``keys``/``values``."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, chunk_slot: torch.Tensor,
                 positions: torch.Tensor, context: int, kv: kv_cache.KvCacheFormat | None = None) -> None:
        self.keys, self.values = list(keys), list(values)
        self.rows, self.context, self.kv = rows, context, kv
        self.chunk_slot = chunk_slot  # (1,)
        tokens = positions.shape[0]
        device = positions.device
        token_slots = torch.cat([torch.arange(rows, device=device), chunk_slot.expand(tokens - rows)])
        heads = keys[0].shape[1]
        # Every token's place, broadcast over (tokens, kv_heads[, head_dim]): values (slot, head, position, :),
        # keys (slot, head, :, position) in their transposed layout.
        slot, head, position = token_slots[:, None], torch.arange(heads, device=device)[None, :], positions[:, None]
        self.index = (slot, head, position)
        dim = torch.arange(keys[0].shape[2], device=device)
        self.key_index = (slot[..., None], head[..., None], dim[None, None, :], position[..., None])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: (1, kv_heads, tokens, head_dim); written as (tokens, kv_heads, head_dim).
        kv, dtype = self.kv, key_states.dtype
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        if kv is not None:
            k, v = kv.store(k, layer_idx, "k"), kv.store(v, layer_idx, "v")
        self.keys[layer_idx] = self.keys[layer_idx].index_put(self.key_index, k)
        self.values[layer_idx] = self.values[layer_idx].index_put(self.index, v)
        rows, context = self.rows, self.context
        keys = torch.cat([self.keys[layer_idx][:rows, :, :, :context],
                          self.keys[layer_idx].index_select(0, self.chunk_slot)[:, :, :, :context]]).transpose(2, 3)
        values = torch.cat([self.values[layer_idx][:rows, :, :context],
                            self.values[layer_idx].index_select(0, self.chunk_slot)[:, :, :context]])
        return kv_cache.read_back(kv, keys, values, layer_idx, dtype)


def masks(positions: torch.Tensor, rows: int, context: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks of a mixed call: each decode row's (rows, 1, 1, context) and the chunk's (1, 1, tokens,
    context), every token seeing its slot's positions up to its own."""
    seen = torch.arange(context, device=positions.device)[None, :]
    mask = torch.where(seen <= positions[:, None], 0.0, torch.finfo(dtype).min).to(dtype)
    return mask[:rows, None, None, :], mask[None, None, rows:]
