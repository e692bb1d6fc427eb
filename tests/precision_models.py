"""The eager references of quantized serving, written here from the definitions and not from neuron-serve's code:
a model whose linear weights were quantized and dequantized by hand, and transformers' cache with every key and
value rounded through fp8 with given scales."""

from __future__ import annotations

import copy
import inspect

import torch
import transformers

NEURON_FP8_MAX = 240.0  # a NeuronCore's e4m3 range


def dequantized_copy(model: torch.nn.Module, method: str, per_channel: bool = True,
                     skip: tuple[str, ...] = ("lm_head",)) -> torch.nn.Module:
    """A copy of ``model`` whose ``torch.nn.Linear`` weights (but ``skip``) are quantized symmetrically to int8 (127
    levels) or fp8 e4m3 (within +-240), per output channel or per tensor, and dequantized back to their dtype."""
    copied = copy.deepcopy(model)
    for name, module in copied.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rpartition(".")[2] in skip:
            continue
        w = module.weight.data.float()
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
        if method == "int8":
            scale = amax / 127
            q = (w / scale).round().clamp(-127, 127)
        else:
            scale = amax / NEURON_FP8_MAX
            q = (w / scale).clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(torch.float8_e4m3fn).float()
        module.weight.data = (q * scale).to(module.weight.dtype)
    return copied


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5 names the cache argument ``cache`` (``past_key_values`` before); PEFT's model passes it on."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Fp8RoundingCache(transformers.DynamicCache):
    """transformers' dynamic cache, every key and value it keeps (and hands attention) rounded through fp8 e4m3 with
    layer i's ``k_scales[i]`` and ``v_scales[i]``."""

    def __init__(self, k_scales, v_scales, config=None) -> None:
        super().__init__(config=config)
        self.k_scales, self.v_scales = list(k_scales), list(v_scales)

    @staticmethod
    def _round(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x / scale).clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._round(key_states, self.k_scales[layer_idx]),
                              self._round(value_states, self.v_scales[layer_idx]), layer_idx, *args, **kwargs)


def rounded_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int, k_scales, v_scales) -> list[int]:
    """transformers' greedy generation with the fp8-rounding cache."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False,
                             **{cache_kwarg(model): Fp8RoundingCache(k_scales, v_scales, model.config)})
    return out[0, len(prompt):].tolist()


def rounded_logits(model: torch.nn.Module, ids: list[int], k_scales, v_scales) -> torch.Tensor:
    """Every position's logits (float32) of ``ids`` in one forward through the fp8-rounding cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True,
                     **{cache_kwarg(model): Fp8RoundingCache(k_scales, v_scales, model.config)}).logits[0].float()


class RoundedModel(torch.nn.Module):
    """``model`` called as transformers' model is (``model(ids).logits``) with the fp8-rounding cache on every call:
    what tests/generation_models.eager_sampled runs to know a sampled request's tokens."""

    def __init__(self, model: torch.nn.Module, k_scales, v_scales) -> None:
        super().__init__()
        self.model, self.k_scales, self.v_scales = model, k_scales, v_scales

    def forward(self, ids: torch.Tensor):
        return self.model(ids, use_cache=True, **{cache_kwarg(self.model): Fp8RoundingCache(
            self.k_scales, self.v_scales, self.model.config)})
