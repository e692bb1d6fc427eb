"""`neuron-serve analyze --html/--report-json`: gather the partition report and write it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..buckets import proposal as bucket_proposal
from ..config.compiler_args import parse_compiler_args
from ..config.schema import ModelConfig
from ..partition.config import PartitionerConfig
from ..analysis.capture import CapturedGraph
from .explain import explain, quiet_planner
from .html import render
from ..analysis.placement import GraphAnalysis
from .profile import profile
from .stages import pipeline_data
from .suggest import suggest


def build(config: ModelConfig, model: torch.nn.Module, captured: CapturedGraph, analysis: GraphAnalysis,
          *, profile_runs: int = 0) -> dict[str, Any]:
    """The report data of a model.yaml: placement, rules, suggestions and, with
    ``profile_runs``, the measured times of that many runs on the example inputs."""
    settings = config.partitioner_config()
    buckets = config.buckets.model_dump(mode="json") if config.buckets else None
    with quiet_planner():
        data = explain(captured, analysis, settings, name=config.name, buckets=buckets)
    effective = settings or PartitionerConfig()
    data["batch_sizes"] = config.compiled_batch_sizes()
    # What the buckets padded of the sizes the model's replicas recorded, and the lists that would pad least.
    data["padding"] = bucket_proposal.from_cache(config, None)
    # The top-level compiler_args, or partitioner.trace_kwargs' (model.yaml refuses both).
    compiler_args = (settings.trace_kwargs.get("compiler_args") if settings else None) \
        or parse_compiler_args(config.compiler_args)
    data["compiler_args"] = compiler_args.describe() if compiler_args else None
    data["suggestions"] = suggest(captured, analysis, effective)
    data["pipeline"] = pipeline_data(config, captured)
    if profile_runs:
        data["profile"] = profile(model, tuple(captured.flat_inputs), effective, target=config.target,
                                  runs=profile_runs)
    return data


def write(data: dict, *, html: str | None = None, json_path: str | None = None) -> list[str]:
    """Write the page and/or the JSON; returns the paths written."""
    written = []
    if html:
        Path(html).write_text(render(data), encoding="utf-8")
        written.append(html)
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    return written
