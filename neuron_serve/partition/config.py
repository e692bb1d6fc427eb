"""PartitionerConfig: the four rules of torch-neuronx's graph partitioner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import ConfigError
from .kwargs import AnalyzeParameters, check_analyze_parameters, check_trace_kwargs, normalise_op

DEFAULT_SUPPORT_THRESHOLD = 0.5
NO_LIMIT = -1


def _check_limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != NO_LIMIT):
        raise ConfigError(
            f"PartitionerConfig.{name} must be an integer >= 1, or -1 for no limit; got {value!r}."
        )
    return value


@dataclass(frozen=True)
class PartitionerConfig:
    """Rules for splitting a model into accelerator and CPU subgraphs.

    Same keyword arguments as ``torch_neuronx.PartitionerConfig``;
    ``min_operator_percentage_threshold`` is accepted as an alias of
    ``model_support_percentage_threshold`` (the name the app note uses).
    Invalid values raise :class:`~neuron_serve.errors.ConfigError` (a ValueError)
    naming the field.
    """

    trace_kwargs: dict | None = None
    model_support_percentage_threshold: float = DEFAULT_SUPPORT_THRESHOLD
    min_subgraph_size: int = NO_LIMIT
    max_subgraph_count: int = NO_LIMIT
    ops_to_partition: frozenset[str] = field(default_factory=frozenset)
    analyze_parameters: dict | None = None

    def __init__(
        self,
        *,
        trace_kwargs: dict | None = None,
        model_support_percentage_threshold: float | None = None,
        min_subgraph_size: int = NO_LIMIT,
        max_subgraph_count: int = NO_LIMIT,
        ops_to_partition: Iterable[str] | None = None,
        analyze_parameters: dict | None = None,
        min_operator_percentage_threshold: float | None = None,
    ) -> None:
        if model_support_percentage_threshold is not None and min_operator_percentage_threshold is not None:
            raise ConfigError(
                "PartitionerConfig: give model_support_percentage_threshold or its alias "
                "min_operator_percentage_threshold, not both."
            )
        threshold = model_support_percentage_threshold
        if threshold is None:
            threshold = min_operator_percentage_threshold
        if threshold is None:
            threshold = DEFAULT_SUPPORT_THRESHOLD
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise ConfigError(
                "PartitionerConfig.model_support_percentage_threshold must be a number between "
                f"0 and 1 (0.5 means half the operators must be supported); got {threshold!r}."
            )
        if trace_kwargs is not None and not isinstance(trace_kwargs, dict):
            raise ConfigError(f"PartitionerConfig.trace_kwargs must be a dict or None; got {trace_kwargs!r}.")
        if analyze_parameters is not None and not isinstance(analyze_parameters, dict):
            raise ConfigError(
                f"PartitionerConfig.analyze_parameters must be a dict or None; got {analyze_parameters!r}."
            )
        if isinstance(ops_to_partition, str):
            raise ConfigError(
                "PartitionerConfig.ops_to_partition must be a set of operator names, "
                f"e.g. {{'{ops_to_partition}'}}, not a single string."
            )
        ops = frozenset(normalise_op(op) for op in (ops_to_partition or ()))
        object.__setattr__(self, "trace_kwargs", check_trace_kwargs(trace_kwargs or {}))
        object.__setattr__(self, "model_support_percentage_threshold", float(threshold))
        object.__setattr__(self, "min_subgraph_size", _check_limit("min_subgraph_size", min_subgraph_size))
        object.__setattr__(self, "max_subgraph_count", _check_limit("max_subgraph_count", max_subgraph_count))
        object.__setattr__(self, "ops_to_partition", ops)
        object.__setattr__(self, "analyze_parameters", dict(analyze_parameters or {}))
        object.__setattr__(self, "_analyze", check_analyze_parameters(self.analyze_parameters))

    @property
    def analyze(self) -> AnalyzeParameters:
        """``analyze_parameters`` checked and with defaults filled in."""
        return self._analyze

    @property
    def min_operator_percentage_threshold(self) -> float:
        return self.model_support_percentage_threshold
