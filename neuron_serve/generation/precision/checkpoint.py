"""Checkpoints quantized already: fp8 weights as llm-compressor (compressed-tensors) and ModelOpt write them.

Such a checkpoint's ``config.json`` carries a ``quantization_config``: compressed-tensors' (read with that
library: its schemes, what they target and ignore, its ``kv_cache_scheme``) of format ``float-quantized``
with 8-bit float weights per tensor or per channel, or ModelOpt's (``quant_method: modelopt``, ``quant_algo:
FP8``, per tensor). Its linear layers' ``weight`` (float8_e4m3fn) and ``weight_scale`` are loaded as they are,
not quantized again, into :class:`~.quantization.QuantizedLinear` layers; a weight past a NeuronCore's fp8
range (240; the checkpoint's is OCP's 448) is rescaled, and a log line says how many were. Activation
quantization the checkpoint asks for (its ``input_activations``, ``input_scale``) is not applied: weights
are dequantized in the graph and activations stay in the compute dtype, NxD Inference's weight-only scheme,
which a log line says too. Anything else (int4, groups, blocks) is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ...errors import ConfigError
from .quantization import FP8, QuantizedLinear, fit_neuron_fp8, replace_module

logger = logging.getLogger("neuron_serve")

FIELD = "model.pretrained"


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a quantized checkpoint holds: fp8 weights of ``targets`` (layer names) at ``granularity``."""

    tool: str  # "compressed-tensors" or "modelopt"
    granularity: str  # "per_channel_symmetric" or "per_tensor_symmetric"
    targets: tuple[str, ...] = ()
    activations: bool = False  # the checkpoint also quantizes activations (not applied: weight-only)
    kv_scales: bool = False  # it carries k_scale and v_scale per layer
    method: str = "fp8"
    config: dict = field(default_factory=dict, compare=False)


def read_config(directory: str | Path) -> dict | None:
    """The ``quantization_config`` of a save_pretrained directory's config.json (None: not quantized)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None


def describe(given: dict, lm: torch.nn.Module, directory: str | Path) -> CheckpointQuantization:
    """The checkpoint's quantization, checked: fp8 weights per tensor or channel, symmetric, from a tool neuron-serve
    reads; a ConfigError naming ``model.pretrained`` and what it holds otherwise."""
    method = given.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(given, lm, directory)
    if method == "modelopt":
        return _modelopt(given, lm, directory)
    raise ConfigError(f"{FIELD}: {directory} is quantized with quant_method {method!r}; neuron-serve loads fp8 "
                      f"checkpoints of compressed-tensors (llm-compressor) and ModelOpt, or quantizes a full-precision "
                      f"checkpoint itself (generation.quantization: int8 or fp8).")


def _refuse(directory: str | Path, what: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {directory} holds {what}; neuron-serve serves fp8 weights per tensor or per channel "
                       f"(symmetric) from a checkpoint, or quantizes a full-precision checkpoint itself "
                       f"(generation.quantization: int8 or fp8, per channel or per tensor).")


def _compressed_tensors(given: dict, lm: torch.nn.Module, directory: str | Path) -> CheckpointQuantization:
    from compressed_tensors.quantization import QuantizationConfig  # noqa: PLC0415 - only quantized checkpoints
    from compressed_tensors.utils.match import match_named_modules  # noqa: PLC0415

    config = QuantizationConfig.model_validate(given)
    if config.format not in ("float-quantized", "naive-quantized"):
        raise _refuse(directory, f"weights compressed as {config.format!r}")
    targets, granularity, activations = [], set(), False
    for name, scheme in config.config_groups.items():
        weights = scheme.weights
        if weights is None or weights.type != "float" or weights.num_bits != 8 or not weights.symmetric:
            raise _refuse(directory, f"{name}: weights of {_args_text(weights)}")
        if weights.strategy not in ("tensor", "channel"):
            raise _refuse(directory, f"{name}: fp8 weights with strategy {weights.strategy!r}")
        granularity.add("per_channel_symmetric" if weights.strategy == "channel" else "per_tensor_symmetric")
        activations = activations or scheme.input_activations is not None
        targets += [n for n, _ in match_named_modules(lm, scheme.targets, config.ignore or [])
                    if isinstance(lm.get_submodule(n), torch.nn.Linear)]
    if len(granularity) != 1:
        raise _refuse(directory, "fp8 weights per tensor in some layers and per channel in others")
    return CheckpointQuantization("compressed-tensors", granularity.pop(), tuple(dict.fromkeys(targets)), activations,
                                  config.kv_cache_scheme is not None, config=given)


def _args_text(weights: Any) -> str:
    if weights is None:
        return "no quantized weights"
    return f"{weights.num_bits}-bit {weights.type} ({'symmetric' if weights.symmetric else 'asymmetric'})"


def _modelopt(given: dict, lm: torch.nn.Module, directory: str | Path) -> CheckpointQuantization:
    import fnmatch  # noqa: PLC0415

    algo = given.get("quant_algo") or given.get("quantization", {}).get("quant_algo")
    if algo != "FP8":
        raise _refuse(directory, f"ModelOpt's {algo!r} quantization")
    excluded = given.get("exclude_modules") or given.get("ignore") or []
    targets = tuple(name for name, module in lm.named_modules() if isinstance(module, torch.nn.Linear)
                    and not any(fnmatch.fnmatchcase(name, pattern) for pattern in excluded))
    return CheckpointQuantization("modelopt", "per_tensor_symmetric", targets, True,
                                  bool(given.get("kv_cache_quant_algo")), config=given)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings of the scales it does not know (they are read here) kept from the log."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def load(directory: str | Path, dtype: torch.dtype | str, attn_implementation: str) -> tuple[torch.nn.Module, Any]:
    """The causal LM of a quantized checkpoint, its quantized layers as they are stored: (lm, its
    CheckpointQuantization). transformers builds the model and loads every other tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    given = config.quantization_config
    given = given if isinstance(given, dict) else given.to_dict()
    del config.quantization_config
    with _quiet_transformers():
        lm = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype, local_files_only=True,
                                                  attn_implementation=attn_implementation)
    described = describe(given, lm, directory)
    tensors = _tensors(directory, described.targets)
    compute = lm.get_input_embeddings().weight.dtype
    rescaled = 0
    for name in described.targets:
        weight, scale = tensors.get(f"{name}.weight"), tensors.get(f"{name}.weight_scale")
        if weight is None or scale is None:
            raise ConfigError(f"{FIELD}: {directory} has no {name}.weight and weight_scale in fp8, which its "
                              f"quantization_config says it quantizes; the checkpoint is incomplete.")
        if weight.dtype != FP8:
            raise _refuse(directory, f"{name}.weight in {weight.dtype} where its quantization_config says fp8 e4m3")
        weight, scale, changed = fit_neuron_fp8(weight, scale)
        rescaled += changed
        bias = lm.get_submodule(name).bias
        replace_module(lm, name, QuantizedLinear(weight, scale, bias, compute))
    logger.info("%s: %d linear layers loaded in fp8 (%s, %s) as the checkpoint holds them%s", directory,
                len(described.targets), described.tool, described.granularity.replace("_", " "),
                f"; {rescaled} rescaled into a NeuronCore's fp8 range (+-240)" if rescaled else "")
    if described.activations:
        logger.info("%s: the checkpoint also quantizes activations; neuron-serve serves its weights only, "
                    "activations in %s (NxD Inference's weight-only scheme)", directory, str(compute).split(".")[-1])
    return lm, described


def _tensors(directory: str | Path, targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open  # noqa: PLC0415

    wanted = {f"{t}.{part}" for t in targets for part in ("weight", "weight_scale")}
    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    found[key] = handle.get_tensor(key)
    return found
