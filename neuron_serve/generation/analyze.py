"""``neuron-serve analyze`` of a task: generate model: the support report of every compiled model.

Each prefill and decode model is captured as it is compiled (the causal LM around its slot
cache, at its bucket's shapes) and analyzed for the model.yaml's target: which operators
the core runs, and which it cannot (with their call sites), which generation refuses.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from ..analyze.capture import CapturedGraph, capture
from ..analyze.placement import GraphAnalysis, analyze_graph
from ..analyze.report import build_report
from ..config import ModelConfig
from ..targets import get_target
from .build import load_lm
from .model import _example, shapes_of
from .settings import GenerationSettings
from .slots import SlotLM


class Form(NamedTuple):
    """One compiled model of a generate model.yaml, captured and analyzed."""

    label: str  # its bucket: prefill_32, decode_4x256
    model: torch.nn.Module
    captured: CapturedGraph
    analysis: GraphAnalysis


def forms(config: ModelConfig, base_dir: str | Path | None = None) -> Iterator[Form]:
    """Every model the model.yaml compiles, in bucket order, each analyzed as it comes (progress on stderr)."""
    lm = load_lm(config, base_dir)
    buckets = (config.generation or GenerationSettings()).to_buckets(lm.config)
    shapes = shapes_of(buckets)
    target = get_target(config.target)
    for index, shape in enumerate(shapes, 1):
        context = shape.context if shape.kind == "decode" else None
        model = SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len, context).eval()
        captured = capture(model, _example(shape))
        analysis = analyze_graph(captured, target)
        print(f"analyzed {shape.label} ({index}/{len(shapes)})", file=sys.stderr, flush=True)
        yield Form(shape.label, model, captured, analysis)


def analyze_generation(config: ModelConfig, base_dir: str | Path | None = None) -> dict:
    """{"prefill_32": report, ..., "decode_8x256": report}: torch-neuronx's analyze format for each compiled model."""
    return {form.label: build_report(form.analysis) for form in forms(config, base_dir)}
