"""A causal LM with a static KV cache of slots, as bucket_model_trace compiles it.

The cache holds ``max_num_seqs`` slots of ``max_model_len`` positions per layer (keys
and values each ``(slots, positions, kv_heads, head_dim)``); a sequence owns one slot
from its prefill to its end. :class:`SlotLM` runs the transformers model on a batch of
rows, each row one sequence: its tokens, their positions, its slot, and the index of the
row's last real token (whose logits are returned). transformers' own attention layers
call :class:`SlotCache` as their cache; it is the one piece written here, because a
transformers ``StaticCache`` writes every row of a batch at the same positions, where
continuous batching needs each row at its own slot and position.
"""

from __future__ import annotations

import inspect

import torch


class SlotCache:
    """transformers' cache interface (``update``) over per-layer slot caches, functionally.

    ``update`` writes each row's new keys and values at (its slot, its positions) and
    returns the first ``context`` positions of the row's slot, as attention reads them:
    ``(rows, kv_heads, context, head_dim)``. The new caches are collected in
    ``keys``/``values``.
    """

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 positions: torch.Tensor, context: int) -> None:
        self.context = context
        self.keys = list(keys)
        self.values = list(values)
        self.rows = slots[:, None].expand_as(positions)
        self.slots = slots
        self.positions = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: (rows, kv_heads, tokens, head_dim), the layout of transformers' attention.
        index = (self.rows, self.positions)
        self.keys[layer_idx] = self.keys[layer_idx].index_put(index, key_states.transpose(1, 2))
        self.values[layer_idx] = self.values[layer_idx].index_put(index, value_states.transpose(1, 2))
        read = slice(0, self.context)
        return (self.keys[layer_idx][self.slots, read].transpose(1, 2),
                self.values[layer_idx][self.slots, read].transpose(1, 2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.keys)


def cache_shape(config, slots: int, positions: int) -> tuple[int, int, int, int]:
    """One layer's keys (or values): (slots, positions, kv_heads, head_dim), from a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return slots, positions, kv_heads, head_dim


def num_layers(config) -> int:
    return config.num_hidden_layers


def _cache_kwarg(lm: torch.nn.Module) -> str:
    # transformers 5 renames ``past_key_values`` to ``cache``; take whichever the model has.
    params = inspect.signature(lm.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class SlotLM(torch.nn.Module):
    """``lm`` with a slot KV cache as buffers ``k_0, v_0, k_1, ...``, attending over ``context`` positions.

    ``forward(tokens (rows, T), positions (rows, T), slots (rows,), last (rows, 1))`` returns
    ``(logits (rows, vocab), k_0, v_0, ...)``: the logits at each row's ``last`` token
    and the new caches (the aliased outputs 1, 2, ...). Each token sees the positions
    of its slot up to its own (a 4D additive mask), so what a slot held before, or a
    padded prompt wrote past its end, is never read before it is overwritten.

    The new keys and values are written into the whole cache (in place on the core:
    the executable aliases it) and attention reads only the first ``context``
    positions of each row's slot: a decode step costs what its context bucket holds,
    not what the cache could hold.
    """

    def __init__(self, lm: torch.nn.Module, slots: int, positions: int, context: int | None = None) -> None:
        super().__init__()
        self.context = context or positions
        self.lm = lm
        self.kwarg = _cache_kwarg(lm)
        shape = cache_shape(lm.config, slots, positions)
        dtype = next(lm.parameters()).dtype
        self.layers = num_layers(lm.config)
        for i in range(self.layers):
            self.register_buffer(f"k_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros(shape, dtype=dtype), persistent=False)

    def caches(self) -> list[torch.Tensor]:
        """The cache buffers in output order: k_0, v_0, k_1, v_1, ..."""
        return [getattr(self, f"{kind}_{i}") for i in range(self.layers) for kind in ("k", "v")]

    def aliases(self) -> dict:
        """input_output_aliases: cache k is updated from output 1 + k (output 0 is the logits)."""
        return {cache: 1 + i for i, cache in enumerate(self.caches())}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor):
        caches = self.caches()
        length = self.context
        visible = torch.arange(length, device=tokens.device)[None, None, :] <= positions[:, :, None]
        dtype = caches[0].dtype
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
        cache = SlotCache(caches[0::2], caches[1::2], slots, positions, length)
        out = self.lm(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      logits_to_keep=last, **{self.kwarg: cache})
        new = [t for pair in zip(cache.keys, cache.values) for t in pair]
        return (out.logits[:, 0], *new)
