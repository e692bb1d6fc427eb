"""``neuron-serve analyze`` of a task: generate model: the support report of every compiled model.

Each prefill and decode model is captured as it is compiled (the causal LM around its slot
cache, at its bucket's shapes) and analyzed for the model.yaml's target: which operators
the core runs, and which it cannot (with their call sites), which generation refuses.
A speculative draft model's are reported after the model's, labelled ``draft_``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from ...analysis.capture import CapturedGraph, capture
from ...compile import records as compile_records
from ...analysis.placement import GraphAnalysis, analyze_graph
from ...config.schema import ModelConfig
from ...config.generation import GenerationSettings
from ...targets import get_target
from ...targets.pjrt import emulated
from ..runner import tensor_parallel
from .loading import load_draft, load_lm
from ..runner.attention import grouped_for_compile
from ..runner.shapes import example_inputs, shapes_of, slot_module
from ..precision import dtypes as precision
from ..runner.slots import cache_element_bytes, compute_dtype, kv_cache_bytes


class Form(NamedTuple):
    """One compiled model of a generate model.yaml, captured and analyzed."""

    label: str  # its bucket: prefill_32, decode_4x256
    model: torch.nn.Module
    captured: CapturedGraph
    analysis: GraphAnalysis
    split: dict | None = None  # with generation.tensor_parallel_size above 1: see :func:`split_of`
    lora: dict | None = None  # with generation.lora: see :func:`lora_of`
    memory: dict | None = None  # what one core holds and in which dtypes: see :func:`memory_of`


def split_of(lm: torch.nn.Module, buckets, size: int) -> dict | None:
    """How ``size`` cores split ``lm`` (each split weight's spec, the cache's) and what one core holds, or None at 1."""
    if size == 1:
        return None
    tensor_parallel.check(lm.config, size)
    plan = tensor_parallel.plan(lm, size)
    dtype_bytes = cache_element_bytes(lm)
    cache = kv_cache_bytes(lm.config, buckets.max_num_seqs, buckets.max_model_len, dtype_bytes)
    return {**plan.describe(),
            "bytes_per_core": {"weights": tensor_parallel.bytes_per_core(lm, plan),
                               "kv_cache": cache if plan.state is None else cache // size},
            "bytes_whole": {"weights": tensor_parallel.bytes_per_core(lm, None), "kv_cache": cache}}


def memory_of(lm: torch.nn.Module, buckets, size: int) -> dict:
    """What one core of the model's engine holds (its share at tensor_parallel_size ``size``) and in which precision,
    and how many cache slots of max_model_len positions would fit beside its weights."""
    from .build import slots_that_fit  # noqa: PLC0415 - build imports the compiler; analyze runs it anyway

    plan = tensor_parallel.plan(lm, size) if size > 1 else None
    cache = kv_cache_bytes(lm.config, buckets.max_num_seqs, buckets.max_model_len, cache_element_bytes(lm))
    split = size > 1 and not tensor_parallel.kv_replicated(lm.config, size)
    per_core = {"weights": tensor_parallel.bytes_per_core(lm, plan), "kv_cache": cache // size if split else cache}
    return {**precision.describe(lm),
            "bytes_per_core": per_core,
            "max_num_seqs": buckets.max_num_seqs,
            "slots_that_fit": slots_that_fit(lm, buckets, tensor_parallel_size=size),
            # The engine process's host memory, beside the cores': the weights' copy of record, and (emulated,
            # where a core's memory is the host's) each core's weights and cache, held once whatever the number of
            # compiled models; each compiled model's own bytes are added per model (host_bytes.compiled_model).
            "host_bytes": {"weights": tensor_parallel.bytes_per_core(lm, None),
                           "weights_on_cores": per_core["weights"] * size, "kv_cache": per_core["kv_cache"] * size,
                           "cores_in_host_memory": emulated()}}


def with_compile_record(memory: dict, record: dict | None) -> dict:
    """``memory`` with what compiling this model took when this machine last compiled it (compile/records.py):
    the bytes it kept (its code and bookkeeping) and its peak; None for each when it has not compiled here."""
    record = record or {}
    return {**memory, "host_bytes": {**memory["host_bytes"], "compiled_model": record.get("kept"),
                                     "compile_peak": record.get("peak"), "compile_seconds": record.get("seconds")}}


def lora_of(lm: torch.nn.Module, settings: GenerationSettings) -> tuple[Any, dict] | None:
    """With generation.lora: the buffers' layout every compiled model takes, and what the report says of them
    (each core holds them whole, under tensor parallelism too)."""
    if settings.lora is None:
        return None
    from ..lora.adapters import AdapterPolicy  # noqa: PLC0415

    layout = AdapterPolicy.of(lm, settings.lora, settings.tensor_parallel_size).layout
    dtype_bytes = compute_dtype(lm).itemsize
    return layout, {"max_loras": layout.max_loras, "max_lora_rank": layout.rank,
                    "projections": sorted({t.name for t in layout.targets}),
                    "bytes_per_core": layout.bytes(dtype_bytes)}


def forms(config: ModelConfig, base_dir: str | Path | None = None) -> Iterator[Form]:
    """Every model the model.yaml compiles, in bucket order, each analyzed as it comes (progress on stderr)."""
    settings = config.generation or GenerationSettings()
    lm = load_lm(config, base_dir)
    buckets = settings.to_buckets(lm.config)
    split = split_of(lm, buckets, settings.tensor_parallel_size)
    lora = lora_of(lm, settings)
    memory = memory_of(lm, buckets, settings.tensor_parallel_size)
    models = [(lm, buckets, "", split, lora)]
    spec = settings.speculative_config
    if spec is not None and spec.method == "draft_model":  # a draft proposes without adapters
        draft = load_draft(config, base_dir)
        models.append((draft, buckets.for_draft(), "draft_", split_of(draft, buckets, settings.tensor_parallel_size),
                       None))
    every = [(model, buckets, prefix + shape.label, shape, split, lora)
             for model, buckets, prefix, split, lora in models for shape in shapes_of(buckets)]
    target = get_target(config.target)
    records = {**compile_records.remembered(config.name),
               **{f"draft_{k}": v for k, v in compile_records.remembered(f"{config.name} draft").items()}}
    for index, (causal_lm, buckets, label, shape, split, lora) in enumerate(every, 1):
        model = slot_module(causal_lm, buckets, shape, lora=lora[0] if lora else None)
        with grouped_for_compile(causal_lm):  # the attention each model is compiled with (a mixed call needs it)
            captured = capture(model, example_inputs(shape, lora=lora is not None))
        analysis = analyze_graph(captured, target)
        print(f"analyzed {label} ({index}/{len(every)})", file=sys.stderr, flush=True)
        held = memory if causal_lm is lm else memory_of(causal_lm, buckets, settings.tensor_parallel_size)
        yield Form(label, model, captured, analysis, split, lora[1] if lora else None,
                   with_compile_record(held, records.get(label)))
