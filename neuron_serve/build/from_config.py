"""From a model.yaml to a compiled model: the build that replicas and `neuron-serve build` run.

A model.yaml names either a factory (built here: capture, analyze, partition,
compile per bucket, dynamic batch) or an artifact written by ``neuron-serve build``
(loaded, after its hashes and versions are checked). A ``weights`` checkpoint is then
swapped into the weight-separated model without compiling. Either way the result is a
:class:`~neuron_serve.model.CompiledModel` named after the model.yaml's inputs and
outputs, which the runtime then runs without looking at the model.yaml again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from . import artifact, progress
from ..api import dynamic_batch, trace, trace_buckets
from ..buckets.shape import BucketSpec, as_dims
from ..compile import cache as compile_cache
from ..compile.subgraph import compile_count
from ..config.schema import ModelConfig, build_model
from ..errors import ArtifactError, ConfigError
from ..model import CompiledModel
from ..model.signature import output_names
from .weights import check_state_dict, is_weight_separated, replace_weights

logger = logging.getLogger("neuron_serve")


def artifact_path(config: ModelConfig, base_dir: str | Path | None) -> Path | None:
    if config.model.artifact is None:
        return None
    path = Path(config.model.artifact).expanduser()
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


def _compile(config: ModelConfig, base_dir: str | Path | None) -> CompiledModel:
    model = build_model(config, base_dir)
    example = config.example_inputs()
    partitioner = config.partitioner_config(base_dir)
    inline = config.inline_weights_to_neff is not False
    sizes = config.compiled_batch_sizes()
    steps = len(sizes) if sizes else 1
    if config.buckets is None:
        with progress.reporting(progress.BuildProgress(config.name, 1, batch_sizes=steps)):
            return trace(model, example, partitioner_config=partitioner, target=config.target, batch_sizes=sizes,
                         compiler_args=config.compiler_args, inline_weights_to_neff=inline,
                         placement=config.model_placement())
    spec = BucketSpec.build(sizes=config.buckets.sizes, inputs=config.buckets.inputs,
                            pad_values=config.buckets.pad_values, input_names=[i.name for i in config.inputs])
    with progress.reporting(progress.BuildProgress(config.name, len(spec.sizes), batch_sizes=steps)):
        return trace_buckets(model, example, spec, partitioner_config=partitioner, target=config.target,
                             batch_sizes=sizes, compiler_args=config.compiler_args, inline_weights_to_neff=inline,
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


def _check_separation(separated: bool, config: ModelConfig, path: Path) -> None:
    """An artifact serves as it was built; a model.yaml saying otherwise is refused."""
    if config.inline_weights_to_neff is not None and config.inline_weights_to_neff == separated:
        built = "apart from (inline_weights_to_neff: false)" if separated else "inside (inline_weights_to_neff: true)"
        raise ArtifactError(f"inline_weights_to_neff: {path} was built with its weights {built} its executables, "
                            "but this model.yaml says otherwise; remove the field or rebuild the artifact.")


def _weights_error(config: ModelConfig, path: str, problem: str) -> ConfigError:
    return ConfigError(f"weights: {path}: {problem.removeprefix('replace_weights: ')} Give a checkpoint of the "
                       "served architecture (torch.save(model.state_dict(), path) of the same model class and "
                       "config), or remove 'weights' to serve the model's own.")


def check_weights(config: ModelConfig, base_dir: str | Path | None) -> None:
    """Refuse, before anything is started, a ``weights`` checkpoint that cannot fit an artifact.

    Reads the checkpoint and the artifact's weights (no compile); a factory's model is
    checked when it is built.
    """
    path = artifact_path(config, base_dir)
    if config.weights is None or path is None:
        return
    checkpoint = config.weights_path(base_dir)
    manifest = artifact.read_manifest(path)
    if not manifest.get("weights"):
        raise ConfigError(f"weights: {path} was built with its weights inside its executables, so {checkpoint} "
                          "cannot be swapped in; build it from a model.yaml with inline_weights_to_neff: false.")
    current = artifact.read_weights(path / manifest["weights"], f"artifact {path}")
    try:
        check_state_dict(current, artifact.read_weights(checkpoint, "weights"))
    except ConfigError as exc:
        if str(exc).startswith("weights: "):
            raise
        raise _weights_error(config, checkpoint, str(exc)) from None


def _swap_weights(module: CompiledModel, config: ModelConfig, base_dir: str | Path | None) -> None:
    checkpoint = config.weights_path(base_dir)
    state = artifact.read_weights(checkpoint, "weights")
    if not is_weight_separated(module):
        raise ConfigError(f"weights: the model's weights are compiled into its executables, so {checkpoint} cannot "
                          "be swapped in; build it with inline_weights_to_neff: false.")
    before = compile_count()
    try:
        replace_weights(module, state)
    except ConfigError as exc:
        raise _weights_error(config, checkpoint, str(exc)) from None
    logger.info("model %s: weights from %s (%d tensors) swapped in; %d subgraph(s) compiled for them", config.name,
                checkpoint, len(state), compile_count() - before)


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
    compiles = compile_count()
    store = compile_cache.current()  # opens the persistent cache before anything compiles
    path = artifact_path(config, base_dir)
    if path is not None:
        check_weights(config, base_dir)  # before the artifact's subgraphs compile
        module = artifact.load(path)
        _check_inputs(module, config, path)
        _check_separation(is_weight_separated(module), config, path)
    else:
        module = _compile(config, base_dir)
    if config.weights is not None:
        _swap_weights(module, config, base_dir)
    # An artifact keeps its stages' cores; whether to copy the pipeline onto idle cores is the deployment's choice.
    module.saturate_host = config.model_placement().saturates_host
    if config.dynamic_batch:
        dynamic_batch(module)
    _name(module, config)
    module.build_info.seconds = time.perf_counter() - started
    module.build_info.compiles = compile_count() - compiles
    module.build_info.weights = config.weights_path(base_dir)
    module.build_info.artifact = str(path) if path is not None else None
    module.build_info.cache_hits = {kind: s.hits for kind, s in (store.stats.items() if store is not None else ())}
    logger.info("model %s built in %.1fs%s", config.name, module.build_info.seconds,
                f" from artifact {path}" if path else "")
    return module
