"""Where a model's accelerator work runs: a full copy on every core, or a pipeline of stages over cores.

``replicate`` (the default) keeps today's behaviour: every core holds every accelerator
subgraph and runs whole chunks. ``pipeline`` splits the model into stages with torch's
accelerator partitioner (see :mod:`neuron_serve.partition.pipeline`), one stage per core of
a group of ``cores_per_pipeline`` cores; with ``saturate_host`` the pipeline is copied onto
every further whole group of the replica's cores, as torch's ``saturate_host`` copies
partitions onto idle devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

MODES = ("replicate", "pipeline")
BALANCES = ("size_based", "cost_aware", "kl_based", "latency")
DEFAULT_BALANCE = "size_based"


@dataclass(frozen=True)
class ModelPlacement:
    """``ModelPlacement(mode="pipeline", cores_per_pipeline=2, balance="kl_based")``.

    ``balance``: ``size_based`` packs nodes into stages by memory (weights plus activations
    against one core's memory); ``cost_aware`` and ``kl_based`` are torch's partitioner's
    latency modes (measured node latencies plus the transfer cost between cores, minimising
    one input's end-to-end latency); ``latency`` evens out the stages' measured latency,
    which sets a pipeline's throughput.
    """

    mode: str = "replicate"
    cores_per_pipeline: int | None = None
    balance: str | None = None
    saturate_host: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"placement.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "replicate":
            given = [k for k in ("cores_per_pipeline", "balance", "saturate_host") if getattr(self, k) is not None]
            if given:
                raise ConfigError(f"placement.{given[0]} applies to mode: pipeline; remove it or set "
                                  f"placement.mode to pipeline")
            return
        cores = self.cores_per_pipeline
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
            raise ConfigError(f"placement.cores_per_pipeline: pipeline mode needs a whole number of cores >= 1 "
                              f"to split the model over, got {cores!r}")
        if self.balance is not None and self.balance not in BALANCES:
            raise ConfigError(f"placement.balance: {self.balance!r} is not one of {', '.join(BALANCES)}")
        if self.saturate_host is not None and not isinstance(self.saturate_host, bool):
            raise ConfigError(f"placement.saturate_host: must be true or false, got {self.saturate_host!r}")

    @property
    def pipelined(self) -> bool:
        return self.mode == "pipeline"

    @property
    def balance_mode(self) -> str:
        return self.balance or DEFAULT_BALANCE

    @property
    def saturates_host(self) -> bool:
        return True if self.saturate_host is None else self.saturate_host


def as_placement(value: Any) -> ModelPlacement:
    """``trace(placement=...)``: None (replicate), a ModelPlacement, or a dict of its fields."""
    if value is None:
        return ModelPlacement()
    if isinstance(value, ModelPlacement):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"mode", "cores_per_pipeline", "balance", "saturate_host"})
        if unknown:
            raise ConfigError(f"placement.{unknown[0]}: unknown field; the fields are mode, cores_per_pipeline, "
                              f"balance, saturate_host")
        return ModelPlacement(**value)
    raise ConfigError("trace(placement=...) must be a neuron_serve.ModelPlacement or a dict of its fields "
                      "(mode, cores_per_pipeline, balance, saturate_host)")
