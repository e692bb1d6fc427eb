"""Measured times of each subgraph and of its CPU-accelerator transfers.

The model is traced (compiled) with the placement the report shows and run on its
example inputs a few times. Accelerator subgraphs are timed in three phases (inputs
to the device, compute, outputs back to CPU), each waiting for the device, so the
phases are separable; CPU subgraphs are timed whole. The end-to-end time is measured
apart, on plain calls, since phase-by-phase waiting slows a call down.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.fx

from ..api import trace
from ..compile.subgraph import CompiledSubgraph
from ..model import graph
from ..partition.config import PartitionerConfig
from ..analysis.capture import as_args
from .explain import quiet_planner, relaxed

DEFAULT_RUNS = 5
_PHASES = ("to_device_s", "compute_s", "to_cpu_s")


def _timed_stages(gm: torch.fx.GraphModule, flat: list) -> dict[str, dict[str, float]]:
    """Run the split graph once with the model's interpreter, timing each submodule's phases."""
    times: dict[str, dict[str, float]] = {}

    def timed(name: str, args: tuple) -> Any:
        sub = gm.get_submodule(name)
        if isinstance(sub, CompiledSubgraph):
            out, times[name] = sub.timed(*args)
        else:
            started = time.perf_counter()
            out = sub(*args)
            times[name] = {"compute_s": time.perf_counter() - started}
        return out

    graph.run(gm, flat, timed)
    return times


def _ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 4)


def profile(model: Callable, example_inputs: Any, config: PartitionerConfig, *, target: str = "neuron",
            runs: int = DEFAULT_RUNS) -> dict:
    """Compile ``model`` under ``config``'s placement and time ``runs`` calls (after one warm-up).

    Returns median milliseconds: ``total_ms`` end to end, and per subgraph (by its
    1-based index) ``compute_ms`` and, on the accelerator, ``to_device_ms`` and
    ``to_cpu_ms`` with the compile time in ``compile_s``.
    """
    with quiet_planner():
        traced = trace(model, as_args(example_inputs), partitioner_config=relaxed(config), target=target)
    gm = traced.first.graph_module
    flat = traced.first.flatten(as_args(example_inputs), {})
    with torch.no_grad():
        traced.first.run_flat(flat)  # warm-up: first calls allocate and load
        totals, samples = [], {p.name: {k: [] for k in _PHASES} for p in traced.partitions}
        for _ in range(runs):
            started = time.perf_counter()
            traced.first.run_flat(flat)
            totals.append(time.perf_counter() - started)
            for name, phases in _timed_stages(gm, flat).items():
                for key, value in phases.items():
                    samples[name][key].append(value)
    subgraphs = []
    for p in traced.partitions:
        entry: dict[str, Any] = {"index": p.index, "device": p.device, "compute_ms": _ms(samples[p.name]["compute_s"])}
        sub = getattr(gm, p.name)
        if isinstance(sub, CompiledSubgraph):
            entry["to_device_ms"] = _ms(samples[p.name]["to_device_s"])
            entry["to_cpu_ms"] = _ms(samples[p.name]["to_cpu_s"])
            entry["compile_s"] = round(sub.compile_seconds, 3)
        subgraphs.append(entry)
    return {"runs": runs, "total_ms": _ms(totals), "subgraphs": subgraphs, "emulated": traced.report["emulated"]}
