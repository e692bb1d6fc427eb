"""The shapes a causal LM is compiled at for generation, and the module and example inputs of each.

A :class:`Shape` names one compiled model: a prefill (prompts x prompt-length bucket), a
decode (rows x context, one or ``decode_steps`` steps, by argmax or sampled), an extend
(prefix caching), a verify (speculation) or the prefill that keeps every position's logits.
:func:`shapes_of` lists a model.yaml's, :func:`slot_module` is what each compiles
(``slots.SlotLM``), :func:`example_inputs` what the engine passes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...buckets.generation import GenerationBuckets
from ..lora import layers as lora_layers
from ..sample.sampler import row_parameters
from .slots import SlotLM


@dataclass(frozen=True)
class Shape:
    """One compiled generation model: ``rows`` sequences of ``tokens`` tokens, attending over ``context`` positions."""

    # "prefill", "decode", "extend" (prefill after a cached prefix), "verify" (speculative proposals), "scored"
    # (a prefill that keeps every position's logits, for prompt logprobs) or "mixed" (``rows`` decode rows and a
    # chunk of ``tokens`` prompt tokens in one call: chunked prefill)
    kind: str
    rows: int
    tokens: int
    context: int
    steps: int = 1  # decode steps in one call
    # Tokens chosen by the sampler from per-row parameters (every prefill and extend; a decode or verify
    # with a sampled row), else by argmax (a decode or verify of greedy rows only: no sampler to pay for).
    sampled: bool = False

    @property
    def label(self) -> str:
        """The bucket label of metrics and logs: prefill_64, decode_8x256, decode_8x256_steps4_sampled."""
        if self.kind == "prefill":
            return f"prefill_{self.tokens}" if self.rows == 1 else f"prefill_{self.rows}x{self.tokens}"
        if self.kind == "scored":
            return f"prefill_{self.tokens}_every_position"
        if self.kind == "extend":
            return f"extend_{self.tokens}x{self.context}"
        sampled = "_sampled" if self.sampled else ""
        if self.kind == "mixed":
            return f"mixed_{self.rows}x{self.tokens}{sampled}"
        if self.kind == "verify":
            return f"verify_{self.rows}x{self.context}_tokens{self.tokens}{sampled}"
        return f"decode_{self.rows}x{self.context}" + (f"_steps{self.steps}" if self.steps > 1 else "") + sampled


def shapes_of(buckets: GenerationBuckets) -> list[Shape]:
    """Every compiled model, in bucket order: prefill buckets (one prompt, then several), then decode (rows-major),
    greedy then sampled."""
    shapes = [Shape("prefill", rows, length, length, sampled=True) for rows, length in buckets.prefills]
    decode = [(rows, context) for rows in buckets.decode_rows for context in buckets.decode_context]
    steps = [1, buckets.decode_steps] if buckets.decode_steps > 1 else [1]
    forms = (False, True) if buckets.sampled else (False,)
    for sampled in forms:
        shapes += [Shape("decode", rows, 1, context, k, sampled) for k in steps for rows, context in decode]
    shapes += [Shape("extend", 1, tokens, context, sampled=True) for tokens, context in buckets.extend]
    shapes += [Shape("mixed", rows, tokens, buckets.max_model_len, sampled=sampled) for sampled in forms
               for rows, tokens in buckets.mixed]
    if buckets.speculative_tokens:
        width = buckets.speculative_tokens + 1
        shapes += [Shape("verify", rows, width, context, sampled=sampled) for sampled in forms
                   for rows, context in decode]
    return shapes


def slot_module(lm: torch.nn.Module, buckets: GenerationBuckets, shape: Shape,
                lora: lora_layers.Layout | None = None) -> SlotLM:
    """The module compiled for ``shape``: ``lm`` around the slot cache (and the LoRA buffers), in that shape's
    form."""
    return SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len,
                  shape.context if shape.kind not in ("prefill", "scored") else None, shape.steps,
                  every_position=shape.kind in ("verify", "scored"), extend=shape.kind == "extend",
                  sampled=shape.sampled, lora=lora, mixed_rows=shape.rows if shape.kind == "mixed" else 0).eval()


def example_inputs(shape: Shape, lora: bool = False) -> tuple[torch.Tensor, ...]:
    """Inputs of ``shape``'s compiled model, as the engine passes them (sampled: with each row's parameters;
    ``lora``: then each row's adapter slot, 0 the base)."""
    if shape.kind == "mixed":  # one sequence: the rows' tokens, then the chunk's; the chunk's slot and last index
        tokens = torch.zeros(1, shape.rows + shape.tokens, dtype=torch.long)
        positions = torch.cat([torch.zeros(shape.rows, dtype=torch.long), torch.arange(shape.tokens)])[None]
        slots = torch.zeros(1, dtype=torch.long)
        last = torch.full((1, 1), shape.tokens - 1, dtype=torch.long)
        rows = shape.rows + 1  # each decode row, and the chunk's
    else:
        tokens = torch.zeros(shape.rows, shape.tokens, dtype=torch.long)
        positions = torch.arange(shape.tokens).expand(shape.rows, shape.tokens).contiguous()
        slots = torch.arange(shape.rows, dtype=torch.long)
        last = torch.full((shape.rows, 1), shape.tokens - 1, dtype=torch.long)
        rows = shape.rows
    inputs = (tokens, positions, slots, last, *(row_parameters([], rows) if shape.sampled else ()))
    return (*inputs, torch.zeros(rows, dtype=torch.long)) if lora else inputs
