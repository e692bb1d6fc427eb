"""From a model.yaml to a compiled model: the build that replicas and `neuron-serve build` run.

A model.yaml names either a factory (built here: capture, analyze, partition,
compile per bucket, dynamic batch) or an artifact written by ``neuron-serve build``
(loaded, after its hashes and versions are checked).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch.utils._pytree as pytree

from . import artifact, progress
from .api import dynamic_batch, trace, trace_buckets
from .bucketing import BucketedModule, BucketSpec
from .compile import cache as compile_cache
from .config import ModelConfig, build_model
from .errors import ArtifactError, ConfigError
from .traced import TracedModule

logger = logging.getLogger("neuron_serve")


@dataclass
class BuiltModel:
    """A compiled model and what serving it needs besides."""

    module: TracedModule | BucketedModule
    output_names: list[str]
    seconds: float

    @property
    def buckets(self) -> list[TracedModule]:
        return list(self.module.buckets) if isinstance(self.module, BucketedModule) else [self.module]

    @property
    def spec(self) -> BucketSpec | None:
        return self.module.spec if isinstance(self.module, BucketedModule) else None


def output_names(out_spec: pytree.TreeSpec, configured: list[str] | None) -> list[str]:
    """Names of the flattened outputs: configured, else the model's own keys."""
    structure = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(structure)[0]]
    if configured is not None:
        if len(configured) != len(paths):
            raise ConfigError(f"outputs: the model has {len(paths)} outputs {paths}, but {len(configured)} names are given.")
        return list(configured)
    names = []
    for i, path in enumerate(paths):
        name = path.strip(".[]'\"").replace("'][", ".").replace("][", ".")
        names.append(name if name and not name.isdigit() else f"output_{i}")
    return names


def artifact_path(config: ModelConfig, base_dir: str | Path | None) -> Path | None:
    if config.model.artifact is None:
        return None
    path = Path(config.model.artifact).expanduser()
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


def _compile(config: ModelConfig, base_dir: str | Path | None) -> TracedModule | BucketedModule:
    model = build_model(config, base_dir)
    example = config.example_inputs()
    partitioner = config.partitioner_config()
    if config.buckets is None:
        with progress.reporting(progress.BuildProgress(config.name, 1)):
            module: TracedModule | BucketedModule = trace(model, example, partitioner_config=partitioner,
                                                          target=config.target)
    else:
        spec = BucketSpec.build(sizes=config.buckets.sizes, inputs=config.buckets.inputs,
                                pad_values=config.buckets.pad_values, input_names=[i.name for i in config.inputs])
        with progress.reporting(progress.BuildProgress(config.name, len(spec.sizes))):
            module = trace_buckets(model, example, spec, partitioner_config=partitioner, target=config.target)
    if config.dynamic_batch:
        dynamic_batch(module)
    return module


def _check_inputs(module: TracedModule | BucketedModule, config: ModelConfig, path: Path) -> None:
    first = module.buckets[0] if isinstance(module, BucketedModule) else module
    built = [(list(s) if s is not None else None, d) for s, d in first.input_shapes]
    if len(built) != len(config.inputs) or any(d != spec.torch_dtype() for (_, d), spec in zip(built, config.inputs)):
        raise ArtifactError(
            f"model.artifact: {path} was built for inputs {[(s, str(d)) for s, d in built]}, but this model.yaml "
            f"declares {[(i.name, i.shape, i.dtype) for i in config.inputs]}; rebuild the artifact from this model.yaml."
        )


def build(config: ModelConfig, base_dir: str | Path | None = None) -> BuiltModel:
    """Compile (or load) the model of ``config``; logs progress per bucket and subgraph."""
    started = time.perf_counter()
    compile_cache.current()  # opens the persistent cache before anything compiles
    path = artifact_path(config, base_dir)
    if path is not None:
        module = artifact.load(path)
        _check_inputs(module, config, path)
    else:
        module = _compile(config, base_dir)
    first = module.buckets[0] if isinstance(module, BucketedModule) else module
    names = output_names(first.out_spec, config.outputs)
    if isinstance(module, BucketedModule) and module.spec is not None and config.buckets and config.buckets.outputs:
        unknown = sorted(set(config.buckets.outputs) - set(names))
        if unknown:
            raise ConfigError(f"buckets.outputs: unknown outputs {unknown}; outputs are {names}.")
        module.spec.outputs = {names.index(k): BucketSpec.build([1], {0: v}).inputs[0]
                               for k, v in config.buckets.outputs.items()}
    seconds = time.perf_counter() - started
    logger.info("model %s built in %.1fs%s", config.name, seconds, f" from artifact {path}" if path else "")
    return BuiltModel(module, names, seconds)


def trace_batch(config: ModelConfig) -> int:
    shape = config.inputs[0].shape
    return shape[0] if shape else 1

