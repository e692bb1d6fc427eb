"""analyze() and trace(): torch-neuronx's entry points, on torch.fx and torch-xla."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import batching, progress
from .analyze.capture import as_args, capture
from .analyze.explain_failure import compile_error
from .analyze.placement import GraphAnalysis, analyze_graph
from .analyze.report import build_report, log_support, write_report
from .bucketing import BucketModelConfig, BucketSpec
from .compile import workdir as workdirs
from .compiler_args import NONE, CompilerArgs
from .compile.passes.auto_cast import auto_cast
from .compile.subgraph import CompiledSubgraph
from .errors import ConfigError, UnsupportedModelError
from .model import Bucket, CompiledModel, graph
from .model.sizes import check_batch_sizes, resize_rows
from .partition.config import PartitionerConfig
from .partition.kwargs import check_analyze_parameters, resolve
from .partition.plan import ACCEL_PREFIX, PartitionPlan, Placement, plan_partitions
from .positional import TRACE_ORDER, infer_keywords
from .targets import get_target
from .weights import check_inline_weights

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
        ignored=frozenset(r.node for r in analysis.records if r.op in analysis.ignored),
        target=analysis.target.name,
        device_label=analysis.target.device_label,
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


def _compile_partitions(plan: PartitionPlan, flat_inputs: list, compiler_workdir: str | None,
                        compiler_args: CompilerArgs = NONE, inline_weights: bool = True) -> tuple[list, dict]:
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
                try:
                    compiled = CompiledSubgraph(source, args, name=name, compiler_workdir=compiler_workdir,
                                                compiler_args=compiler_args, inline_weights=inline_weights)
                except Exception as exc:  # torch-xla raises many types; name the operator and its line
                    raise compile_error(exc, source, name) from None
            setattr(gm, name, compiled)
        return gm.get_submodule(name)(*args)

    with torch.no_grad():
        outputs = graph.run(gm, flat_inputs, compile_then_call)
    progress.bucket_done()
    return outputs, stage_inputs


@infer_keywords(TRACE_ORDER, required=2)
def trace(
    func: Callable,
    example_inputs: Any,
    *,
    partitioner_config: PartitionerConfig | None = None,
    compiler_args: str | list[str] | None = None,
    compiler_workdir: str | None = None,
    target: str = "neuron",
    batch_sizes: Sequence[int] | None = None,
    inline_weights_to_neff: bool = True,
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
    """
    inline = check_inline_weights(inline_weights_to_neff)
    grid = _trace_sizes(lambda example, where: _trace_bucket(func, example, partitioner_config, compiler_workdir,
                                                             target, compiler_args, where, inline_weights=inline),
                        as_args(example_inputs), batch_sizes)
    return CompiledModel([grid[-1]], smaller=[grid[:-1]])


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
    analysis = analyze_graph(captured, tgt, ignored_ops=params.additional_ignored_ops,
                             max_workers=params.max_workers, compiler_flags=tuple(cc_args.cache_key()))
    if params.compiler_workdir:
        write_report(analysis, workdirs.subdir(params.compiler_workdir, *where))
    if partitioner_config is None and analysis.unsupported():
        raise _unsupported_error(analysis)
    log_support(analysis)
    plan = plan_partitions(captured.gm, placement(analysis), config)
    outputs, stage_inputs = _compile_partitions(plan, captured.flat_inputs, compiler_workdir, cc_args,
                                                inline_weights)
    report = build_report(analysis)
    if cc_args:
        report["compiler_args"] = cc_args.describe()
    return Bucket(
        plan.gm,
        in_spec=captured.in_spec,
        out_spec=captured.out_spec,
        input_shapes=[(t.shape, t.dtype) if isinstance(t, torch.Tensor) else (None, None) for t in captured.flat_inputs],
        output_shapes=[t.shape if isinstance(t, torch.Tensor) else None for t in outputs],
        output_dtypes=[t.dtype if isinstance(t, torch.Tensor) else None for t in outputs],
        partitions=plan.partitions,
        report=report,
        target=tgt.name,
        stage_inputs=stage_inputs,
    )


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
    to (padded inputs, bucket index).
    """
    if not isinstance(bucket_config, BucketModelConfig):
        raise ConfigError("bucket_model_trace(bucket_config=...) must be a neuron_serve.BucketModelConfig.")
    if not example_inputs:
        raise ConfigError("bucket_model_trace needs one example input per bucket; got none.")
    state = bucket_config.shared_state_buffer
    preprocess = bucket_config.shared_state_buffer_preprocessor() if bucket_config.shared_state_buffer_preprocessor else None
    buckets = []
    for index, example in enumerate(example_inputs):
        model, aliases = func(**bucket_config.kwargs_for(index, len(example_inputs)))
        if aliases:
            raise ConfigError(
                "bucket_model_trace: input_output_aliases (device-resident state) is not supported; return an "
                "empty dict and pass state through shared_state_buffer instead."
            )
        args = as_args(example)
        if state is not None:
            shapes = [list(t.shape) for t in args]
            extra = preprocess(shapes, state, torch.tensor(index)) if preprocess else state
            args = (*args, *extra)
        buckets.append(_trace_bucket(model, args, partitioner_config, compiler_workdir, target, compiler_args,
                                     workdirs.bucket_part(index, len(example_inputs))))
    return CompiledModel(buckets, kernel=bucket_config.bucket_kernel(), state=state, state_preprocessor=preprocess,
                         num_inputs=len(as_args(example_inputs[0])))


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
) -> CompiledModel:
    """The declarative form: trace ``model`` once per bucket of ``buckets`` (and per batch size, see trace)."""
    example = as_args(example_inputs)
    inline = check_inline_weights(inline_weights_to_neff)
    grids = [
        _trace_sizes(lambda args, where: _trace_bucket(model, args, partitioner_config, compiler_workdir, target,
                                                       compiler_args, where, inline),
                     buckets.example_inputs(example, i), batch_sizes, workdirs.bucket_part(i, len(buckets.sizes)))
        for i in range(len(buckets.sizes))
    ]
    return CompiledModel([g[-1] for g in grids], smaller=[g[:-1] for g in grids], spec=buckets)
