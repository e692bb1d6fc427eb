"""From a model.yaml to a compiled model: the build that replicas and `neuron-serve build` run.

A model.yaml names either a factory (built here: capture, analyze, partition,
compile per bucket, dynamic batch) or an artifact written by ``neuron-serve build``
(loaded, after its hashes and versions are checked). A ``weights`` checkpoint is then
swapped into the weight-separated model without compiling. Either way the result is a
:class:`~neuron_serve.model.CompiledModel` named after the model.yaml's inputs and
outputs, which the runtime then runs without looking at the model.yaml again.

Every compile runs on the process's compile queue (assembly/queue.py), one compiled model a
job (:class:`StagedBuild`): a replica is ready on the first (model.yaml's
``background_compile``) and takes the others as they are compiled; :func:`build` waits for
all of them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from . import artifact, progress
from ..buckets import usage as bucket_usage
from .grid import Entry, GridBuild, Source
from .queue import BACKGROUND, COMPILED, FAILED, READY, CompileGroup, CompileJob, CompileQueue, compile_queue
from ..api import dynamic_batch
from ..buckets.shape import as_dims
from ..compile import cache as compile_cache
from ..compile.subgraph import compile_count
from ..config.schema import ModelConfig
from ..errors import ArtifactError, ConfigError
from ..model import Bucket, CompiledModel
from ..model.signature import output_names
from .weights import check_state_dict, is_weight_separated, replace_weights

T = TypeVar("T")
logger = logging.getLogger("neuron_serve")


def artifact_path(config: ModelConfig, base_dir: str | Path | None) -> Path | None:
    if config.model.artifact is None:
        return None
    path = Path(config.model.artifact).expanduser()
    return path if path.is_absolute() or base_dir is None else Path(base_dir) / path


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



def _swap_weights(module: CompiledModel, config: ModelConfig, base_dir: str | Path | None) -> None:
    """An artifact's executables handed the ``weights`` checkpoint (nothing compiled for it)."""
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


def load_artifact(config: ModelConfig, base_dir: str | Path | None, path: Path) -> CompiledModel:
    """The artifact ``path`` loaded and checked against ``config``, its ``weights`` swapped in."""
    check_weights(config, base_dir)  # before the artifact's subgraphs compile
    module = artifact.load(path)
    _check_inputs(module, config, path)
    _check_separation(is_weight_separated(module), config, path)
    if config.weights is not None:
        _swap_weights(module, config, base_dir)
    # An artifact keeps its stages' cores; whether to copy the pipeline onto idle cores is the deployment's choice.
    module.saturate_host = config.model_placement().saturates_host
    if config.dynamic_batch:
        dynamic_batch(module)
    return module


_builds = itertools.count(1)


class StagedBuild:
    """A model.yaml's build on the process's compile queue, one job per compiled model.

    The models the replica needs to answer every request (the largest shape bucket at the
    largest batch size: see buckets/order.py) compile first; with ``background`` (model.yaml
    ``background_compile``, the default) the replica is then ready, and the rest compile
    behind, most padding saved first, each handed to ``grow`` once compiled. Without it
    everything compiles before the replica is ready. An artifact is loaded in one job (in
    emulation its models compile again on load), before ready.
    """

    def __init__(self, config: ModelConfig, base_dir: str | Path | None = None, *,
                 background: bool | None = None, queue: CompileQueue | None = None,
                 source: Source | None = None) -> None:
        # batch_sizes: auto starts on the sizes the traffic recorded calls for (an artifact keeps its own).
        self.path = artifact_path(config, base_dir)
        self.config = config if self.path is not None else bucket_usage.learned_batch_sizes(config)
        self.base_dir = base_dir
        self.source = source  # the grid's module and buckets, when not the model.yaml's factory (pooling)
        self.background = config.background_compile if background is None else background
        # This build's jobs; a process may build a model of the same name twice (tests, bench).
        self.compiles: CompileGroup = (queue or compile_queue()).group(f"{config.name}#{next(_builds)}")
        self.grid: GridBuild | None = None
        self.started = time.perf_counter()
        self.ready_seconds: float | None = None  # from the build's start to the start-up models compiled
        self.finished = threading.Event()  # every compile has ended, and every compiled model has joined
        self._lock = threading.Lock()
        self._open = 0  # compiles not yet ended and compiled models not yet handed to grow
        self._artifact_module: CompiledModel | None = None
        self._store = compile_cache.current()  # opens the persistent cache before anything compiles
        self._compiles = compile_count()

    def start(self, load: Callable[[CompiledModel], T] = lambda model: model,
              grow: Callable[[CompiledModel], None] | None = None) -> T:
        """Queue every compile; once the start-up ones are compiled (every one without
        background), return ``load(model)``, run on the queue's thread (loading onto cores
        compiles too). Raises the error of a start-up compile that failed, after dropping the
        other compiles. Each later compiled model goes to ``grow(model)`` (on the queue's thread),
        ``model`` then holding every model compiled so far.
        """
        if self.path is not None:
            needed = [self.compiles.submit(f"{self.config.name} (artifact {self.path})", self._load_artifact,
                                           priority=READY)]
            loading = self.compiles.submit(f"load {self.config.name}", functools.partial(self._load, needed, load),
                                           priority=READY, kind="load")
            return self._ready(needed, loading)
        self.grid = GridBuild(self.config, self.base_dir, self._weights_swapper(), staged=self.background,
                              source=self.source)
        early = [e for e in self.grid.order if e in self.grid.ready or not self.background]
        self._open = len(self.grid.order)
        needed = [self._submit(entry, READY, grow) for entry in early]
        # The load is queued before any background compile, so that none can run ahead of it.
        loading = self.compiles.submit(f"load {self.config.name}", functools.partial(self._load, needed, load),
                                       priority=READY, kind="load")
        for entry in self.grid.order:
            if entry not in early:
                self._submit(entry, BACKGROUND, grow)
        return self._ready(needed, loading)

    def _submit(self, entry: Entry, priority: int, grow: Callable[[CompiledModel], None] | None) -> CompileJob:
        return self.compiles.submit(self.grid.label(entry), functools.partial(self._compile, entry, grow),
                                    priority=priority)

    def _weights_swapper(self) -> Callable[[CompiledModel], None] | None:
        """What hands each compiled model the ``weights`` checkpoint (read once), when there is one."""
        if self.config.weights is None:
            return None
        checkpoint = self.config.weights_path(self.base_dir)
        state = artifact.read_weights(checkpoint, "weights")

        def swap(module: CompiledModel) -> None:
            try:
                replace_weights(module, state)
            except ConfigError as exc:
                raise _weights_error(self.config, checkpoint, str(exc)) from None
        logger.info("model %s: weights from %s (%d tensors) are swapped into each compiled model; nothing is "
                    "compiled for them", self.config.name, checkpoint, len(state))
        return swap

    def _ready(self, needed: list[CompileJob], loading: CompileJob) -> T:
        self.compiles.wait([*needed, loading])
        failed = next((j for j in needed if j.state == FAILED), None)
        try:
            if failed is not None:
                raise failed.future.exception()
            return loading.future.result()
        except BaseException:
            self.compiles.cancel()  # nothing more to compile for a replica that will not serve
            raise

    def _load(self, needed: list[CompileJob], load: Callable[[CompiledModel], T]) -> T | None:
        if any(j.state != COMPILED for j in needed):
            # The replica will not serve: drop the other compiles before the worker takes one
            # (_ready raises the failed compile's own error).
            self.compiles.cancel()
            return None
        model = self.model()
        self.ready_seconds = time.perf_counter() - self.started
        counts = self.compiles.counts()
        waiting = counts.pending + counts.running
        if not waiting:
            if self.grid is not None:
                self.grid.finish()  # every model compiled: the placement line, as a build has always ended
            self.finished.set()
        logger.info("model %s built in %.1fs%s", self.config.name, self.ready_seconds,
                    f" from artifact {self.path}" if self.path else
                    f"; ready on {counts.compiled} of {counts.compiled + waiting} compiled models, the other "
                    f"{waiting} compile in the background" if waiting else "")
        return load(model)

    def _compile(self, entry: Entry, grow: Callable[[CompiledModel], None] | None) -> Bucket:
        background = self.ready_seconds is not None
        try:
            bucket = self.grid.compile(entry)
        except Exception:
            if background:  # logged and counted by the queue; the replica serves on the others
                self._ended()
            raise
        if background and grow is not None:  # joins the runtime next, before the next compile
            self.compiles.submit(f"load {self.grid.label(entry)}", functools.partial(self._grow, grow),
                                 priority=READY, kind="load")
        else:
            self._ended()
        return bucket

    def _grow(self, grow: Callable[[CompiledModel], None]) -> None:
        try:
            grow(self.model())
        finally:
            self._ended()

    def _ended(self) -> None:
        """One compile ended or one compiled model joined; the last logs the end of the background compile."""
        with self._lock:
            self._open -= 1
            last = self._open == 0 and self.ready_seconds is not None and not self.finished.is_set()
        if last:
            self.grid.finish()
            counts = self.compiles.counts()
            logger.info("model %s: background compile finished %.1f s after the build began: %d compiled models%s",
                        self.config.name, time.perf_counter() - self.started, counts.compiled,
                        progress.failures_said(self.compiles.failures()))
            self.finished.set()

    def _load_artifact(self) -> CompiledModel:
        self._artifact_module = load_artifact(self.config, self.base_dir, self.path)
        return self._artifact_module

    def model(self) -> CompiledModel:
        """The models compiled so far, as one CompiledModel named as the model.yaml says."""
        module = self._artifact_module if self.path is not None else self.grid.model()
        if self.source is not None:
            module.input_names, module.output_names = list(self.source.input_names), list(self.source.output_names)
        else:
            _name(module, self.config)
        module.build_info.seconds = time.perf_counter() - self.started
        module.build_info.compiles = compile_count() - self._compiles
        module.build_info.weights = self.config.weights_path(self.base_dir)
        module.build_info.artifact = str(self.path) if self.path is not None else None
        module.build_info.cache_hits = {kind: s.hits for kind, s in (self._store.stats.items()
                                                                     if self._store is not None else ())}
        return module


def build(config: ModelConfig, base_dir: str | Path | None = None) -> CompiledModel:
    """Compile (or load) the model of ``config``, every compiled model of it; logs progress per
    compiled model and subgraph. The compiles run on the process's compile queue."""
    return StagedBuild(config, base_dir, background=False).start()
