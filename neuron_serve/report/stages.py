"""The pipeline section of the partition report: stages on their cores, each stage's memory
against the core's, and the activation bytes crossing from one stage's core to the next.

The plan is the one ``trace`` compiles (the same captured graph, the same partitioner
call), so the report shows what a deployment of the model.yaml runs.
"""

from __future__ import annotations

import copy
from html import escape

from ..analysis.capture import CapturedGraph
from ..config.schema import ModelConfig
from ..errors import PartitionError
from ..partition.pipeline import plan_graph
from ..partition.plan import ACCEL_PREFIX

STAGE_W = 190
STAGE_H = 78
ARROW_W = 120
MARGIN = 16
BAR_H = 10


def pipeline_data(config: ModelConfig, captured: CapturedGraph) -> dict | None:
    """The model.yaml's pipeline plan as report data: stages, cores of every copy, memory, bytes
    crossing; ``{"error": ...}`` when the model fits no pipeline; None when the model is replicated."""
    placed = config.model_placement()
    if not placed.pipelined:
        return None
    try:
        plan = plan_graph(copy.deepcopy(captured.gm), captured.flat_inputs, placed.cores_per_pipeline,
                          placed.balance_mode, prefix=ACCEL_PREFIX)
    except PartitionError as exc:
        return {"error": str(exc), "balance": placed.balance_mode, "cores_per_pipeline": placed.cores_per_pipeline}
    span = 1 + max(s.core for s in plan.stages)
    copies = config.cores_per_replica // span if placed.saturates_host else 1
    latency = plan.stage_latency_sec()
    stages = []
    for i, s in enumerate(plan.stages):
        stages.append({"name": s.name, "core": s.core, "cores": [s.core + c * span for c in range(copies)],
                       "memory_bytes": s.memory_bytes, "bytes_in": s.bytes_in, "nodes": s.nodes,
                       "estimated_ms": latency[i] * 1000 if latency else None})
    return {"balance": plan.mode, "core_memory_bytes": plan.core_memory_bytes, "cores_per_pipeline":
            placed.cores_per_pipeline, "span": span, "copies": copies, "stages": stages}


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def stages_svg(pipe: dict) -> str:
    """One box per stage, left to right, with its cores and a memory bar; arrows carry the bytes crossing."""
    stages = pipe["stages"]
    width = 2 * MARGIN + len(stages) * STAGE_W + (len(stages) - 1) * ARROW_W
    height = 2 * MARGIN + STAGE_H
    parts = []
    for i, s in enumerate(stages):
        x = MARGIN + i * (STAGE_W + ARROW_W)
        used = min(1.0, s["memory_bytes"] / pipe["core_memory_bytes"])
        cores = ", ".join(str(c) for c in s["cores"])
        parts.append(
            f'<g class="stage" data-stage="{escape(s["name"])}" data-cores="{cores}" '
            f'data-memory-bytes="{s["memory_bytes"]}">'
            f'<rect class="box dev-accel" x="{x}" y="{MARGIN}" width="{STAGE_W}" height="{STAGE_H}"/>'
            f'<text class="boxlabel" x="{x + 10}" y="{MARGIN + 18}">{escape(s["name"])} · core{"s" * (len(s["cores"]) > 1)} '
            f'{cores}</text>'
            f'<text x="{x + 10}" y="{MARGIN + 36}">{_kib(s["memory_bytes"])} of {_kib(pipe["core_memory_bytes"])}</text>'
            f'<rect x="{x + 10}" y="{MARGIN + 44}" width="{STAGE_W - 20}" height="{BAR_H}" fill="#e8eaed"/>'
            f'<rect x="{x + 10}" y="{MARGIN + 44}" width="{(STAGE_W - 20) * used:.1f}" height="{BAR_H}" fill="#2f6f3e"/>'
            f'<text x="{x + 10}" y="{MARGIN + 70}">{len(s["nodes"])} operators</text></g>'
        )
        if i:
            x0, y = x - ARROW_W, MARGIN + STAGE_H / 2
            parts.append(f'<g class="crossing" data-bytes="{s["bytes_in"]}"><path class="edge transfer" '
                         f'd="M{x0 + 4},{y} L{x - 4},{y}" marker-end="url(#arrow)"/>'
                         f'<text x="{x0 + ARROW_W / 2}" y="{y - 8}" text-anchor="middle">{_kib(s["bytes_in"])}</text></g>')
    marker = ('<defs><marker id="arrow-stage" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
              'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>')
    body = "".join(parts).replace("url(#arrow)", "url(#arrow-stage)")
    return (f'<svg id="pipeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">{marker}{body}</svg>')


def section(data: dict) -> str:
    """The report's "Pipeline stages" section (empty when the model is replicated)."""
    pipe = data.get("pipeline")
    if not pipe:
        return ""
    if "error" in pipe:
        body = (f'<div class="violation">placement mode pipeline over {pipe["cores_per_pipeline"]} core(s) '
                f'({escape(pipe["balance"])}): {escape(pipe["error"])}</div>')
    else:
        body = (f"<p>Split by <code>{escape(pipe['balance'])}</code> into {len(pipe['stages'])} stage(s) over "
                f"cores of {_kib(pipe['core_memory_bytes'])}; {pipe['copies']} cop{'ies' if pipe['copies'] != 1 else 'y'}"
                f" of the pipeline on the replica's cores. Arrows: activation bytes crossing to the next stage's core "
                f"per call at the example inputs' batch.</p><div class=graph>{stages_svg(pipe)}</div>")
    return f"<section><h2>Pipeline stages</h2>{body}</section>"
