"""``compiler_args``: neuronx-cc options, parsed against the Neuron Compiler CLI reference.

torch-neuronx hands ``compiler_args`` (a string or a list of strings) to neuronx-cc for
every accelerator subgraph. Here they are parsed against the options the Neuron
Compiler CLI Reference Guide documents for ``neuronx-cc compile``, so a typo or an
invalid value is refused before anything compiles, naming the flag and the closest
valid one. On Neuron the parsed arguments go to neuronx-cc as they are (through
``NEURON_CC_FLAGS``, which its NEFF cache keys on). In emulation the options that change
numerics are reproduced (``--auto-cast`` / ``--auto-cast-type``, see
:mod:`neuron_serve.compile.passes.auto_cast`); the others are recorded with
"no effect in emulation".
"""

from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

NO_EFFECT = "no effect in emulation"
EMULATED = "emulated"


@dataclass(frozen=True)
class Option:
    """One ``neuronx-cc compile`` option: its value set (None: free text), or a flag (no value)."""

    name: str
    choices: tuple[str, ...] | None = None
    flag: bool = False
    aliases: tuple[str, ...] = ()


# ``neuronx-cc compile`` options from the Neuron Compiler CLI Reference Guide.
OPTIONS = [
    Option("--target", ("inf2", "trn1", "trn1n", "trn2")),
    Option("--framework", ("XLA",)),
    Option("--model-type", ("generic", "transformer", "unet-inference")),
    Option("--auto-cast", ("none", "matmult", "all")),
    Option("--auto-cast-type", ("bf16", "fp16", "tf32", "fp8_e4m3")),
    Option("--distribution-strategy", ("llm-training",)),
    Option("--logical-nc-config", ("1", "2"), aliases=("-lnc",)),
    Option("--optlevel", ("1", "2", "3"), aliases=("-O",)),
    Option("--enable-mixed-precision-accumulation", flag=True),
    Option("--enable-saturate-infinity", flag=True),
    Option("--enable-fast-context-switch", flag=True),
    Option("--enable-fast-loading-neuron-binaries", flag=True),
    Option("--logfile"),
    Option("--verbose", ("debug", "info", "warning", "error", "critical")),
]
_BY_NAME = {spelling: opt for opt in OPTIONS for spelling in (opt.name, *opt.aliases)}
# Options of neuron-cc (Inf1) that users carry over; refused with where they went.
_INF1_ONLY = {"--fast-math": "--auto-cast", "--fp32-cast": "--auto-cast"}

# What --auto-cast-type casts to in emulation. tf32 has no torch dtype: XLA:CPU already
# computes float32 matmuls in full precision, so it is recorded as having no effect.
CAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn"}
# neuronx-cc's defaults (its mixed-precision guide: FP32 matrix multiplications are cast
# to bf16). Emulation applies them only once an auto-cast option is given: without one a
# trace computes in the model's own dtypes, equal to eager, which every other comparison
# relies on; ``--auto-cast matmult`` shows what neuronx-cc's default does to accuracy.
NEURONX_CC_AUTO_CAST = "matmult"
DEFAULT_AUTO_CAST_TYPE = "bf16"


def _closest(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


@dataclass(frozen=True)
class CompilerArgs:
    """Parsed ``compiler_args``: the argv as given (normalised) and each option's value."""

    argv: tuple[str, ...] = ()
    values: dict[str, Any] = field(default_factory=dict)  # "--auto-cast" -> "matmult"; flags -> True

    @property
    def auto_cast(self) -> str:
        """The cast mode emulated: as given, neuronx-cc's default beside an ``--auto-cast-type``, else none."""
        if "--auto-cast" in self.values:
            return self.values["--auto-cast"]
        return NEURONX_CC_AUTO_CAST if "--auto-cast-type" in self.values else "none"

    @property
    def auto_cast_type(self) -> str:
        return self.values.get("--auto-cast-type", DEFAULT_AUTO_CAST_TYPE)

    @property
    def cast_dtype(self) -> str | None:
        """The torch dtype name operands are cast to in emulation, or None (no cast)."""
        if self.auto_cast == "none":
            return None
        return CAST_DTYPES.get(self.auto_cast_type)

    def emulation(self) -> dict[str, str]:
        """Each option given -> what emulation does with it (``emulated`` or ``no effect in emulation``)."""
        out = {}
        for name in self.values:
            if name in ("--auto-cast", "--auto-cast-type") and self.cast_dtype is not None:
                out[name] = f"{EMULATED}: operands of {self.auto_cast} operators cast to {self.auto_cast_type}"
            elif name == "--auto-cast" and self.auto_cast == "none":
                out[name] = f"{EMULATED}: operators keep the model's dtypes"
            else:
                out[name] = NO_EFFECT
        return out

    def describe(self) -> dict:
        """JSON-ready record for the artifact manifest and the partition report."""
        return {"argv": list(self.argv), "options": self.emulation()}

    def cache_key(self) -> list[str]:
        """The options that define the compiled executable, order-independent."""
        return sorted(f"{k}={v}" for k, v in self.values.items())

    def neuron_cc_flags(self) -> str:
        """The arguments as neuronx-cc takes them (NEURON_CC_FLAGS)."""
        return shlex.join(self.argv)

    def __bool__(self) -> bool:
        return bool(self.values)


NONE = CompilerArgs()


def _tokens(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: cannot split {value!r} into arguments ({exc}); check its quotes.") from None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        out: list[str] = []
        for v in value:  # torch-neuronx users write both ["--auto-cast", "all"] and ["--auto-cast all"]
            out.extend(shlex.split(v))
        return out
    raise ConfigError(f"{where} must be a string or a list of strings (neuronx-cc arguments such as "
                      f"'--auto-cast matmult'); got {value!r}.")


def _split_attached(token: str) -> tuple[str, str | None]:
    """``--opt=value`` -> (``--opt``, value); ``-O2`` -> (``-O``, ``2``); else (token, None)."""
    if token.startswith("--") and "=" in token:
        name, _, value = token.partition("=")
        return name, value
    if token.startswith("-lnc") and len(token) > 4:
        return "-lnc", token[4:].lstrip("=")
    if token.startswith("-O") and len(token) > 2:
        return "-O", token[2:].lstrip("=")
    return token, None


def parse_compiler_args(value: Any, where: str = "compiler_args") -> CompilerArgs:
    """Parse ``compiler_args`` (str, list of str or None) against neuronx-cc's documented options.

    Raises ConfigError naming an unknown or malformed flag and the closest valid one.
    """
    if value is None:
        return NONE
    if isinstance(value, CompilerArgs):
        return value
    tokens = _tokens(value, where)
    values: dict[str, Any] = {}
    argv: list[str] = []
    known = sorted(_BY_NAME)
    i = 0
    while i < len(tokens):
        name, attached = _split_attached(tokens[i])
        i += 1
        if name in _INF1_ONLY:
            raise ConfigError(f"{where}: {name!r} is an option of neuron-cc (Inf1), not of neuronx-cc; "
                              f"use {_INF1_ONLY[name]!r} instead.")
        option = _BY_NAME.get(name)
        if option is None:
            what = "unknown neuronx-cc option" if name.startswith("-") else "unexpected argument (not an option)"
            raise ConfigError(f"{where}: {what} {name!r}{_closest(name, known) or '.'} "
                              f"Valid options: {', '.join(o.name for o in OPTIONS)}.")
        if option.flag:
            if attached is not None:
                raise ConfigError(f"{where}: {option.name} is a flag and takes no value; got {tokens[i - 1]!r}.")
            values[option.name] = True
            argv.append(option.name)
            continue
        if attached is None:
            if i >= len(tokens) or (tokens[i].startswith("-") and tokens[i] not in (option.choices or ())):
                raise ConfigError(f"{where}: {option.name} needs a value"
                                  + (f" (one of {', '.join(option.choices)})." if option.choices else "."))
            attached = tokens[i]
            i += 1
        if option.choices is not None and attached not in option.choices:
            raise ConfigError(f"{where}: invalid value {attached!r} for {option.name}{_closest(attached, list(option.choices)) or '.'} "
                              f"Valid values: {', '.join(option.choices)}.")
        values[option.name] = attached
        argv.extend([option.name, attached])
    return CompilerArgs(tuple(argv), values)
