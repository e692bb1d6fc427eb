"""A causal LM in the precision its model.yaml asks for: ``dtype``, ``quantization`` and ``kv_cache_dtype``.

:func:`prepare` runs once, at load, before anything is compiled or measured: the model is cast to its
compute dtype, its linear layers quantized (quantization.py; a checkpoint quantized already keeps its own,
checkpoint.py), and the KV cache's format attached (kv_cache.py: fp8 scales from the checkpoint or
measured now). Every later step reads the prepared model: the slot cache's dtype, the per-core
memory figures, the tensor-parallel plan (scales split with their weights), LoRA's buffers (in the
compute dtype), the compiled graphs. :func:`describe` is what the server says of it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...config.generation import GenerationSettings
from ...errors import ConfigError
from . import kv_cache, quantization
from .checkpoint import CheckpointQuantization

logger = logging.getLogger("neuron_serve")

CHECKPOINT = "neuron_serve_checkpoint_quantization"


def prepare(lm: torch.nn.Module, settings: GenerationSettings, *, dtype: torch.dtype,
            checkpoint: CheckpointQuantization | None = None, tokenizer: Any = None,
            kv_tensors: dict[str, torch.Tensor] | None = None, field_prefix: str = "generation.") -> torch.nn.Module:
    """``lm`` cast to ``dtype``, quantized and given its KV cache format, as ``settings`` say (in place).

    ``checkpoint``: the quantization the checkpoint was loaded with (its layers already quantized);
    ``kv_tensors``: the checkpoint's tensors that may hold KV cache scales; ``tokenizer``: for the prompts
    that measure them (random ids without one)."""
    if quantization.compute_dtype_of(lm) != dtype:
        _cast(lm, dtype)
    setattr(lm, CHECKPOINT, checkpoint)
    if checkpoint is not None:
        _agree(settings, checkpoint, field_prefix)
    elif settings.quantization is not None:
        scheme = quantization.WeightQuantization(settings.quantization, settings.quantization_type,
                                                 tuple(settings.modules_to_not_convert
                                                       if settings.modules_to_not_convert is not None
                                                       else quantization.DEFAULT_NOT_CONVERTED))
        count = quantization.quantize(lm, scheme, f"{field_prefix}quantization")
        logger.info("quantized %d linear layers to %s (%s), dequantized to %s in the compiled graphs", count,
                    settings.quantization, settings.quantization_type.replace("_", " "), _name(dtype))
    kv_cache.attach(lm, _kv_format(lm, settings, tokenizer, kv_tensors or {}, field_prefix))
    return lm


def _cast(lm: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point tensor of ``lm`` but quantized weights and their scales, to ``dtype``."""
    keep = {id(t) for m in quantization.quantized_layers(lm) for t in (m.weight, m.weight_scale)}
    for module in lm.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is None or id(tensor) in keep or not tensor.is_floating_point() or tensor.dtype == dtype:
                continue
            if name == "inv_freq":  # rotary frequencies stay in float32, as transformers keeps them
                continue
            cast = tensor.detach().to(dtype)
            if isinstance(tensor, torch.nn.Parameter):
                module._parameters[name] = torch.nn.Parameter(cast, requires_grad=False)
            else:
                module._buffers[name] = cast
    for module in quantization.quantized_layers(lm):
        module.compute_dtype = dtype
    if hasattr(lm, "tie_weights"):
        lm.tie_weights()
    if hasattr(lm, "config"):
        lm.config.dtype = dtype


def _agree(settings: GenerationSettings, checkpoint: CheckpointQuantization, field_prefix: str) -> None:
    """A model.yaml that asks for another quantization than the checkpoint's is refused, naming both."""
    if settings.quantization is not None and settings.quantization != checkpoint.method:
        raise ConfigError(f"{field_prefix}quantization: {settings.quantization}, but the checkpoint is quantized to "
                          f"{checkpoint.method} already ({checkpoint.tool}, its config.json's quantization_config); "
                          f"remove {field_prefix}quantization to serve it as it is, or serve a full-precision "
                          f"checkpoint to quantize it to {settings.quantization}.")
    if "quantization_type" in settings.model_fields_set and settings.quantization_type != checkpoint.granularity:
        raise ConfigError(f"{field_prefix}quantization_type: {settings.quantization_type}, but the checkpoint's fp8 "
                          f"weights are {checkpoint.granularity} ({checkpoint.tool}); remove "
                          f"{field_prefix}quantization_type (a quantized checkpoint is served as it is).")
    if settings.modules_to_not_convert is not None:
        raise ConfigError(f"{field_prefix}modules_to_not_convert: the checkpoint is quantized already ({checkpoint.tool}"
                          f"; its quantization_config says which layers); remove {field_prefix}modules_to_not_convert.")


def _kv_format(lm: torch.nn.Module, settings: GenerationSettings, tokenizer: Any,
               tensors: dict[str, torch.Tensor], field_prefix: str) -> kv_cache.KvCacheFormat | None:
    if settings.kv_cache_dtype == "auto":
        return None
    layers = lm.config.num_hidden_layers
    stored = kv_cache.from_checkpoint(tensors, layers) if settings.calculate_kv_scales is not True else None
    if stored is not None:
        return stored
    if settings.calculate_kv_scales is False:
        raise ConfigError(f"{field_prefix}calculate_kv_scales: false, but the checkpoint has no k_scale and v_scale "
                          f"for every layer; set it true (or remove it) to measure them at start-up: an fp8 cache "
                          f"with a scale of 1.0 loses most of its accuracy.")
    vocab = int(lm.get_output_embeddings().weight.shape[0])
    measured = kv_cache.calibrate(lm, kv_cache.calibration_prompts(tokenizer, vocab))
    logger.info("KV cache in fp8 (e4m3): scales measured on %d prompts (keys %.4g..%.4g, values %.4g..%.4g)",
                len(kv_cache.CALIBRATION_TEXTS), min(measured.k_scales), max(measured.k_scales),
                min(measured.v_scales), max(measured.v_scales))
    return measured


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(lm: torch.nn.Module) -> dict:
    """What the server says of the model's precision: ``dtype``, ``quantization`` (none, int8 or fp8, and where
    from) and ``kv_cache_dtype``."""
    quantized = quantization.describe(lm)
    checkpoint = getattr(lm, CHECKPOINT, None)
    form = kv_cache.of(lm)
    said = {"dtype": _name(quantization.compute_dtype_of(lm)),
            "quantization": quantized["method"] if quantized else None,
            "kv_cache_dtype": "fp8_e4m3" if form is not None else "auto"}
    if quantized:
        said["quantization_type"] = quantized["quantization_type"]
        said["quantized_layers"] = quantized["layers"]
        said["quantized_by"] = checkpoint.tool if checkpoint is not None else "neuron-serve"
    if form is not None:
        said["kv_cache_scales"] = form.source
    return said
