"""Weight-only quantization of a causal LM's linear layers: int8 or fp8 weights, dequantized inside the graph.

NxD Inference's scheme, with vLLM's and NxDI's names (``quantization``: ``int8`` or ``fp8``;
``quantization_type``: ``per_channel_symmetric`` or ``per_tensor_symmetric``; ``modules_to_not_convert``).
Each ``torch.nn.Linear`` of the model, but those left unconverted (the LM head by default; embeddings
are not linear layers and stay as they are), becomes a :class:`QuantizedLinear`: its weight held in
int8 or float8_e4m3fn with a float32 scale per output channel (or one per tensor), symmetric, and
dequantized to the compute dtype inside the compiled graph (``weight.to(dtype) * scale``) before the
product. The core holds the quantized weights and their scales, nothing more: they are the module's
buffers, so every per-core figure that sums a model's tensors counts what is really held.

fp8 is e4m3 within Neuron's range: a NeuronCore's fp8 e4m3 holds magnitudes up to 240, not the
448 of OCP's e4m3fn that torch's ``float8_e4m3fn`` stores, so scales map each channel's largest
weight to 240 and a checkpoint quantized to 448 is rescaled (:func:`fit_neuron_fp8`).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Literal

import torch

from ...errors import ConfigError

logger = logging.getLogger("neuron_serve")

INT8_MAX = 127
NEURON_FP8_MAX = 240.0  # a NeuronCore's fp8 e4m3 range (OCP's e4m3fn reaches 448)
FP8 = torch.float8_e4m3fn
STORAGE = {"int8": torch.int8, "fp8": FP8}
Method = Literal["int8", "fp8"]
Granularity = Literal["per_channel_symmetric", "per_tensor_symmetric"]
DEFAULT_NOT_CONVERTED = ("lm_head",)


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose weight is held quantized (``weight``: int8 or float8_e4m3fn, (out, in)) with its
    scales (``weight_scale``: float32, (out, 1) per channel or (1, 1) per tensor), dequantized to
    ``compute_dtype`` in the forward; ``bias`` (if any) stays in the compute dtype."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.to(torch.float32).reshape(-1, 1))
        if bias is not None:
            self.register_buffer("bias", bias.detach().to(compute_dtype))
        else:
            self.bias = None

    @property
    def method(self) -> str:
        return "int8" if self.weight.dtype == torch.int8 else "fp8"

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.shape[0] > 1

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as the graph computes with it: (out, in) in ``dtype`` (default: the compute dtype)."""
        dtype = dtype or self.compute_dtype
        return self.weight.to(dtype) * self.weight_scale.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.method}, "
                f"{'per channel' if self.per_channel else 'per tensor'}, compute {self.compute_dtype}")


def quantize_weight(weight: torch.Tensor, method: Method,
                    granularity: Granularity = "per_channel_symmetric") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (out, in) quantized symmetrically: (quantized, float32 scale (out, 1) or (1, 1))."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True) if granularity == "per_channel_symmetric" else w.abs().amax().reshape(1, 1)
    top = INT8_MAX if method == "int8" else NEURON_FP8_MAX
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))  # an all-zero channel keeps scale 1
    scaled = w / scale
    if method == "int8":
        return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return scaled.clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(FP8), scale


def fit_neuron_fp8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """An fp8 weight quantized for OCP's 448 range, brought into Neuron's 240 (each channel, or the tensor, whose
    largest magnitude is past it rescaled): (weight, scale, whether anything changed)."""
    scale = scale.to(torch.float32).reshape(-1, 1)
    values = weight.to(torch.float32)
    amax = values.abs().amax(dim=1, keepdim=True) if scale.shape[0] > 1 else values.abs().amax().reshape(1, 1)
    over = amax > NEURON_FP8_MAX
    if not bool(over.any()):
        return weight, scale, False
    factor = torch.where(over, amax / NEURON_FP8_MAX, torch.ones_like(amax))
    return (values / factor).clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(FP8), scale * factor, True


@dataclass(frozen=True)
class WeightQuantization:
    """What ``quantize`` does to a model: the method, the granularity and the modules left as they are."""

    method: Method
    granularity: Granularity = "per_channel_symmetric"
    modules_to_not_convert: tuple[str, ...] = DEFAULT_NOT_CONVERTED

    def converts(self, name: str) -> bool:
        """Whether the linear layer named ``name`` (as in the causal LM: ``model.layers.0.mlp.up_proj``) is
        quantized: not when a pattern of ``modules_to_not_convert`` matches it, its last part, or a prefix."""
        parts = name.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        return not any(fnmatch.fnmatchcase(candidate, pattern) for pattern in self.modules_to_not_convert
                       for candidate in (*prefixes, parts[-1]))

    def describe(self) -> dict:
        return {"method": self.method, "quantization_type": self.granularity,
                "modules_to_not_convert": list(self.modules_to_not_convert)}


def linear_layers(lm: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module of ``lm`` that computes a projection from a weight matrix (what quantization considers)."""
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415 - GPT-2's projections

    return [(name, module) for name, module in lm.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D, QuantizedLinear))]


def quantize(lm: torch.nn.Module, scheme: WeightQuantization, field: str = "generation.quantization") -> int:
    """Replace, in place, every linear layer ``scheme`` converts by a :class:`QuantizedLinear`; returns how many.

    A projection that is not a ``torch.nn.Linear`` (GPT-2's ``Conv1D``) is refused by name: leave it out with
    ``modules_to_not_convert`` or serve the model unquantized."""
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415

    converted = 0
    for name, module in linear_layers(lm):
        if not scheme.converts(name) or isinstance(module, QuantizedLinear):
            continue
        if isinstance(module, Conv1D):
            raise ConfigError(f"{field}: {scheme.method} cannot quantize {name}, a transformers Conv1D (GPT-2's "
                              f"projection layout), not a torch.nn.Linear; add {name.rpartition('.')[2]!r} to "
                              f"generation.modules_to_not_convert, or serve the model without quantization.")
        weight, scale = quantize_weight(module.weight, scheme.method, scheme.granularity)
        replace_module(lm, name, QuantizedLinear(weight, scale, module.bias, module.weight.dtype))
        converted += 1
    if not converted:
        raise ConfigError(f"{field}: {scheme.method} converts no layer of this model (modules_to_not_convert "
                          f"{list(scheme.modules_to_not_convert)} leaves out every linear layer); serve it without "
                          f"quantization or convert fewer modules.")
    return converted


def replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Set submodule ``name`` (dotted) of ``root`` to ``module``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def compute_dtype_of(lm: torch.nn.Module) -> torch.dtype:
    """The dtype ``lm`` computes in: its embeddings' (quantized linear layers hold other dtypes)."""
    return lm.get_input_embeddings().weight.dtype


def quantized_layers(lm: torch.nn.Module) -> list[QuantizedLinear]:
    return [m for m in lm.modules() if isinstance(m, QuantizedLinear)]


def describe(lm: torch.nn.Module) -> dict | None:
    """What ``lm``'s quantized layers hold (None: none is quantized)."""
    layers = quantized_layers(lm)
    if not layers:
        return None
    methods = sorted({m.method for m in layers})
    granularity = sorted({"per_channel_symmetric" if m.per_channel else "per_tensor_symmetric" for m in layers})
    return {"method": methods[0] if len(methods) == 1 else methods, "layers": len(layers),
            "quantization_type": granularity[0] if len(granularity) == 1 else granularity}
