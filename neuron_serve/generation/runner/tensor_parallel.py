"""Tensor parallelism: one causal LM split over a group of cores, Megatron-style.

The split is the model's own, from transformers: each architecture's config names its
``base_model_tp_plan`` (``layers.*.self_attn.q_proj: colwise``, ``o_proj: rowwise``,
...) and its causal-LM class its head's (``lm_head: colwise_gather_output``). So
attention's q/k/v and the MLP's gate/up are split by output features, the output and
down projections by input features (XLA adds the all-reduce after each), the LM head
by vocabulary, and the KV cache by key/value heads (dimension 1 of every cache
tensor). A model with fewer key/value heads than cores keeps its k/v projections and
its cache whole on every core, as NxD Inference replicates them. Nothing here is
written per architecture: an architecture without a plan is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ...compile.sharding import AXIS, Sharding
from ...errors import ConfigError

COLUMN = (AXIS, None)  # a Linear's weight is (out_features, in_features)
ROW = (None, AXIS)
# transformers' style names, as its tensor-parallel integration spells them.
_COLUMN_STYLES = {"colwise", "colwise_rep", "colwise_gather_output", "local_colwise", "packed_colwise"}
_ROW_STYLES = {"rowwise", "rowwise_rep", "local_rowwise", "packed_rowwise"}
_KV = re.compile(r"\.(k_proj|v_proj)$")


@dataclass(frozen=True)
class Shape:
    """What decides a split: heads, key/value heads."""

    heads: int
    kv_heads: int

    @classmethod
    def of(cls, config: Any) -> "Shape":
        heads = config.num_attention_heads
        return cls(heads, getattr(config, "num_key_value_heads", None) or heads)


def kv_replicated(config: Any, size: int) -> bool:
    """Whether the key/value heads (and the cache) stay whole on every core: fewer of them than cores."""
    return size > 1 and Shape.of(config).kv_heads < size


def check(config: Any, size: int, field: str = "generation.tensor_parallel_size") -> None:
    """Refuse a split the model cannot take, naming ``field`` and the numbers."""
    if size < 1:
        raise ConfigError(f"{field}: must be at least 1 (the cores one engine spans), got {size}.")
    if size == 1:
        return
    shape = Shape.of(config)
    model_type = getattr(config, "model_type", type(config).__name__)
    if not getattr(config, "base_model_tp_plan", None):
        raise ConfigError(f"{field}: {size} needs the model's tensor-parallel plan, and {model_type}'s config has no "
                          f"base_model_tp_plan; serve it with tensor_parallel_size 1 (one core per engine).")
    if shape.heads % size:
        raise ConfigError(f"{field}: {size} does not divide the model's {shape.heads} attention heads "
                          f"(num_attention_heads); choose a tensor_parallel_size that divides {shape.heads}.")
    if shape.kv_heads >= size and shape.kv_heads % size:
        raise ConfigError(f"{field}: {size} does not divide the model's {shape.kv_heads} key/value heads "
                          f"(num_key_value_heads); choose a tensor_parallel_size that divides {shape.kv_heads}, or "
                          f"one above it (the key/value heads are then kept whole on every core).")


def _rules(lm: torch.nn.Module) -> list[tuple[re.Pattern, str]]:
    """(pattern over SlotLM's module names, style), from the config's plan and the head's."""
    prefix = getattr(lm, "base_model_prefix", "model")
    plans = [(f"lm.{prefix}.", dict(lm.config.base_model_tp_plan or {})),
             ("lm.", dict(getattr(type(lm), "_tp_plan", None) or {}))]
    rules = []
    for root, plan in plans:
        for key, style in plan.items():
            pattern = re.escape(root + key).replace(r"\*", r"\d+")
            rules.append((re.compile(pattern + "$"), style))
    return rules


def plan(lm: torch.nn.Module, size: int) -> Sharding:
    """The split of ``lm``'s weights (named as in SlotLM: ``lm.model.layers.0...``) and cache over ``size`` cores."""
    rules = _rules(lm)
    replicate_kv = kv_replicated(lm.config, size)
    weights: dict[str, tuple] = {}
    for name, module in lm.named_modules(prefix="lm"):
        style = next((s for pattern, s in rules if pattern.match(name)), None)
        if style is None or (replicate_kv and _KV.search(name)):
            continue
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if style in _COLUMN_STYLES:
            weights[f"{name}.weight"] = COLUMN
            if isinstance(bias, torch.Tensor):
                weights[f"{name}.bias"] = (AXIS,)
            scale = getattr(module, "weight_scale", None)  # a quantized layer's: split with its output channels
            if isinstance(scale, torch.Tensor) and scale.shape[0] > 1:
                weights[f"{name}.weight_scale"] = COLUMN
        elif style in _ROW_STYLES:
            weights[f"{name}.weight"] = ROW
    return Sharding(size, weights, state=None if replicate_kv else (None, AXIS, None, None))


def bytes_per_core(lm: torch.nn.Module, sharding: Sharding | None) -> int:
    """Bytes of ``lm``'s weights each core holds: a split weight's share, every other weight whole."""
    split = sharding.weights if sharding is not None else {}
    seen, total = set(), 0
    for name, tensor in [*lm.named_parameters(prefix="lm"), *lm.named_buffers(prefix="lm")]:
        if id(tensor) in seen:  # tied weights are held once
            continue
        seen.add(id(tensor))
        numel = tensor.numel()
        if name in split:
            dim = split[name].index(AXIS)
            numel = numel // tensor.shape[dim] * -(-tensor.shape[dim] // sharding.devices)
        total += numel * tensor.element_size()
    return total
