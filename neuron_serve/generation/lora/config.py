"""A LoRA adapter's ``adapter_config.json``: PEFT's LoraConfig as JSON, checked, and PEFT's rule of what it targets.

Read as JSON, with LoraConfig's field names and defaults, so the engine needs no ``peft``. Which
modules an adapter targets follows PEFT's ``check_target_module_exists`` and ``get_pattern_key``
(peft/tuners/tuners_utils.py, peft/utils/other.py) to the letter: the delta served must be the
one PEFT's own model computes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ...errors import AdapterError

ADAPTER_CONFIG = "adapter_config.json"
AGAIN = "save the adapter again with save_pretrained"

_PLAIN = "train a plain LoRA adapter"
# LoraConfig's options that change what an adapter computes past x @ A^T @ B^T * scaling: refused when set
# (anything but None, false or empty), each with why and the fix; {value} is the value given.
_REFUSED = {
    "use_dora": ("DoRA adapters are not served (their magnitude vectors rescale each targeted layer's weight)",
                 f"{_PLAIN} (use_dora false)"),
    "modules_to_save": ("the adapter carries trained copies of {value}, which are not served per adapter",
                        "train without modules_to_save, or merge the adapter into its model (merge_and_unload) and "
                        "serve that as a model of its own"),
    "lora_bias": ("a bias on lora_B is not served", "train with lora_bias false"),
    "trainable_token_indices": ("trained token embeddings are not served per adapter",
                                "train without trainable_token_indices"),
    "layer_replication": ("the adapter repeats layers of its base model, which the served model does not",
                          "train without layer_replication"),
    "alora_invocation_tokens": ("activated LoRA (applied only after its invocation tokens) is not served", _PLAIN),
    "use_qalora": ("QA-LoRA (pooled inputs, for a quantized base model) is not served", _PLAIN),
    "target_parameters": ("adapters of parameters rather than modules are not served",
                          "target the attention and MLP projections with target_modules"),
    "use_bdlora": ("block-diagonal LoRA is not served", _PLAIN),
    "arrow_config": ("Arrow's routing between adapters is not served", "serve each adapter on its own"),
    "kasa_config": ("KaSA adapters are not served", _PLAIN),
    "monteclora_config": ("MonteCLoRA adapters are not served", _PLAIN),
    "megatron_config": ("adapters of Megatron's parallel layers are not served",
                        "train the adapter on the transformers model"),
}
# Initialisations trained against base weights they changed (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA): the adapter
# only fits the served base once save_pretrained has converted it (which writes init_lora_weights true).
_BASE_CHANGING_INIT = re.compile(r"^(pissa.*|olora|corda|loftq|lora_ga)$")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of an adapter_config.json that decide its delta."""

    file: Path
    r: int
    alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (as PEFT sizes its buffers)."""
        return max([self.r, *self.rank_pattern.values()])

    def rank_of(self, module: str) -> int:
        """``module``'s rank: rank_pattern's first key that ends its name, else r."""
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)

    def alpha_of(self, module: str) -> float:
        """``module``'s lora_alpha: alpha_pattern's first key that ends its name, else lora_alpha."""
        return self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.alpha)

    def targets(self, module: str, kind: str, head: bool) -> bool:
        """Whether PEFT gives ``module`` (of class ``kind``; ``head``: the LM head) this adapter."""
        if self._excluded(module):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == "all-linear":  # PEFT's shorthand: every linear layer but the head
                return kind in ("Linear", "Conv1D") and not head
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not any(module.endswith(f".{target}") for target in self.target_modules):
            return False
        return self._in_layers(module)

    def shown_targets(self) -> str:
        """target_modules as a message shows them: the expression quoted, or the names."""
        if isinstance(self.target_modules, str):
            return f"'{self.target_modules}'"
        return ", ".join(self.target_modules)

    def unmatched(self, modules: Iterable[str]) -> list[str]:
        """The target_modules names that no module of the model has (none for a regular expression)."""
        if isinstance(self.target_modules, str):
            return []
        names = list(modules)
        return [t for t in self.target_modules if not any(m == t or m.endswith(f".{t}") for m in names)]

    def _excluded(self, module: str) -> bool:
        if not self.exclude_modules:
            return False
        if isinstance(self.exclude_modules, str):
            return re.fullmatch(self.exclude_modules, module) is not None
        return module in self.exclude_modules or any(module.endswith(f".{x}") for x in self.exclude_modules)

    def _in_layers(self, module: str) -> bool:
        layers = self.layers_to_transform
        if layers is None or layers == ():
            return True
        # The first numbered segment is the layer (a lazy match: not an expert's index further in).
        patterns = [rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\." for pattern in self.layers_pattern] or \
            [r".*?\.[^.]*\.(?P<idx>\d+)\."]
        match = next((m for m in (re.match(p, module) for p in patterns) if m is not None), None)
        if match is None:
            return False
        index = int(match["idx"])
        return index == layers if isinstance(layers, int) else index in layers


def _pattern_key(patterns: dict, module: str) -> str | None:
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)


def read_config(file: Path) -> AdapterConfig:
    """``file`` (an adapter_config.json) read and checked; raises AdapterError naming it, the field and the fix."""
    if not file.is_file():
        raise AdapterError(f"{file}: no such file; a PEFT adapter directory holds its LoraConfig there (save the "
                           f"adapter with save_pretrained).")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{file}: not valid JSON ({exc}); {AGAIN}.") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{file}: must hold a JSON object (PEFT's LoraConfig), not a {type(data).__name__}; "
                           f"{AGAIN}.")
    fields = _Fields(file, data)
    kind = data.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{file}: peft_type is {kind!r}; only LoRA adapters (peft_type \"LORA\") are served.")
    for name, (reason, fix) in _REFUSED.items():
        value = data.get(name)
        if value:
            raise AdapterError(f"{file}: {name}: {reason.format(value=value)}; {fix}.")
    if data.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias: {data['bias']!r} trains the base model's biases, which are not served per "
                           f"adapter; train with bias \"none\".")
    init = data.get("init_lora_weights", True)
    if isinstance(init, str) and _BASE_CHANGING_INIT.match(init.lower()):
        raise AdapterError(f"{file}: init_lora_weights: {init!r} trains the adapter against changed base weights; "
                           f"save it converted to a plain LoRA adapter (save_pretrained(..., "
                           f"path_initial_model_for_weight_conversion=...)) and serve that.")
    return AdapterConfig(
        file, fields.positive("r", 8), fields.number("lora_alpha", 8), fields.flag("use_rslora"),
        fields.names("target_modules", required=True), fields.names("exclude_modules"), fields.layers(),
        fields.layer_patterns(),
        {key: fields.positive(f"rank_pattern.{key}", value=value) for key, value in fields.mapping("rank_pattern")},
        {key: fields.number(f"alpha_pattern.{key}", value=value) for key, value in fields.mapping("alpha_pattern")})


class _Fields:
    """LoraConfig's fields of ``data``, each of its type or an AdapterError naming it."""

    def __init__(self, file: Path, data: dict[str, Any]) -> None:
        self.file, self.data = file, data

    def _bad(self, name: str, expected: str, value: Any) -> AdapterError:
        return AdapterError(f"{self.file}: {name} must be {expected}, got {value!r}; {AGAIN}.")

    def _get(self, name: str, default: Any, value: Any) -> Any:
        return value if value is not None else self.data.get(name, default)

    def positive(self, name: str, default: int | None = None, value: Any = None) -> int:
        value = self._get(name, default, value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad(name, "a positive integer", value)
        return value

    def number(self, name: str, default: float | None = None, value: Any = None) -> float:
        value = self._get(name, default, value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, "a number", value)
        return value

    def flag(self, name: str) -> bool:
        value = self.data.get(name, False)
        if not isinstance(value, bool):
            raise self._bad(name, "true or false", value)
        return value

    def names(self, name: str, required: bool = False) -> str | tuple[str, ...] | None:
        """A list of module names or one regular expression (PEFT takes either)."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise AdapterError(f"{self.file}: {name} is missing (save_pretrained always writes it); {AGAIN}.")
            return None
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as exc:
                raise AdapterError(f"{self.file}: {name}: {value!r} is not a regular expression ({exc}); give a "
                                   f"list of module names or a valid regular expression.") from None
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(name, "a list of module names or a regular expression", value)
        return tuple(value)

    def layers(self) -> int | tuple[int, ...] | None:
        value = self.data.get("layers_to_transform")
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self._bad("layers_to_transform", "a layer index or a list of them", value)
        return tuple(value)

    def layer_patterns(self) -> tuple[str, ...]:
        """layers_pattern: the name of the layers' list (``layers``, ``h``), one or several; none: any."""
        value = self.data.get("layers_pattern") or ()
        value = (value,) if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self._bad("layers_pattern", "a name or a list of names", value)
        return tuple(value)

    def mapping(self, name: str) -> list[tuple[str, Any]]:
        value = self.data.get(name) or {}
        if not isinstance(value, dict):
            raise self._bad(name, "a mapping of module name patterns", value)
        return list(value.items())
