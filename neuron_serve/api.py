"""analyze() and trace(): torch-neuronx's entry points, on torch.fx and torch-xla."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from .assembly import progress
from .buckets import dynamic_batch as batching
from .analysis.capture import as_args, capture
from .analysis.explain_failure import compile_error, internal_compile_error
from .analysis.placement import GraphAnalysis, analyze_graph
from .analysis.report import build_report, log_support, write_report
from .buckets.shape import BucketModelConfig, BucketSpec
from .compile import aliases as state_aliases
from .compile import state_view
from .compile import workdir as workdirs
from .config.compiler_args import NONE, CompilerArgs
from .compile.passes.auto_cast import auto_cast
from .compile.subgraph import CompiledSubgraph
from .errors import ConfigError, UnsupportedModelError
from .model import Bucket, CompiledModel, graph
from .model.state import DeviceState
from .buckets.batch_sizes import check_batch_sizes, resize_rows
from .partition.config import PartitionerConfig
from .partition.kwargs import check_analyze_parameters, resolve
from .partition.pipeline import pipeline_partitions
from .partition.placement import ModelPlacement, as_placement
from .partition.plan import ACCEL_PREFIX, PartitionPlan, Placement, plan_partitions
from .positional import TRACE_ORDER, infer_keywords
from .targets import get_target, xla_state
from .targets.pjrt import xla
from .assembly.weights import check_inline_weights

logger = logging.getLogger("neuron_serve")


def analyze(model: Callable, example_inputs: Any, target: str = "neuron", *, compiler_workdir: str | None = None,
            additional_ignored_ops: set[str] | None = None, max_workers: int = 1) -> dict:
    """Report which ATen operators ``target`` can run, in torch-neuronx's JSON format.

    ``support_percentage`` counts arithmetic operations (no getitem, attribute or
    constant nodes); each unsupported operator comes with the stage that refused it
    (``failureAt``), its call site (``call``: "file.py 28") and the reason.
    As torch-neuronx's: ``additional_ignored_ops`` are left out of the counts,
    ``max_workers`` threads run the support checks, and the report is also written to
    ``compiler_workdir``/analyze.json.
    """
    params = check_analyze_parameters({"compiler_workdir": compiler_workdir, "max_workers": max_workers,
                                       "additional_ignored_ops": additional_ignored_ops}, "analyze()")
    captured = capture(model, example_inputs)
    analysis = analyze_graph(captured, get_target(target), ignored_ops=params.additional_ignored_ops,
                             max_workers=params.max_workers)
    if params.compiler_workdir:
        write_report(analysis, params.compiler_workdir)
    return build_report(analysis)


def placement(analysis: GraphAnalysis) -> Placement:
    """The analysis as the planner takes it: each arithmetic node's operator, and which are supported."""
    return Placement(
        ops={r.node: r.op for r in analysis.records},
        supported=frozenset(r.node for r in analysis.records if r.supported),
        target=analysis.target.name,
        device_label=analysis.target.device_label,
        supported_count=analysis.supported_count,
        total=analysis.total,
        support_fraction=analysis.support_fraction,
        support_percentage=analysis.support_percentage,
    )


def _unsupported_error(analysis: GraphAnalysis) -> UnsupportedModelError:
    lines = [
        f"  {r.op} at {r.site.log_form if r.site else '<unknown call site>'}: {r.decision.reason}"
        for r in analysis.unsupported()
    ]
    return UnsupportedModelError(
        f"The model has {len(lines)} operator(s) that target '{analysis.target.name}' cannot run:\n"
        + "\n".join(lines)
        + "\nPass partitioner_config=neuron_serve.PartitionerConfig() to run them on CPU."
    )


def _compiled_subgraph(source: torch.fx.GraphModule, args: tuple, name: str, **options: Any) -> CompiledSubgraph:
    """``source`` compiled; a failure of torch-xla's own state is tried once more in a clean state, then raised as
    an internal error (an operator's failure names the operator and its line)."""
    for attempt in (1, 2):
        try:
            return CompiledSubgraph(source, args, name=name, **options)
        except Exception as exc:  # torch-xla raises many types
            if not xla_state.internal_failure(exc):
                raise compile_error(exc, source, name) from None
            if attempt == 2:
                raise internal_compile_error(exc, name) from None
            logger.warning("compiling subgraph %s failed inside torch-xla (%s: %s); trying it again in a clean "
                           "state", name, type(exc).__name__, str(exc).strip().splitlines()[0][:200])
            with xla_state.exclusive():
                xla_state.clean_state(xla())
    raise AssertionError("unreachable")


def _compile_partitions(plan: PartitionPlan, flat_inputs: list, compiler_workdir: str | None,
                        compiler_args: CompilerArgs = NONE, inline_weights: bool = True,
                        donate: dict[str, list[int]] | None = None) -> tuple[list, dict]:
    """Replace each accelerator submodule by its compiled form.

    The split graph runs once on the example inputs; each accelerator partition is
    compiled on the inputs it receives there and then run compiled, so downstream
    partitions see the outputs they will see at inference. Returns the outputs and
    the (shape, dtype) of every partition's inputs, which saving a module needs.
    """
    gm = plan.gm
    accel_total = sum(1 for p in plan.partitions if p.name.startswith(ACCEL_PREFIX))
    stage_inputs: dict[str, list] = {}

    def compile_then_call(name: str, args: tuple) -> Any:
        stage_inputs[name] = [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None for a in args]
        if name.startswith(ACCEL_PREFIX):
            index = sum(1 for n in stage_inputs if n.startswith(ACCEL_PREFIX))
            source = gm.get_submodule(name)
            if compiler_args.cast_dtype is not None:  # neuronx-cc's --auto-cast, reproduced in the graph
                auto_cast(source, compiler_args.auto_cast, getattr(torch, compiler_args.cast_dtype))
            with progress.subgraph(name, index, accel_total):
                compiled = _compiled_subgraph(source, args, name, compiler_workdir=compiler_workdir,
                                              compiler_args=compiler_args, inline_weights=inline_weights,
                                              donate=(donate or {}).get(name, ()))
            setattr(gm, name, compiled)
        return gm.get_submodule(name)(*args)

    with torch.no_grad():
        outputs = graph.run(gm, flat_inputs, compile_then_call)
    progress.bucket_done(plan.partitions)
    return outputs, stage_inputs


@infer_keywords(TRACE_ORDER, required=2)
def trace(
    func: Callable,
    example_inputs: Any,
    *,
    input_output_aliases: dict | None = None,
    partitioner_config: PartitionerConfig | None = None,
    compiler_args: str | list[str] | None = None,
    compiler_workdir: str | None = None,
    target: str = "neuron",
    batch_sizes: Sequence[int] | None = None,
    inline_weights_to_neff: bool = True,
    placement: ModelPlacement | dict | None = None,
) -> CompiledModel:
    """Capture, partition and compile ``func`` for ``target``; returns a one-bucket CompiledModel.

    Without ``partitioner_config`` every operator must be supported; otherwise the
    error lists each unsupported operator with its call site. With one, unsupported
    operators (and ``ops_to_partition``) run in CPU subgraphs.

    ``batch_sizes`` compiles the model once per size, each from the example inputs cut
    or grown (repeating the last row) along dim 0 to that size; a call (with
    ``dynamic_batch``) and the server then run a batch as the cheapest compiled sizes.
    Without it the model is compiled at the example's batch only.

    ``compiler_args`` are neuronx-cc's (checked against its options; ``--auto-cast``
    is reproduced in emulation); keyword arguments passed positionally are inferred in
    torch-neuronx's order with a DeprecationWarning.

    ``inline_weights_to_neff=False`` keeps parameters and buffers out of the compiled
    executables (they are inputs, resident on the core); see :func:`replace_weights`.

    ``input_output_aliases={model.cache: 1}`` makes parameters or buffers of ``func``
    state tensors: they stay on the core across calls and output 1 (of the flattened
    outputs) is written over ``model.cache`` after every call. The call returns every
    output, as torch-neuronx does; an aliased one is the state tensor on the core.

    ``placement=ModelPlacement(mode="pipeline", cores_per_pipeline=2)`` (or the same as a dict)
    splits the model into stages over that many cores, by memory or balanced latency; the
    runtime pipelines chunks through them (see :class:`~neuron_serve.ModelPlacement`).
    """
    inline = check_inline_weights(inline_weights_to_neff)
    where_to = as_placement(placement)
    states = state_aliases.check_aliases(func, input_output_aliases)
    if states and batch_sizes is not None:
        raise ConfigError("trace(input_output_aliases=...) cannot be combined with batch_sizes: each compiled batch "
                          "size would need its own state. Trace at one batch size.")
    if states and where_to.pipelined:
        raise ConfigError("trace(input_output_aliases=...) cannot be combined with placement mode pipeline: the state "
                          "lives on one core. Use placement mode replicate.")
    grid = _trace_sizes(lambda example, where: _trace_bucket(func, example, partitioner_config, compiler_workdir,
                                                             target, compiler_args, where, inline_weights=inline,
                                                             states=states, model_placement=where_to),
                        as_args(example_inputs), batch_sizes)
    return _placed(CompiledModel([grid[-1]], smaller=[grid[:-1]]), where_to)


def _placed(model: CompiledModel, placement: ModelPlacement) -> CompiledModel:
    # The runtime reads the stages' cores from the partitions; only the copying is a setting.
    model.saturate_host = placement.saturates_host
    return model


def _trace_sizes(trace_one: Callable[[tuple, tuple], Bucket], example: tuple, batch_sizes: Sequence[int] | None,
                 where: tuple[str, ...] = ()) -> list[Bucket]:
    """``trace_one`` at each batch size (the example resized along dim 0), smallest first.

    ``trace_one(example, where)`` gets the compiler_workdir subfolder of its compile.
    """
    if batch_sizes is None:
        return [trace_one(example, where)]
    try:
        sizes = check_batch_sizes(batch_sizes, field="trace(batch_sizes=...)")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    flat, spec = pytree.tree_flatten(example)
    batching.trace_batch_size([t.shape if isinstance(t, torch.Tensor) else None for t in flat], "example input")
    resized = [
        pytree.tree_unflatten([resize_rows(t, n) if isinstance(t, torch.Tensor) else t for t in flat], spec)
        for n in sizes
    ]
    grid = []
    for n, example in zip(sizes, resized):
        progress.batch_size(n)
        grid.append(trace_one(example, (*where, *workdirs.batch_part(n, len(sizes)))))
    return grid


def _trace_bucket(
    func: Callable,
    example_inputs: Any,
    partitioner_config: PartitionerConfig | None,
    compiler_workdir: str | None,
    target: str,
    compiler_args: Any = None,
    where: tuple[str, ...] = (),
    inline_weights: bool = True,
    states: list[state_aliases.StateSpec] = (),
    shared_state: DeviceState | None = None,
    model_placement: ModelPlacement | None = None,
) -> Bucket:
    if partitioner_config is not None and not isinstance(partitioner_config, PartitionerConfig):
        raise ConfigError("trace(partitioner_config=...) must be a neuron_serve.PartitionerConfig.")
    config = partitioner_config or PartitionerConfig(model_support_percentage_threshold=0.0)
    cc_args, compiler_workdir = resolve(compiler_args, compiler_workdir, config.trace_kwargs, "trace")
    compiler_workdir = workdirs.subdir(compiler_workdir, *where)
    params = config.analyze
    tgt = get_target(target)
    args = as_args(example_inputs)
    captured = capture(func, args)
    user_inputs = list(captured.flat_inputs)
    if states:
        state_aliases.check_outputs(captured.gm, states)
        state_aliases.lift_states(captured.gm, states)
        captured.flat_inputs = [*user_inputs, *(s.tensor for s in states)]
    analysis = analyze_graph(captured, tgt, ignored_ops=params.additional_ignored_ops,
                             max_workers=params.max_workers, compiler_flags=tuple(cc_args.cache_key()))
    if params.compiler_workdir:
        write_report(analysis, workdirs.subdir(params.compiler_workdir, *where))
    if partitioner_config is None and analysis.unsupported():
        raise _unsupported_error(analysis)
    log_support(analysis)
    pipelined = model_placement is not None and model_placement.pipelined
    if pipelined:
        plan, stages = pipeline_partitions(captured.gm, captured.flat_inputs, placement(analysis), config,
                                           model_placement.cores_per_pipeline, model_placement.balance_mode)
    else:
        plan = plan_partitions(captured.gm, placement(analysis), config)
    aliases, keep, donate = (state_aliases.plan_state_flow(plan.gm, states, len(user_inputs), ACCEL_PREFIX)
                             if states else ([], {}, {}))
    outputs, stage_inputs = _compile_partitions(plan, captured.flat_inputs, compiler_workdir, cc_args,
                                                inline_weights, donate)
    for name, indices in keep.items():
        plan.gm.get_submodule(name).keep_on_device = set(indices)
    # The captured model's module tree stays attached to the top graph after its nodes moved into the partitions:
    # it would keep every weight of the model alive in each compiled model (a second reference to the checkpoint
    # nothing reads).
    plan.gm.delete_all_unused_submodules()
    report = build_report(analysis)
    if cc_args:
        report["compiler_args"] = cc_args.describe()
    if pipelined:
        report["pipeline"] = {**stages.to_dict(), "stage_latency_sec": stages.stage_latency_sec()}
    bucket = Bucket(
        plan.gm,
        in_spec=captured.in_spec,
        out_spec=captured.out_spec,
        input_shapes=[(t.shape, t.dtype) if isinstance(t, torch.Tensor) else (None, None) for t in user_inputs],
        output_shapes=[t.shape if isinstance(t, torch.Tensor) else None for t in outputs],
        output_dtypes=[t.dtype if isinstance(t, torch.Tensor) else None for t in outputs],
        partitions=plan.partitions,
        report=report,
        target=tgt.name,
        stage_inputs=stage_inputs,
    )
    if states:
        bucket.state = shared_state if shared_state is not None else DeviceState(
            [s.name for s in states], [s.tensor for s in states])
        bucket.aliases = aliases
    return bucket


def dynamic_batch(neuron_script: CompiledModel) -> CompiledModel:
    """Let a traced model take any batch size; modifies it in place and returns it.

    Inputs are split along dim 0 into chunks of the trace-time batch size, the last
    chunk padded, and outputs concatenated and unpadded. Inputs whose non-0 dims
    differ from trace time, or whose dim 0 differ from each other, raise ValueError
    naming the input and both shapes. Models that cannot be chunked (inputs with
    different dim 0 at trace time, outputs without the batch in dim 0) are refused here.
    """
    if not isinstance(neuron_script, CompiledModel):
        raise ConfigError("dynamic_batch() takes the module returned by neuron_serve.trace() or bucket_model_trace().")
    if neuron_script.stateful:
        raise ConfigError("dynamic_batch() cannot chunk a model with input_output_aliases: every chunk would update "
                          "the state. Call it with the traced batch size.")
    for index in range(len(neuron_script.buckets)):
        for bucket in neuron_script.grid(index):
            batching.enable(bucket)
    return neuron_script


def bucket_model_trace(
    func: Callable[..., tuple[torch.nn.Module, dict]],
    example_inputs: list,
    bucket_config: BucketModelConfig,
    compiler_workdir: str | None = None,
    compiler_args: str | list[str] | None = None,
    *,
    partitioner_config: PartitionerConfig | None = None,
    target: str = "neuron",
) -> CompiledModel:
    """Compile one model per example input; the bucket kernel picks one per call.

    As in torch-neuronx, ``func(**func_kwargs)`` returns ``(model, input_output_aliases)``
    and ``bucket_config.bucket_kernel()`` returns the kernel mapping the list of inputs
    to (padded inputs, bucket index). Each bucket model's aliased tensors are state on
    the core (see :func:`trace`); with ``shared_state_buffer`` they are one state, shared
    by every bucket model: entry k is the initial value of each model's k-th aliased tensor.
    With ``shared_state_buffer_preprocessor`` a bucket model's k-th aliased tensor is the
    preprocessor's k-th view of the buffer (e.g. a slice), computed in its executable.
    """
    if not isinstance(bucket_config, BucketModelConfig):
        raise ConfigError("bucket_model_trace(bucket_config=...) must be a neuron_serve.BucketModelConfig.")
    if not example_inputs:
        raise ConfigError("bucket_model_trace needs one example input per bucket; got none.")
    shared = state_aliases.shared_state(bucket_config.shared_state_buffer)
    preprocess = state_view.preprocessor(bucket_config.shared_state_buffer_preprocessor)
    buckets = []
    for index, example in enumerate(example_inputs):
        model, aliases = func(**bucket_config.kwargs_for(index, len(example_inputs)))
        states = state_aliases.check_aliases(model, aliases, "bucket_model_trace")
        if preprocess is not None:
            model, states = state_view.wrap(model, states, bucket_config.shared_state_buffer, preprocess,
                                            as_args(example), index)
        elif shared is not None:
            states = state_aliases.bind_shared(states, bucket_config.shared_state_buffer, index)
        buckets.append(_trace_bucket(model, as_args(example), partitioner_config, compiler_workdir, target,
                                     compiler_args, workdirs.bucket_part(index, len(example_inputs)),
                                     states=states, shared_state=shared))
    return CompiledModel(buckets, kernel=bucket_config.bucket_kernel())


def trace_bucket_on_state(model: torch.nn.Module, aliases: dict, example_inputs: Any, shared_state: DeviceState,
                          *, target: str = "neuron", compiler_args: str | list[str] | None = None,
                          initial: list[torch.Tensor] | None = None, inline_weights_to_neff: bool = True) -> Bucket:
    """One more bucket model around a state that buckets compiled earlier already hold on the core.

    ``aliases`` name ``model``'s state tensors as ``bucket_model_trace``'s ``func`` returns
    them, in the state's order; the bucket reads and updates ``shared_state`` in place. For a
    bucket compiled when it is first needed (a model's rarely used variant) without
    compiling the others again. With ``inline_weights_to_neff=False`` its executable takes the
    weights as inputs, and shares their copy on the core with every other that takes them.
    """
    states = state_aliases.check_aliases(model, aliases, "trace_bucket_on_state")
    # ``initial``: the state's shapes and dtypes as host tensors, so a compile beside a running engine never reads
    # the state tensors the engine's calls replace.
    states = state_aliases.bind_shared(
        states, initial if initial is not None else [torch.zeros_like(t, device="cpu") for t in shared_state.tensors], 0)
    return _trace_bucket(model, as_args(example_inputs), None, None, target, compiler_args, states=states,
                         shared_state=shared_state, inline_weights=check_inline_weights(inline_weights_to_neff))


def trace_entry(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    buckets: BucketSpec | None = None,
    bucket: int = 0,
    batch_size: int | None = None,
    batch_sizes: Sequence[int] = (),
    partitioner_config: PartitionerConfig | None = None,
    compiler_args: str | list[str] | None = None,
    compiler_workdir: str | None = None,
    target: str = "neuron",
    inline_weights_to_neff: bool = True,
    placement: ModelPlacement | dict | None = None,
) -> Bucket:
    """One compiled model of :func:`trace_buckets`' grid (or of :func:`trace` with ``batch_sizes``):
    shape bucket ``bucket`` of ``buckets`` at ``batch_size`` rows, compiled alone, as they compile it.

    For builds that compile the grid one model at a time (a compile queue, the rest in the
    background). ``batch_sizes`` are every size of the grid (they name its compiler_workdir
    subfolder); ``batch_size`` None keeps the example's batch.
    """
    example = as_args(example_inputs)
    if buckets is not None:
        example = buckets.example_inputs(example, bucket)
    where = workdirs.bucket_part(bucket, len(buckets.sizes)) if buckets is not None else ()
    if batch_size is not None:
        flat, spec = pytree.tree_flatten(example)
        batching.trace_batch_size([t.shape if isinstance(t, torch.Tensor) else None for t in flat], "example input")
        example = pytree.tree_unflatten([resize_rows(t, batch_size) if isinstance(t, torch.Tensor) else t
                                         for t in flat], spec)
        where = (*where, *workdirs.batch_part(batch_size, len(batch_sizes)))
    return _trace_bucket(model, example, partitioner_config, compiler_workdir, target, compiler_args, where,
                         check_inline_weights(inline_weights_to_neff), model_placement=as_placement(placement))


def trace_buckets(
    model: torch.nn.Module,
    example_inputs: Any,
    buckets: BucketSpec,
    *,
    partitioner_config: PartitionerConfig | None = None,
    compiler_args: str | list[str] | None = None,
    compiler_workdir: str | None = None,
    target: str = "neuron",
    batch_sizes: Sequence[int] | None = None,
    inline_weights_to_neff: bool = True,
    placement: ModelPlacement | dict | None = None,
) -> CompiledModel:
    """The declarative form: trace ``model`` once per bucket of ``buckets`` (and per batch size, and
    placement, see trace)."""
    example = as_args(example_inputs)
    inline = check_inline_weights(inline_weights_to_neff)
    where_to = as_placement(placement)
    grids = [
        _trace_sizes(lambda args, where: _trace_bucket(model, args, partitioner_config, compiler_workdir, target,
                                                       compiler_args, where, inline, model_placement=where_to),
                     buckets.example_inputs(example, i), batch_sizes, workdirs.bucket_part(i, len(buckets.sizes)))
        for i in range(len(buckets.sizes))
    ]
    return _placed(CompiledModel([g[-1] for g in grids], smaller=[g[:-1] for g in grids], spec=buckets), where_to)
