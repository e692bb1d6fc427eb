"""PartitionerConfig's two dicts of pass-through arguments, checked key by key.

``trace_kwargs`` reaches the trace of every accelerator subgraph; ``analyze_parameters``
reaches the analysis that decides what the accelerator runs. The reference names the
keys each takes; anything else is refused naming the closest valid key, never dropped.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from ..config.compiler_args import CompilerArgs, parse_compiler_args
from ..errors import ConfigError

TRACE_KWARGS = ("compiler_workdir", "compiler_args")
# trace()'s own keyword arguments that make no sense per subgraph (or are not offered here).
_TRACE_ONLY = {
    "partitioner_config": "it is this PartitionerConfig",
    "input_output_aliases": "state tensors belong to the whole model; pass them to trace() itself",
    "inline_weights_to_neff": "pass it to trace() itself",
}
ANALYZE_PARAMETERS = ("compiler_workdir", "additional_ignored_ops", "max_workers")
DEFAULT_MAX_WORKERS = 1


def normalise_op(name: Any, field: str = "PartitionerConfig.ops_to_partition") -> str:
    """An operator name as 'aten::name', or ConfigError naming ``field``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{field} entries must be operator names such as "
            f"'aten::log_softmax'; got {name!r}."
        )
    name = name.strip()
    if "::" not in name:
        raise ConfigError(
            f"{field} entry {name!r} has no namespace; "
            f"write it as 'aten::{name}'."
        )
    return name


def _closest(key: str, valid: tuple[str, ...]) -> str:
    match = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _workdir(value: Any, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{field} must be a directory path (str); got {value!r}.")
    return value


def check_trace_kwargs(trace_kwargs: dict) -> dict:
    """The checked ``trace_kwargs``: ``compiler_args`` parsed, unknown keys refused."""
    for key in trace_kwargs:
        if key in _TRACE_ONLY:
            raise ConfigError(f"PartitionerConfig.trace_kwargs: {key!r} cannot be given per subgraph: "
                              f"{_TRACE_ONLY[key]}.")
        if key not in TRACE_KWARGS:
            raise ConfigError(f"PartitionerConfig.trace_kwargs: unknown key {key!r}{_closest(key, TRACE_KWARGS)}; "
                              f"it takes {', '.join(TRACE_KWARGS)}.")
    out = dict(trace_kwargs)
    _workdir(out.get("compiler_workdir"), "PartitionerConfig.trace_kwargs['compiler_workdir']")
    if "compiler_args" in out:
        out["compiler_args"] = parse_compiler_args(out["compiler_args"], "PartitionerConfig.trace_kwargs['compiler_args']")
    return out


@dataclass(frozen=True)
class AnalyzeParameters:
    """The analyze() arguments the partitioner takes (torch-neuronx supports these three)."""

    compiler_workdir: str | None = None
    additional_ignored_ops: frozenset[str] = frozenset()
    max_workers: int = DEFAULT_MAX_WORKERS


def check_analyze_parameters(params: dict, field: str = "PartitionerConfig.analyze_parameters") -> AnalyzeParameters:
    """``analyze_parameters`` checked: unknown keys, bad workdirs, op names and worker counts refused."""
    for key in params:
        if key not in ANALYZE_PARAMETERS:
            raise ConfigError(f"{field}: unknown key {key!r}"
                              f"{_closest(key, ANALYZE_PARAMETERS)}; the partitioner takes "
                              f"{', '.join(ANALYZE_PARAMETERS)}.")
    ignored = params.get("additional_ignored_ops") or ()
    if isinstance(ignored, str):
        raise ConfigError(f"{field}['additional_ignored_ops'] must be a set of operator names, "
                          f"e.g. {{'{ignored}'}}, not a single string.")
    workers = params.get("max_workers", DEFAULT_MAX_WORKERS)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"{field}['max_workers'] must be an integer >= 1 (threads running support checks); "
                          f"got {workers!r}.")
    return AnalyzeParameters(
        compiler_workdir=_workdir(params.get("compiler_workdir"), f"{field}['compiler_workdir']"),
        additional_ignored_ops=frozenset(normalise_op(op, f"{field}['additional_ignored_ops']") for op in ignored),
        max_workers=workers,
    )


def resolve(compiler_args: Any, compiler_workdir: Any, trace_kwargs: dict, where: str) -> tuple[CompilerArgs, str | None]:
    """The compiler arguments and workdir of one trace: its own, else its partitioner's trace_kwargs.

    Giving ``compiler_args`` both to ``where`` and in trace_kwargs is refused (which would win is a guess).
    """
    args = parse_compiler_args(compiler_args, f"{where}(compiler_args=...)")
    if "compiler_args" in trace_kwargs:
        if compiler_args is not None:
            raise ConfigError(f"{where}: compiler_args given both to {where}() and in PartitionerConfig.trace_kwargs; "
                              "give them once.")
        args = trace_kwargs["compiler_args"]
    workdir = _workdir(compiler_workdir, f"{where}(compiler_workdir=...)") or trace_kwargs.get("compiler_workdir")
    return args, workdir
