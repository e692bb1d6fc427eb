"""``neuron-serve analyze`` of a task: generate model: the support report of its prefill and decode forms.

Both forms are captured as compiled (the causal LM around its slot cache, at the smallest
bucket of each) and analyzed for the model.yaml's target: which operators the core runs,
and which it cannot (with their call sites), which generation refuses.
"""

from __future__ import annotations

from pathlib import Path

from ..analyze.capture import capture
from ..analyze.placement import analyze_graph
from ..analyze.report import build_report
from ..config import ModelConfig
from ..targets import get_target
from .build import load_lm
from .model import _example, shapes_of
from .settings import GenerationSettings
from .slots import SlotLM


def analyze_generation(config: ModelConfig, base_dir: str | Path | None = None) -> dict:
    """{"prefill_32": report, "decode_1x128": report}: torch-neuronx's analyze format for each form."""
    lm = load_lm(config, base_dir)
    buckets = (config.generation or GenerationSettings()).to_buckets(lm.config)
    shapes = shapes_of(buckets)
    target = get_target(config.target)
    reports = {}
    for shape in (shapes[0], shapes[len(buckets.prefill)]):  # the smallest prefill, the smallest decode
        context = shape.context if shape.kind == "decode" else None
        model = SlotLM(lm, buckets.max_num_seqs, buckets.max_model_len, context).eval()
        reports[shape.label] = build_report(analyze_graph(capture(model, _example(shape)), target))
    return reports
