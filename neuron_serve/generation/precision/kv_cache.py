"""The KV cache's format: the model's dtype, or fp8 (e4m3) with a scale per layer for keys and one for values.

With ``kv_cache_dtype: fp8`` the slot cache holds ``float8_e4m3fn`` values: each key written is
``key / k_scale`` rounded to fp8 (within a NeuronCore's range of +-240), and attention reads
``stored * k_scale`` in the compute dtype; values alike with ``v_scale``. Every key and value
attention reads goes through that rounding, a prompt's own ones in its prefill included, so a
prompt computes the same keys whether it is prefilled or decoded token by token.

The scales come from the checkpoint when it has them (llm-compressor's ``kv_cache_scheme`` and
ModelOpt write ``k_scale`` and ``v_scale`` per attention layer; scaled for OCP's 448, they are
rescaled for 240), else they are measured at start-up, as vLLM's ``calculate_kv_scales``: the
largest magnitude of each layer's keys and values over a few prompts, with headroom
(:data:`HEADROOM`), so a token past what calibration saw is still represented (and clipped
beyond). A scale of 1.0 is never assumed.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .quantization import FP8, NEURON_FP8_MAX

logger = logging.getLogger("neuron_serve")

HEADROOM = 1.25  # calibration's largest magnitude maps to 240 / 1.25 = 192
OCP_FP8_MAX = 448.0
# English of several kinds (prose, a list, code, numbers): what start-up calibration runs when the model has a
# tokenizer. Without one, seeded random token ids.
CALIBRATION_TEXTS = (
    "The capital of France is Paris. It lies on the Seine, in the north of the country, and has been a centre "
    "of trade, learning and government for more than a thousand years.",
    "Ingredients: two cups of flour, one teaspoon of salt, three eggs and a cup of milk. Whisk the eggs, add the "
    "milk, then fold in the flour until the batter is smooth.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "In 1969 the Apollo 11 mission landed on the Moon; 600 million people watched Neil Armstrong's first step, "
    "at 02:56 UTC on 21 July.",
)
_CHECKPOINT_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?([kv])_scale$")


@dataclass(frozen=True)
class KvCacheFormat:
    """fp8 keys and values with a scale per layer (``k_scales[i]``, ``v_scales[i]``), and where they came from
    (``checkpoint`` or ``calibrated``)."""

    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    source: str
    dtype: torch.dtype = FP8

    def store(self, states: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """Keys (``kind`` "k") or values ("v") of ``layer`` as the cache holds them."""
        scale = (self.k_scales if kind == "k" else self.v_scales)[layer]
        return (states / scale).clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(self.dtype)

    def read(self, stored: torch.Tensor, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """What attention reads of ``stored`` (cache values of ``layer``), in ``dtype``."""
        scale = (self.k_scales if kind == "k" else self.v_scales)[layer]
        return stored.to(dtype) * scale

    def round(self, states: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """``states`` through the cache and back: what attention reads of keys or values just written."""
        return self.read(self.store(states, layer, kind), layer, kind, states.dtype)

    def describe(self) -> dict:
        return {"kv_cache_dtype": "fp8_e4m3", "scales": self.source,
                "k_scales": [round(s, 6) for s in self.k_scales], "v_scales": [round(s, 6) for s in self.v_scales]}


ATTRIBUTE = "neuron_serve_kv_cache"


def of(lm: torch.nn.Module) -> KvCacheFormat | None:
    """The KV cache format attached to ``lm`` (None: the model's own dtype)."""
    return getattr(lm, ATTRIBUTE, None)


def attach(lm: torch.nn.Module, form: KvCacheFormat | None) -> None:
    setattr(lm, ATTRIBUTE, form)


def cache_dtype(lm: torch.nn.Module, compute: torch.dtype) -> torch.dtype:
    """The dtype the slot cache of ``lm`` holds."""
    form = of(lm)
    return form.dtype if form is not None else compute


class CacheLayers:
    """What transformers' attention asks of a cache object beside ``update``: its length, none of its own (the masks
    passed in say what each position sees), and its number of layers (``keys``, one a layer)."""

    keys: list

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.keys)


def read_back(kv: KvCacheFormat | None, keys: torch.Tensor, values: torch.Tensor, layer: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads of ``keys`` and ``values`` as a slot cache holds them: themselves, or (fp8, ``kv``)
    read back in ``dtype``."""
    if kv is None:
        return keys, values
    return kv.read(keys, layer, "k", dtype), kv.read(values, layer, "v", dtype)


class _Recorder:
    """transformers' cache interface, remembering each layer's largest key and value magnitude."""

    is_compileable = False

    def __init__(self, layers: int) -> None:
        self.k = [0.0] * layers
        self.v = [0.0] * layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.k[layer_idx] = max(self.k[layer_idx], float(key_states.detach().abs().max()))
        self.v[layer_idx] = max(self.v[layer_idx], float(value_states.detach().abs().max()))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)


def calibration_prompts(tokenizer: Any, vocab_size: int, count: int = len(CALIBRATION_TEXTS),
                        length: int = 64) -> list[list[int]]:
    """Token ids to calibrate on: :data:`CALIBRATION_TEXTS` through ``tokenizer``, else seeded random ids."""
    if tokenizer is not None:
        return [tokenizer(text)["input_ids"][:length] for text in CALIBRATION_TEXTS[:count]]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]


def cache_kwarg(lm: torch.nn.Module) -> str:
    """The keyword ``lm``'s forward takes its cache by: transformers 5 renames ``past_key_values`` to ``cache``."""
    params = inspect.signature(lm.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def calibrate(lm: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> KvCacheFormat:
    """Scales measured by running ``lm`` (eager, in its serving dtype and quantization) over ``prompts``."""
    recorder = _Recorder(lm.config.num_hidden_layers)
    dtype = lm.get_input_embeddings().weight.dtype
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            n = ids.shape[1]
            positions = torch.arange(n)[None]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            mask = torch.where(causal, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
            lm(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
               **{cache_kwarg(lm): recorder})
    return KvCacheFormat(tuple(_scale(a) for a in recorder.k), tuple(_scale(a) for a in recorder.v), "calibrated")


def _scale(amax: float) -> float:
    return amax * HEADROOM / NEURON_FP8_MAX if amax > 0 and math.isfinite(amax) else 1.0 / NEURON_FP8_MAX


def from_checkpoint(tensors: dict[str, torch.Tensor], layers: int) -> KvCacheFormat | None:
    """The checkpoint's per-layer ``k_scale`` and ``v_scale`` (None unless every layer has both), taken for OCP's
    448 range and rescaled for a NeuronCore's 240."""
    found: dict[tuple[int, str], float] = {}
    for name, tensor in tensors.items():
        match = _CHECKPOINT_SCALE.search(name)
        if match:
            found[int(match.group(1)), match.group(2)] = float(tensor.to(torch.float32).reshape(-1).max())
    if not all((i, kind) in found for i in range(layers) for kind in "kv"):
        return None
    factor = OCP_FP8_MAX / NEURON_FP8_MAX
    logger.info("KV cache scales from the checkpoint, rescaled from fp8's 448 to a NeuronCore's 240 (x%.3f)", factor)
    return KvCacheFormat(tuple(found[i, "k"] * factor for i in range(layers)),
                         tuple(found[i, "v"] * factor for i in range(layers)), "checkpoint")


def checkpoint_tensors(directory: str | Path, names: re.Pattern = _CHECKPOINT_SCALE) -> dict[str, torch.Tensor]:
    """The tensors of a save_pretrained directory whose names match ``names`` (read with safetensors)."""
    from safetensors import safe_open  # noqa: PLC0415

    found = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if names.search(name):
                    found[name] = handle.get_tensor(name)
    return found
