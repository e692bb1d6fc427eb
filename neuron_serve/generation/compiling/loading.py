"""A generate model.yaml's causal LM and tokenizer, loaded in the precision it asks for.

The model is a factory's transformers causal LM or a ``save_pretrained`` directory (``model.pretrained``,
read with local files only; a quantized checkpoint's layers as it holds them, checkpoint.py), in eval
mode with eager attention, then cast, quantized and given its KV cache format (precision/dtypes.py). The
tokenizer comes from ``tokenizer`` or the pretrained directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ...config.generation import GenerationSettings
from ...config.factory import build_model
from ...config.schema import ModelConfig, _under
from ...errors import ConfigError
from ..precision import checkpoint, kv_cache, dtypes as precision
from ..precision.quantization import compute_dtype_of

logger = logging.getLogger("neuron_serve")

ATTENTION = "eager"  # SlotLM hands the layers an additive mask and its own cache; eager attention reads both
DRAFT_FIELD = "generation.speculative_config.model"


def load_lm(config: ModelConfig, base_dir: str | Path | None = None, tokenizer: Any = None) -> torch.nn.Module:
    """The causal LM of ``model.factory`` or ``model.pretrained``, in eval mode with eager attention, in the
    model.yaml's ``dtype``, ``quantization`` and ``kv_cache_dtype`` (``tokenizer``: for the prompts that measure
    fp8 cache scales; the model.yaml's is loaded when needed and not given)."""
    settings = config.generation or GenerationSettings()
    directory, found = None, None
    if config.model.pretrained is not None:
        directory = _under(base_dir, config.model.pretrained)
        lm, found = load_pretrained(directory, dtype=config.dtype)
    else:
        lm = _factory(config, base_dir)
    if tokenizer is None and settings.kv_cache_dtype != "auto":
        tokenizer = load_tokenizer(config, base_dir)
    return _prepared(lm, config, settings, found, tokenizer, directory)


def load_draft(config: ModelConfig, base_dir: str | Path | None, tokenizer: Any = None) -> torch.nn.Module:
    """The speculative draft model, in the model's dtype, quantization and KV cache format."""
    settings = config.generation
    directory = _under(base_dir, settings.speculative_config.model)
    draft, found = load_pretrained(directory, DRAFT_FIELD, dtype=config.dtype)
    return _prepared(draft, config, settings, found, tokenizer, directory)


def _prepared(lm: torch.nn.Module, config: ModelConfig, settings: GenerationSettings, found: Any, tokenizer: Any,
              directory: str | None) -> torch.nn.Module:
    kv_tensors = kv_cache.checkpoint_tensors(directory) \
        if directory is not None and settings.kv_cache_dtype != "auto" else {}
    return precision.prepare(lm, settings, dtype=config.torch_dtype(compute_dtype_of(lm)), checkpoint=found,
                             tokenizer=tokenizer, kv_tensors=kv_tensors)


def _factory(config: ModelConfig, base_dir: str | Path | None) -> torch.nn.Module:
    lm = build_model(config, base_dir)
    factory = config.model.factory
    if not hasattr(lm, "config") or not callable(getattr(lm, "get_output_embeddings", None)) \
            or lm.get_output_embeddings() is None:
        raise ConfigError(f"model.factory: {factory!r} returned a {type(lm).__name__}, not a transformers causal "
                          f"LM (a model with .config and an output embedding, e.g. from "
                          f"AutoModelForCausalLM); task: generate needs one.")
    if getattr(lm.config, "_attn_implementation", ATTENTION) != ATTENTION:
        if callable(getattr(lm, "set_attn_implementation", None)):
            lm.set_attn_implementation(ATTENTION)
        if lm.config._attn_implementation != ATTENTION:
            raise ConfigError(f"model.factory: {factory!r} returned a model with "
                              f"{lm.config._attn_implementation!r} attention that cannot be switched to eager; "
                              f"build it with attn_implementation='eager'.")
    return lm.eval()


def load_pretrained(directory: str, field: str = "model.pretrained",
                    dtype: str = "auto") -> tuple[torch.nn.Module, checkpoint.CheckpointQuantization | None]:
    """A save_pretrained directory's causal LM in ``dtype`` (auto: the checkpoint's), and the quantization it was
    saved with (None: full precision)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    if not Path(directory).is_dir():
        raise ConfigError(f"{field}: {directory} is not a directory; give a directory written by "
                          f"save_pretrained (relative to the model.yaml's folder).")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        if checkpoint.read_config(directory) is not None:
            lm, found = checkpoint.load(directory, torch_dtype, ATTENTION)
        else:
            lm = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=ATTENTION, local_files_only=True,
                                                      dtype=torch_dtype)
            found = None
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{field}: cannot load {directory} as a transformers causal LM "
                          f"({_first_line(exc)}); give a directory written by a causal LM's save_pretrained.") from None
    return lm.eval(), found


def load_tokenizer(config: ModelConfig, base_dir: str | Path | None = None) -> Any:
    """``tokenizer``'s (which must load) or else the pretrained directory's tokenizer, if it has one."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    if config.tokenizer is not None:
        directory = _under(base_dir, config.tokenizer)
        if not Path(directory).is_dir():
            raise ConfigError(f"tokenizer: {directory} is not a directory; give a directory of transformers "
                              f"tokenizer files (tokenizer.json, tokenizer_config.json, ...).")
        try:
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # transformers raises many kinds for unreadable tokenizer files
            raise ConfigError(f"tokenizer: cannot load a tokenizer from {directory} ({_first_line(exc)}); give a "
                              f"directory written by a tokenizer's save_pretrained.") from None
    if config.model.pretrained is None:
        return None
    directory = _under(base_dir, config.model.pretrained)
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # no tokenizer beside the model: the engine then takes token ids only
        logger.info("%s: no tokenizer loaded from %s (%s); stop strings are refused", config.name, directory,
                    type(exc).__name__)
        return None


def _first_line(exc: Exception) -> str:
    """``Type: message`` with only the message's first line (transformers' can list every model type)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
