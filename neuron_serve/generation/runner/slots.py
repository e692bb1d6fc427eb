"""A causal LM with a static KV cache of slots, as bucket_model_trace compiles it.

The cache holds ``max_num_seqs`` slots of ``max_model_len`` positions per layer: values
``(slots, kv_heads, positions, head_dim)``, keys transposed, ``(slots, kv_heads, head_dim,
positions)``. Attention multiplies the query by the keys transposed; stored that way, the
keys it transposes are read as they lie, where XLA:CPU otherwise copied every layer's
key cache into that layout at each decode step (a 32-row step over 512 positions of a
4-layer model: 13.2 to 9.0 ms). A sequence owns one slot from its prefill to its end.
transformers' own attention layers call :class:`SlotCache` as their cache; it is the
one piece written here, because a transformers
``StaticCache`` writes every row of a batch at the same positions, where continuous
batching needs each sequence at its own slot and position.

:class:`SlotLM` runs in one of these forms, each compiled per bucket:

- prefill (``context=None``): a prompt a row, padded, each written into its row's slot at
  positions 0..T-1; its attention reads only its own new keys and values, never the cache.
- decode (``context=C``): row r is slot r, one token each at its own position;
  attention reads the first C positions of slots 0..rows-1, a static slice of the
  cache (no gather). Rows whose slot is free carry token 0 at the last position, which
  writes only there, in that free slot, where no cached prefix is ever kept.
- verify (``context=C, every_position=True``): decode of T tokens a row, each row's last
  token and its proposals, with the logits and argmax at every one.
- extend (``context=C, extend=True``): one row of T tokens written into its own slot at
  their positions (after a prefix already in the slot, as prefix caching reuses one);
  attention reads the first C positions of that slot (a gather of one slot), so the
  suffix sees the cached prefix and itself.
- mixed (``context=C, mixed_rows=R``): R decode rows and a chunk of a prompt in one call
  (chunked prefill; ``mixed.py``).
"""

from __future__ import annotations

import contextlib

import torch

from . import attention, mixed
from ..precision import kv_cache
from ..lora import layers as lora_layers
from ..precision.quantization import compute_dtype_of as compute_dtype
from ..sample.sampler import sample


class SlotCache(kv_cache.CacheLayers):
    """transformers' cache interface (``update``) over per-layer slot caches, functionally.

    ``update`` writes each row's new keys and values at (its slot, its positions) and
    returns what attention reads: the first ``context`` positions of the rows' slots,
    or (``context=None``) the new keys and values themselves. The new caches are
    collected in ``keys``/``values``.
    """

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 positions: torch.Tensor, context: int | None, by_slot: bool = False,
                 kv: kv_cache.KvCacheFormat | None = None) -> None:
        self.keys = list(keys)
        self.kv = kv  # fp8 keys and values with their scales (precision/kv_cache.py); None: the compute dtype
        self.slots = slots
        self.by_slot = by_slot  # read the rows' own slots (extend), not slots 0..rows-1 (decode)
        self.values = list(values)
        heads = keys[0].shape[1]
        # Index tensors broadcasting to (rows, kv_heads, tokens): the places the new values go.
        # The keys' index every element, (rows, kv_heads, tokens, head_dim): leaving head_dim
        # to a slice made XLA transpose the whole key cache around the scatter.
        slot, head, position = (slots[:, None, None], torch.arange(heads, device=slots.device)[None, :, None],
                                positions[:, None, :])
        self.index = (slot, head, position)
        dim = torch.arange(keys[0].shape[2], device=slots.device)
        self.key_index = (slot[..., None], head[..., None], dim, position[..., None])
        self.rows = slots.shape[0]
        self.context = context

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states, value_states: (rows, kv_heads, tokens, head_dim), transformers' layout.
        kv, dtype = self.kv, key_states.dtype
        stored_k = kv.store(key_states, layer_idx, "k") if kv is not None else key_states
        stored_v = kv.store(value_states, layer_idx, "v") if kv is not None else value_states
        self.keys[layer_idx] = self.keys[layer_idx].index_put(self.key_index, stored_k)
        self.values[layer_idx] = self.values[layer_idx].index_put(self.index, stored_v)
        if self.context is None:  # a prefill reads its own keys and values, as the cache holds them
            return kv_cache.read_back(kv, stored_k, stored_v, layer_idx, dtype)
        if self.by_slot:
            keys = self.keys[layer_idx].index_select(0, self.slots)[:, :, :, :self.context].transpose(2, 3)
            values = self.values[layer_idx].index_select(0, self.slots)[:, :, :self.context]
        else:
            keys = self.keys[layer_idx][:self.rows, :, :, :self.context].transpose(2, 3)
            values = self.values[layer_idx][:self.rows, :, :self.context]
        return kv_cache.read_back(kv, keys, values, layer_idx, dtype)


def weights_of(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``lm``'s parameters and buffers by the names :class:`SlotLM`'s compiled models take them as inputs (``lm.``
    and the name in ``lm``; a tied weight under each of its names)."""
    named = [*lm.named_parameters(remove_duplicate=False), *lm.named_buffers(remove_duplicate=False)]
    return {f"lm.{name}": tensor.detach() for name, tensor in named}


def cache_element_bytes(lm: torch.nn.Module) -> int:
    """Bytes of one element of ``lm``'s slot cache: its compute dtype's, or one in fp8 (precision/kv_cache.py)."""
    return kv_cache.cache_dtype(lm, compute_dtype(lm)).itemsize


def cache_shape(config, slots: int, positions: int) -> tuple[int, int, int, int]:
    """One layer's values, (slots, kv_heads, positions, head_dim), from a transformers config (keys: dims 2, 3 swapped)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return slots, kv_heads, positions, head_dim


def kv_cache_bytes(config, slots: int, positions: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values of ``slots`` x ``positions`` for a transformers config."""
    s, p, heads, head_dim = cache_shape(config, slots, positions)
    return 2 * config.num_hidden_layers * s * p * heads * head_dim * dtype_bytes


class SlotLM(torch.nn.Module):
    """``lm`` with a slot KV cache as buffers ``k_0, v_0, k_1, ...``; see the module docstring.

    ``forward(tokens (rows, T), positions (rows, T), slots (rows,), last (rows, 1))`` returns
    ``(logits (rows, vocab), tokens (rows,), k_0, v_0, ...)``: the logits at each row's
    ``last`` token, their argmax, and the new caches (the aliased outputs 2, 3, ...). Sampled
    (``sampled``), it also takes each row's sampling parameters (``floats``, ``ints``, as
    :func:`~.sampler.row_parameters` makes them) and returns ``(logits, tokens, done, k_0, ...)``. Each token sees the positions
    up to its own (a 4D additive mask), so what a slot held before, or a padded prompt
    wrote past its end, is never read before it is overwritten. The new keys and values
    are written into the whole cache, in place on the core (the executable aliases it).
    Decode (``context`` given) ignores ``slots``: row r is slot r; extend reads each row's slot. With ``steps`` K above 1
    (decode only) the call runs K steps, each feeding its choice back at the next position,
    and ``tokens`` is (rows, K); the logits are the last step's, or, sampled, every step's (rows, K,
    vocab), for a row whose choice at some step falls to the host.
    """

    def __init__(self, lm: torch.nn.Module, slots: int, positions: int, context: int | None = None,
                 steps: int = 1, every_position: bool = False, extend: bool = False, sampled: bool = False,
                 lora: lora_layers.Layout | None = None, mixed_rows: int = 0) -> None:
        super().__init__()
        # Mixed (chunked prefill): inputs are one sequence, ``mixed_rows`` decode rows' tokens then a chunk's; slots
        # is the chunk's slot, last its last token's index in the chunk; outputs are mixed_rows + 1 rows.
        self.mixed_rows = mixed_rows
        self.lm = lm
        self.context = context
        self.extend = extend  # with context: the rows' own slots, after what they hold (see the module docstring)
        self.steps = steps
        # Output 0 is the logits at every position: (1, T, vocab) of a prefill, for prompt logprobs; (rows, T,
        # vocab) of a decode of T tokens a row, verifying speculative proposals (output 1 then every choice).
        self.every_position = every_position
        # Sampled: each row's token chosen by sampler.sample from its parameters (inputs 4 and 5), with a
        # ``done`` output; else the argmax, as a batch of greedy rows wants it at no more cost.
        self.sampled = sampled
        self.kwarg = kv_cache.cache_kwarg(lm)
        shape = cache_shape(lm.config, slots, positions)
        dtype = compute_dtype(lm)
        self.compute_dtype = dtype
        self.kv = kv_cache.of(lm)
        stored = kv_cache.cache_dtype(lm, dtype)
        self.layers = lm.config.num_hidden_layers
        keys = (*shape[:2], shape[3], shape[2])
        # Zeros of one element each, seen whole: the cache a trace takes (its state inputs, lifted), never written in
        # place, so each compiled model's trace does not allocate a cache of its own.
        for i in range(self.layers):
            self.register_buffer(f"k_{i}", torch.zeros((), dtype=stored).expand(keys), persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros((), dtype=stored).expand(shape), persistent=False)
        # LoRA: the adapter buffers, state beside the cache (read, returned unchanged), and each row's adapter
        # slot as the last input (lora/layers.py).
        self.lora = lora
        for i, buffer in enumerate(lora_layers.buffers(lora, dtype) if lora is not None else []):
            self.register_buffer(f"lora_{i}", buffer, persistent=False)

    def caches(self) -> list[torch.Tensor]:
        """The cache buffers in output order: k_0, v_0, k_1, v_1, ..."""
        return [getattr(self, f"{kind}_{i}") for i in range(self.layers) for kind in ("k", "v")]

    def adapter_buffers(self) -> list[torch.Tensor]:
        """The LoRA buffers (A and B of each target), in state order after the caches; none without LoRA."""
        count = 2 * len(self.lora.targets) if self.lora is not None else 0
        return [getattr(self, f"lora_{i}") for i in range(count)]

    def states(self) -> list[torch.Tensor]:
        """Every state tensor, in the shared state's order: the caches, then the adapter buffers."""
        return [*self.caches(), *self.adapter_buffers()]

    @property
    def outputs_before_cache(self) -> int:
        """Outputs ahead of the new caches: logits and tokens, and ``done`` when sampled."""
        return 3 if self.sampled else 2

    def aliases(self) -> dict:
        """input_output_aliases: each state is updated from its output, after the logits, tokens (and done): the
        caches from their new values, the adapter buffers from themselves (returned unchanged: no copy)."""
        return {state: self.outputs_before_cache + i for i, state in enumerate(self.states())}

    def _choose(self, logits: torch.Tensor, floats: torch.Tensor | None, ints: torch.Tensor | None,
                step: int = 0) -> tuple[torch.Tensor, ...]:
        """(tokens,) by argmax, or (tokens, done) sampled; ``step`` is the call's step (its tokens' index)."""
        if not self.sampled:
            return (logits.argmax(-1),)
        return sample(logits, floats, ints, counter_offset=step)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                *extra: torch.Tensor):
        """``extra``: the sampling parameters (floats, ints) when sampled, then each row's adapter slot (rows,)
        with LoRA."""
        floats, ints = extra[:2] if self.sampled else (None, None)
        adapters = extra[-1] if self.lora is not None else None
        chosen = self._forward(tokens, positions, slots, last, floats, ints, adapters)
        return (*chosen, *self.adapter_buffers())

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                 floats: torch.Tensor | None, ints: torch.Tensor | None,
                 adapters: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        caches = self.caches()
        if self.mixed_rows:
            logits, caches = self._mixed(tokens, positions, slots, last, caches, adapters)
            return (logits, *self._choose(logits, floats, ints), *caches)
        if self.every_position and self.context is not None:  # verify: every position's logits and choice
            logits, caches = self._step(tokens, positions, slots, None, caches, adapters)  # (rows, T, vocab)
            rows, width = tokens.shape
            if not self.sampled:
                return (logits, logits.argmax(-1), *caches)
            # Position j chooses the row's token j of this call: its counter advances along the row.
            offsets = torch.stack([torch.zeros_like(positions[0]), torch.zeros_like(positions[0]),
                                   torch.arange(width, device=tokens.device)], 1).to(ints.dtype)
            chosen, done = sample(logits.reshape(rows * width, -1), floats.repeat_interleave(width, 0),
                                  ints.repeat_interleave(width, 0) + offsets.repeat(rows, 1))
            return (logits, chosen.view(rows, width), done.view(rows, width), *caches)
        if self.every_position:
            logits, caches = self._step(tokens, positions, slots, None, caches, adapters)  # (rows, T, vocab)
            at_last = logits.gather(1, last[:, :, None].expand(-1, -1, logits.shape[-1]))[:, 0]
            return (logits, *self._choose(at_last, floats, ints), *caches)
        if self.context is None or self.steps == 1:
            logits, caches = self._step(tokens, positions, slots, last, caches, adapters)
            # The choice on the core: a call takes home one id a row (and a flag), not the logits.
            return (logits, *self._choose(logits, floats, ints), *caches)
        chosen, done, every = [], [], []
        for step in range(self.steps):  # unrolled: each step's token and cache feed the next, on the core
            logits, caches = self._step(tokens, positions, slots, last, caches, adapters)
            choice = self._choose(logits, floats, ints, step)
            tokens = choice[0][:, None]
            chosen.append(tokens)
            if self.sampled:  # a row a step could not choose is chosen on the host, from that step's logits
                done.append(choice[1])
                every.append(logits)
            positions = positions + 1
        if not self.sampled:
            return (logits, torch.cat(chosen, dim=1), *caches)
        return (torch.stack(every, 1), torch.cat(chosen, dim=1), torch.stack(done, 1), *caches)

    def _mixed(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
               caches: list[torch.Tensor], adapters: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One mixed call (mixed.py): the logits of each decode row and of the chunk's last token, (rows + 1, vocab),
        and the new caches."""
        rows = self.mixed_rows
        cache = mixed.MixedCache(caches[0::2], caches[1::2], rows, slots, positions[0], self.context, self.kv)
        decode_mask, chunk_mask = mixed.masks(positions[0], rows, self.context, self.compute_dtype)
        kept = torch.cat([torch.arange(rows, device=tokens.device), rows + last[0]])
        with lora_layers.applied(self.lm, self.lora, self.adapter_buffers(), adapters, mixed_rows=rows) \
                if self.lora is not None else contextlib.nullcontext():
            out = self.lm(input_ids=tokens, position_ids=positions, attention_mask=chunk_mask, use_cache=True,
                          logits_to_keep=kept, mixed_rows=rows, mixed_masks=(decode_mask, chunk_mask),
                          **{self.kwarg: cache})
        return out.logits[0].float(), [t for pair in zip(cache.keys, cache.values) for t in pair]

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
              caches: list[torch.Tensor], adapters: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        dtype = self.compute_dtype
        if self.context is None:  # prefill: the prompt's own positions
            seen = positions[:, None, :]
        else:  # decode (row r is slot r) or extend (each row its slot): the first ``context`` positions
            if not self.extend:
                slots = torch.arange(tokens.shape[0], device=tokens.device)
            seen = torch.arange(self.context, device=tokens.device)[None, None, :]
        visible = seen <= positions[:, :, None]
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]
        cache = SlotCache(caches[0::2], caches[1::2], slots, positions, self.context, by_slot=self.extend, kv=self.kv)
        # A prefill attends causally to its own keys only: skip the masked blocks (attention.py).
        blocks = {"prefill_blocks": attention.prefill_blocks()} \
            if self.context is None and attention.in_use(self.lm) else {}
        with lora_layers.applied(self.lm, self.lora, self.adapter_buffers(), adapters) \
                if self.lora is not None else contextlib.nullcontext():
            out = self.lm(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                          logits_to_keep=0 if last is None else last, **{self.kwarg: cache}, **blocks)
        logits = out.logits if last is None else out.logits[:, 0]
        # Logits leave in float32 whatever the compute dtype: the sampler and the host's choices read them so.
        return logits.float(), [t for pair in zip(cache.keys, cache.values) for t in pair]
