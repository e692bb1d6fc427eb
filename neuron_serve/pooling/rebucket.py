"""A serving pooling replica that changes its own length buckets for those its traffic pads least.

With ``pooling.length_buckets: auto`` a replica starts on the buckets learned from the lengths the model's replicas
recorded (or the defaults), and keeps looking while it serves (buckets/learn.py: when it looks, what it proposes;
assembly/rebucket.py: how a grid compiles beside serving and switches). A request padded for the old buckets as the
switch lands runs on the new bucket that holds it, padded further: answers are the same whichever bucket runs them.

What a person reads: a log line per decision, ``neuron_serve_bucket_switches_total{family="length", outcome}``, and
the model's metadata (``parameters.length_buckets``, ``length_buckets_from``, ``rebucketing``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from ..assembly.grid import Entry, GridBuild
from ..assembly.rebucket import GridRebucketing
from ..config.schema import ModelConfig
from ..model import CompiledModel
from .build import grid_source
from .spec import PoolingSpec


class LengthRebucketing(GridRebucketing):
    """One pooling plane's length buckets. ``plane`` is the replica's serve/pooling/plane.PoolingPlane: its spec,
    usage, data plane and ``switch``; ``module`` the pooling graph its buckets were compiled from."""

    family = "length"
    what = "length buckets"
    unit = "inputs"

    def __init__(self, plane: Any, config: ModelConfig, base_dir: str | Path | None, module: Any,
                 every: int, ready: Callable[[], bool]) -> None:
        super().__init__(config.name, plane.data.replica, plane.usage, every, ready)
        self.config = config
        self.plane = plane
        self.base_dir = base_dir
        self.module = module

    def current(self) -> list[int]:
        return list(self.plane.spec.length_buckets)

    def served(self) -> CompiledModel:
        return self.plane.data.runner.model

    def held(self, model: CompiledModel) -> dict[tuple[int, int], Any]:
        return {(model.spec.sizes[i][0], bucket.batch_size): bucket
                for i in range(len(model.buckets)) for bucket in model.grid(i)}

    def grid(self, sizes: list[int]) -> tuple[GridBuild, Callable[[Entry], tuple[int, int]]]:
        spec = self._spec(sizes, self.plane.spec.buckets_from)
        grid = GridBuild(self.config, self.base_dir, source=grid_source(self.module, spec, self.config, self.base_dir))
        return grid, lambda entry: (sizes[entry.bucket], entry.batch)

    def apply(self, model: CompiledModel, sizes: list[int], source: str) -> None:
        self.plane.switch(model, self._spec(sizes, source))

    def _spec(self, sizes: list[int], source: str) -> PoolingSpec:
        return dataclasses.replace(self.plane.spec, length_buckets=tuple(sizes), buckets_from=source)


def families(plane: Any, config: ModelConfig, base_dir: str | Path | None,
             build: Any) -> dict[str, Callable[[int], LengthRebucketing]]:
    """A pooling model's one list that may be auto, ``length_buckets``, for buckets/learn.attach: ``plane`` is the
    replica's serve/pooling/plane.PoolingPlane, ``build`` its pooling build (the graph its buckets compile from)."""
    return {"length_buckets": lambda every: LengthRebucketing(plane, config, base_dir, build.source.module, every,
                                                              build.finished.is_set)}
