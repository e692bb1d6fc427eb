"""From a model.yaml to a compiled model: the build that replicas and `neuron-serve build` run.

A model.yaml names either a factory (built here: capture, analyze, partition,
compile per bucket, dynamic batch) or an artifact written by ``neuron-serve build``
(loaded, after its hashes and versions are checked). Either way the result is a
:class:`~neuron_serve.model.CompiledModel` named after the model.yaml's inputs and
outputs, which the runtime then runs without looking at the model.yaml again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from . import artifact, progress
from .api import dynamic_batch, trace, trace_buckets
from .bucketing import BucketSpec, as_dims
from .compile import cache as compile_cache
from .config import ModelConfig, build_model
from .errors import ArtifactError, ConfigError
from .model import CompiledModel
from .model.signature import output_names

logger = logging.getLogger("neuron_serve")


def artifact_path(config: ModelConfig, base_dir: str | Path | None) -> Path | None:
    if config.model.artifact is None:
        return None
    path = Path(config.model.artifact).expanduser()
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


def _compile(config: ModelConfig, base_dir: str | Path | None) -> CompiledModel:
    model = build_model(config, base_dir)
    example = config.example_inputs()
    partitioner = config.partitioner_config()
    sizes = config.compiled_batch_sizes()
    steps = len(sizes) if sizes else 1
    if config.buckets is None:
        with progress.reporting(progress.BuildProgress(config.name, 1, batch_sizes=steps)):
            return trace(model, example, partitioner_config=partitioner, target=config.target, batch_sizes=sizes,
                         compiler_args=config.compiler_args, placement=config.model_placement())
    spec = BucketSpec.build(sizes=config.buckets.sizes, inputs=config.buckets.inputs,
                            pad_values=config.buckets.pad_values, input_names=[i.name for i in config.inputs])
    with progress.reporting(progress.BuildProgress(config.name, len(spec.sizes), batch_sizes=steps)):
        return trace_buckets(model, example, spec, partitioner_config=partitioner, target=config.target,
                             batch_sizes=sizes, compiler_args=config.compiler_args,
                             placement=config.model_placement())


def _check_inputs(module: CompiledModel, config: ModelConfig, path: Path) -> None:
    """Refuse an artifact whose compiled inputs do not take what the model.yaml declares."""
    built = module.signature().inputs
    declared = config.inputs
    fits = len(built) == len(declared) and all(
        b.dtype == d.torch_dtype() and b.accepts(d.shape) for b, d in zip(built, declared)
    )
    if config.batch_sizes is not None and config.batch_sizes != module.batch_sizes:
        raise ArtifactError(
            f"batch_sizes: {path} was built for batch sizes {module.batch_sizes}, but this model.yaml asks for "
            f"{config.batch_sizes}; rebuild the artifact from this model.yaml or remove batch_sizes."
        )
    if module.pipelined != config.model_placement().pipelined:
        built_as = f"pipelined over {module.pipeline_span} core(s)" if module.pipelined else "replicated"
        raise ArtifactError(f"placement: {path} was built {built_as}, but this model.yaml asks for placement mode "
                            f"{config.placement.mode}; rebuild the artifact from this model.yaml.")
    if not fits:
        raise ArtifactError(
            f"model.artifact: {path} was built for inputs {[(list(b.shape), str(b.dtype)) for b in built]} "
            f"(-1: any size), but this model.yaml declares {[(i.name, i.shape, i.dtype) for i in declared]}; "
            f"rebuild the artifact from this model.yaml."
        )


def _name(module: CompiledModel, config: ModelConfig) -> None:
    """Give the compiled inputs and outputs the model.yaml's names."""
    module.input_names = [i.name for i in config.inputs]
    module.output_names = output_names(module.first.out_spec, config.outputs)
    if module.spec is not None and config.buckets and config.buckets.outputs:
        names = module.output_names
        unknown = sorted(set(config.buckets.outputs) - set(names))
        if unknown:
            raise ConfigError(f"buckets.outputs: unknown outputs {unknown}; outputs are {names}.")
        module.spec.outputs = {names.index(k): as_dims(v) for k, v in config.buckets.outputs.items()}


def build(config: ModelConfig, base_dir: str | Path | None = None) -> CompiledModel:
    """Compile (or load) the model of ``config``; logs progress per bucket and subgraph."""
    started = time.perf_counter()
    store = compile_cache.current()  # opens the persistent cache before anything compiles
    path = artifact_path(config, base_dir)
    if path is not None:
        module = artifact.load(path)
        _check_inputs(module, config, path)
    else:
        module = _compile(config, base_dir)
    # An artifact keeps its stages' cores; whether to copy the pipeline onto idle cores is the deployment's choice.
    module.saturate_host = config.model_placement().saturates_host
    if config.dynamic_batch:
        dynamic_batch(module)
    _name(module, config)
    module.build_info.seconds = time.perf_counter() - started
    module.build_info.artifact = str(path) if path is not None else None
    module.build_info.cache_hits = {kind: s.hits for kind, s in (store.stats.items() if store is not None else ())}
    logger.info("model %s built in %.1fs%s", config.name, module.build_info.seconds,
                f" from artifact {path}" if path else "")
    return module
