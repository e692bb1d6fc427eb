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
from ..partition.config import PartitionerConfig
from .capture import as_args
from .explain import quiet_planner, relaxed

DEFAULT_RUNS = 5
_PHASES = ("to_device_s", "compute_s", "to_cpu_s")


class _TimedInterpreter(torch.fx.Interpreter):
    """Runs the split graph, recording each submodule's phases."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.times: dict[str, dict[str, float]] = {}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if isinstance(sub, CompiledSubgraph):
            out, phases = sub.timed(*args)
        else:
            started = time.perf_counter()
            out = super().call_module(target, args, kwargs)
            phases = {"compute_s": time.perf_counter() - started}
        self.times[target] = phases
        return out


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
    gm = traced.graph_module
    flat = traced.flatten(as_args(example_inputs), {})
    with torch.no_grad():
        gm(*flat)  # warm-up: first calls allocate and load
        totals, samples = [], {p.name: {k: [] for k in _PHASES} for p in traced.partitions}
        for _ in range(runs):
            started = time.perf_counter()
            gm(*flat)
            totals.append(time.perf_counter() - started)
            interpreter = _TimedInterpreter(gm)
            interpreter.run(*flat)
            for name, phases in interpreter.times.items():
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
