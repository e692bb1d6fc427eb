"""A model.yaml's grid of compiled models, compiled one model at a time.

A task: infer model compiles each shape bucket (``buckets.sizes``) at each compiled batch
size (``batch_sizes``): a grid. Here each model of the grid is compiled alone
(:func:`~neuron_serve.api.trace_entry`, what ``trace_buckets`` does for each), so a compile
queue can run them one job each, in the order of :func:`~neuron_serve.buckets.order.compile_order`
(the largest shape bucket at the largest batch size first, then the most padding saved), and
:meth:`GridBuild.model` assembles the models compiled so far into one
:class:`~neuron_serve.model.CompiledModel`: the runtime runs a request on the smallest
compiled bucket that holds it, as the cheapest compiled batch sizes of that bucket.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..buckets import usage as bucket_usage
from . import host_memory, progress
from ..api import dynamic_batch, trace_entry
from ..buckets.order import compile_order
from ..compile import core_weights
from ..buckets.shape import BucketSpec
from ..config.factory import build_model
from ..config.schema import ModelConfig
from ..model import Bucket, CompiledModel
from ..partition.config import PartitionerConfig


@dataclass(frozen=True, order=True)
class Entry:
    """One model of the grid: shape bucket ``bucket`` (0-based) at ``batch`` rows."""

    bucket: int
    batch: int


@dataclass(frozen=True)
class Source:
    """A grid whose module, example and buckets are made elsewhere (a pooling model's graph over its length
    buckets) instead of from the model.yaml's factory, inputs and ``buckets``."""

    module: torch.nn.Module
    example: tuple
    spec: BucketSpec
    input_names: list[str]
    output_names: list[str]
    labels: list[str]  # a name per shape bucket, as its progress lines say it ("len 64")
    partitioner: PartitionerConfig
    weights: tuple[float, ...] | None = None  # each shape bucket's share of the traffic recorded (None: alike)


class GridBuild:
    """One model.yaml's grid: its entries in compile order, each compiled by :meth:`compile`
    (on the compile queue's thread), and :meth:`model` of those compiled so far. ``staged``:
    the replica is ready on ``ready`` and compiles the rest behind (else the grid's own order)."""

    def __init__(self, config: ModelConfig, base_dir: str | Path | None,
                 swap_weights: Callable[[CompiledModel], None] | None = None, staged: bool = True,
                 source: Source | None = None) -> None:
        self.config = config
        self.base_dir = base_dir
        self.source = source
        self.swap_weights = swap_weights  # hands each compiled model the model.yaml's 'weights' checkpoint
        self.sizes = config.compiled_batch_sizes()  # None: the example's batch only
        self.spec = source.spec if source is not None else None
        if source is None and config.buckets is not None:
            self.spec = BucketSpec.build(sizes=config.buckets.sizes, inputs=config.buckets.inputs,
                                         pad_values=config.buckets.pad_values,
                                         input_names=[i.name for i in config.inputs])
        shapes = self.spec.sizes if self.spec is not None else [[1]]
        batches = self.sizes or [(config.inputs[0].shape or [1])[0]]
        ready = [(len(shapes) - 1, max(batches))]  # any request fits it: see buckets/order.py
        if staged:  # what a replica needs to be ready first, then the most padding saved first
            weights = source.weights if source is not None else None
            if source is None and self.spec is not None and all(len(s) == 1 for s in shapes):
                # A model.yaml's one bucketed dim: weighted by the sizes its replicas recorded (buckets/usage.py).
                weights = bucket_usage.shares(config.name, "shape", [s[0] for s in shapes], "request sizes")
            self.order = [Entry(b, n) for b, n in compile_order(shapes, batches, max(batches), ready, weights)]
        else:  # everything before ready: bucket by bucket, smallest batch first, as trace_buckets
            self.order = [Entry(b, n) for b in range(len(shapes)) for n in sorted(batches)]
        self.ready = [Entry(b, n) for b, n in ready]
        self.progress = progress.BuildProgress(config.name, len(shapes), batch_sizes=len(batches),
                                               labels=source.labels if source is not None else None)
        self._module = source.module if source is not None else None
        # One draw for every model of the grid, as trace_buckets.
        self._example = source.example if source is not None else config.example_inputs()
        self._compiled: dict[Entry, Bucket] = {}
        self._lock = threading.Lock()

    @property
    def inline_weights(self) -> bool:
        """Whether each compiled model holds its weights (model.yaml's inline_weights_to_neff, true by default, as
        torch-neuronx's trace). A pooling model's never do: its compiled models take them as inputs and share one
        copy on each core (compile/core_weights.py)."""
        return self.source is None and self.config.inline_weights_to_neff is not False

    def label(self, entry: Entry) -> str:
        """The entry as its progress line names it: ``mlp batch 16``, ``encoder bucket 2 batch 4``."""
        parts = [self.config.name]
        if self.source is not None:
            parts.append(self.source.labels[entry.bucket])
        elif self.spec is not None and len(self.spec.sizes) > 1:
            parts.append(f"bucket {entry.bucket + 1}")
        if self.sizes is not None and len(self.sizes) > 1:
            parts.append(f"batch {entry.batch}")
        return " ".join(parts)

    def compile(self, entry: Entry) -> Bucket:
        """Compile ``entry`` (capture, analyze, partition, compile) and keep it; logs its progress line.

        Runs on the compile queue's thread: torch.export is not thread-safe.
        """
        config = self.config
        if self._module is None:  # the factory runs once, for the first compile
            self._module = build_model(config, self.base_dir)
        batch = entry.batch if self.sizes is not None else None  # None: the example's own batch
        partitioner = self.source.partitioner if self.source is not None else config.partitioner_config(self.base_dir)
        with progress.current(self.progress), host_memory.kept(core_weights.held_bytes) as measured:
            self.progress.at(entry.bucket, batch)
            bucket = trace_entry(self._module, self._example, buckets=self.spec, bucket=entry.bucket, batch_size=batch,
                                 batch_sizes=self.sizes or (), partitioner_config=partitioner,
                                 compiler_args=config.compiler_args, target=config.target,
                                 inline_weights_to_neff=self.inline_weights,
                                 placement=config.model_placement())
        bucket.host_bytes = measured.kept  # its code and bookkeeping; weights placed on the core counted apart
        alone = CompiledModel([bucket])
        if self.swap_weights is not None:
            self.swap_weights(alone)
        if config.dynamic_batch or self.source is not None:  # a pooling model takes any number of texts
            dynamic_batch(alone)
        with self._lock:
            self._compiled[entry] = bucket
        return bucket

    def adopt(self, entry: Entry, bucket: Bucket) -> None:
        """Take ``bucket``, compiled for another grid of the same module at ``entry``'s shape and batch size, as
        ``entry``'s: a replica that changes its buckets compiles only the ones it did not have."""
        with self._lock:
            self._compiled[entry] = bucket

    def at_batch_sizes(self, sizes: list[int]) -> GridBuild:
        """This grid at other batch sizes, of the same module, example and weights (its order smallest first): a
        replica that changes its batch sizes compiles those it does not have and adopts (:meth:`adopt`) the rest."""
        grid = GridBuild(self.config.model_copy(update={"batch_sizes": list(sizes)}), self.base_dir,
                         self.swap_weights, staged=False, source=self.source)
        grid._module, grid._example = self._module, self._example
        return grid

    def compiled(self) -> list[Entry]:
        """The entries compiled so far, in grid order."""
        with self._lock:
            return sorted(self._compiled)

    def model(self) -> CompiledModel:
        """The models compiled so far as one CompiledModel (at least one must be): each compiled
        shape bucket with its compiled batch sizes, the bucket spec cut to those shape buckets."""
        with self._lock:
            compiled = dict(self._compiled)
        if not compiled:
            raise RuntimeError(f"model {self.config.name}: nothing is compiled yet")
        grids: dict[int, list[Bucket]] = {}
        for entry in sorted(compiled):
            grids.setdefault(entry.bucket, []).append(compiled[entry])
        indices = sorted(grids)
        spec = None
        if self.spec is not None:
            spec = BucketSpec(sizes=[self.spec.sizes[i] for i in indices], inputs=self.spec.inputs,
                              pad_values=self.spec.pad_values, outputs=self.spec.outputs)
        module = CompiledModel([grids[i][-1] for i in indices], smaller=[grids[i][:-1] for i in indices], spec=spec)
        module.saturate_host = self.config.model_placement().saturates_host
        return module

    def finish(self) -> None:
        """Every entry has ended: log the placement line of those compiled."""
        self.progress.finish()
