"""``neuron-serve analyze`` of a task: generate model: the support report of every compiled model.

Each prefill and decode model is captured as it is compiled (the causal LM around its slot
cache, at its bucket's shapes) and analyzed for the model.yaml's target: which operators
the core runs, and which it cannot (with their call sites), which generation refuses.
A speculative draft model's are reported after the model's, labelled ``draft_``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from ..analysis.capture import CapturedGraph, capture
from ..analysis.placement import GraphAnalysis, analyze_graph
from ..config.schema import ModelConfig, _under
from ..config.generation import GenerationSettings, refuse_lora
from ..targets import get_target
from . import tensor_parallel
from .build import DRAFT_FIELD, _pretrained, load_lm
from .shapes import example_inputs, shapes_of, slot_module
from .slots import kv_cache_bytes


class Form(NamedTuple):
    """One compiled model of a generate model.yaml, captured and analyzed."""

    label: str  # its bucket: prefill_32, decode_4x256
    model: torch.nn.Module
    captured: CapturedGraph
    analysis: GraphAnalysis
    split: dict | None = None  # with generation.tensor_parallel_size above 1: see :func:`split_of`


def split_of(lm: torch.nn.Module, buckets, size: int) -> dict | None:
    """How ``size`` cores split ``lm`` (each split weight's spec, the cache's) and what one core holds, or None at 1."""
    if size == 1:
        return None
    tensor_parallel.check(lm.config, size)
    plan = tensor_parallel.plan(lm, size)
    dtype_bytes = next(lm.parameters()).element_size()
    cache = kv_cache_bytes(lm.config, buckets.max_num_seqs, buckets.max_model_len, dtype_bytes)
    return {**plan.describe(),
            "bytes_per_core": {"weights": tensor_parallel.bytes_per_core(lm, plan),
                               "kv_cache": cache if plan.state is None else cache // size},
            "bytes_whole": {"weights": tensor_parallel.bytes_per_core(lm, None), "kv_cache": cache}}


def forms(config: ModelConfig, base_dir: str | Path | None = None) -> Iterator[Form]:
    """Every model the model.yaml compiles, in bucket order, each analyzed as it comes (progress on stderr)."""
    settings = config.generation or GenerationSettings()
    refuse_lora(settings, "neuron-serve analyze")
    lm = load_lm(config, base_dir)
    buckets = settings.to_buckets(lm.config)
    split = split_of(lm, buckets, settings.tensor_parallel_size)
    models = [(lm, buckets, "", split)]
    spec = settings.speculative_config
    if spec is not None and spec.method == "draft_model":
        draft = _pretrained(_under(base_dir, spec.model), DRAFT_FIELD)
        models.append((draft, buckets.for_draft(), "draft_", split_of(draft, buckets, settings.tensor_parallel_size)))
    every = [(model, buckets, prefix + shape.label, shape, split)
             for model, buckets, prefix, split in models for shape in shapes_of(buckets)]
    target = get_target(config.target)
    for index, (causal_lm, buckets, label, shape, split) in enumerate(every, 1):
        model = slot_module(causal_lm, buckets, shape)
        captured = capture(model, example_inputs(shape))
        analysis = analyze_graph(captured, target)
        print(f"analyzed {label} ({index}/{len(every)})", file=sys.stderr, flush=True)
        yield Form(label, model, captured, analysis, split)
