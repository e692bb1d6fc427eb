"""Splitting one model over several cores: a pipeline of stages, one stage per core.

The split itself is torch's ``torch.fx.experimental.accelerator_partitioner``: it sizes
every node (weights plus output activation), packs nodes into partitions that fit one
device's memory (``size_based``) or balances estimated latency plus transfer cost
(``cost_aware``, ``kl_based``). This module adds what it lacks: the core's memory as a
property of the target, measured node latencies, refusals that name the largest node and
its size, the stage order the runtime pipelines chunks through, and (``latency``, in
balance.py) stages that even out measured latency.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx
from torch.fx.experimental.accelerator_partitioner import Partitioner
from torch.fx.experimental.partitioner_utils import Device, NodeLatency, PartitionMode
from torch.fx.experimental.partitioner_utils import PartitionerConfig as TorchPartitionerConfig
from torch.fx.passes.graph_manipulation import get_size_of_node
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from ..errors import PartitionError
from ..logs import partitioner_info
from .config import PartitionerConfig
from .balance import balance_by_latency
from .plan import ACCEL_PREFIX, PartitionPlan, Placement, describe_partitions, log_plan, split_shared_attrs

GIB = 1 << 30
# A NeuronCore-v2 (Inferentia2, Trainium1) has 16 GiB of device memory.
NEURON_CORE_MEMORY_BYTES = 16 * GIB
CORE_MEMORY_ENV = "NEURON_SERVE_CORE_MEMORY_BYTES"
# torch's three modes, and "latency": stages that even out measured latency (see balance.py for why
# torch's latency modes do not).
MODES = ("size_based", "cost_aware", "kl_based", "latency")
# Moving activations between emulated cores goes through host memory; a conservative
# rate so that cost_aware/kl_based weigh a cut against the compute it balances.
DEFAULT_TRANSFER_RATE_BYTES_PER_SEC = 2.0 * GIB


def core_memory_bytes(emulated: bool | None = None) -> int:
    """One core's memory: 16 GiB on a NeuronCore-v2; in emulation ``$NEURON_SERVE_CORE_MEMORY_BYTES``
    when set (so a small model can be made "too big" for one core), else the same 16 GiB."""
    if emulated is None:
        from ..targets.pjrt import emulated as _emulated  # noqa: PLC0415

        emulated = _emulated()
    value = os.environ.get(CORE_MEMORY_ENV) if emulated else None
    if value is None:
        return NEURON_CORE_MEMORY_BYTES
    try:
        budget = int(value)
    except ValueError:
        raise PartitionError(f"{CORE_MEMORY_ENV}={value!r} is not a whole number of bytes") from None
    if budget <= 0:
        raise PartitionError(f"{CORE_MEMORY_ENV}={value!r} must be a positive number of bytes")
    return budget


@dataclass
class Stage:
    """One partition of the model: the submodule the runtime runs on ``core``."""

    name: str  # the submodule's attribute on PipelinePlan.module ("submod_0", ...)
    core: int
    memory_bytes: int  # weights plus activations of its nodes, as torch's partitioner counted them
    nodes: list[str]  # the planned graph's compute nodes this stage runs
    bytes_in: int = 0  # activations arriving from the previous stages


@dataclass
class PipelinePlan:
    """The stages in execution order and the module that calls them, one submodule per stage."""

    module: torch.fx.GraphModule
    stages: list[Stage]
    mode: str
    core_memory_bytes: int
    node_latency_sec: dict[str, float] = field(default_factory=dict)

    def stage_latency_sec(self) -> list[float]:
        """Sum of the measured node latencies per stage (empty when none were measured)."""
        if not self.node_latency_sec:
            return []
        return [sum(self.node_latency_sec.get(n, 0.0) for n in s.nodes) for s in self.stages]

    def to_dict(self) -> dict:
        """The plan as JSON data: mode, core memory and per stage its core, memory, nodes and bytes in."""
        return {"mode": self.mode, "core_memory_bytes": self.core_memory_bytes,
                "stages": [{"name": s.name, "core": s.core, "memory_bytes": s.memory_bytes,
                            "bytes_in": s.bytes_in, "nodes": s.nodes} for s in self.stages]}

    def describe(self) -> str:
        """The plan as `neuron-serve analyze` prints it: one line per stage."""
        lines = [f"pipeline ({self.mode}) over {len(self.stages)} core(s), "
                 f"{self.core_memory_bytes} bytes per core:"]
        for s in self.stages:
            lines.append(f"  stage {s.name} on core {s.core}: {s.memory_bytes} bytes, "
                         f"{len(s.nodes)} node(s), {s.bytes_in} bytes in")
        return "\n".join(lines)


class _TimingInterpreter(torch.fx.Interpreter):
    """Runs the graph eagerly, recording each node's wall time per run (the latencies the latency modes use)."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.seconds: dict[str, list[float]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        start = time.perf_counter()
        result = super().run_node(n)
        self.seconds.setdefault(n.name, []).append(time.perf_counter() - start)
        return result


def measure_node_latencies(gm: torch.fx.GraphModule, example_inputs: tuple, repeats: int = 9) -> dict[str, float]:
    """Each node's fastest eager time over ``repeats`` runs, after one warm-up: on a shared host other
    processes only ever add time, so the fastest run is the node's own cost."""
    interp = _TimingInterpreter(gm)
    with torch.no_grad():
        interp.run(*example_inputs)
        interp.seconds.clear()
        for _ in range(repeats):
            interp.run(*example_inputs)
    return {k: min(v) for k, v in interp.seconds.items()}


def plan_pipeline(
    module: torch.nn.Module,
    example_inputs: tuple,
    cores: int,
    mode: str = "size_based",
    memory_bytes: int | None = None,
    transfer_rate_bytes_per_sec: float = DEFAULT_TRANSFER_RATE_BYTES_PER_SEC,
) -> PipelinePlan:
    """Split ``module`` into stages over ``cores`` cores of ``memory_bytes`` each (default: the target's).

    The graph is torch.fx.symbolic_trace's; stages are named ``submod_<i>``, as torch names them.
    Raises PartitionError with torch's messages when the model does not fit.
    """
    try:
        gm = torch.fx.symbolic_trace(module)
    except torch.fx.proxy.TraceError as e:
        raise PartitionError(f"pipeline placement splits the graph torch.fx.symbolic_trace records, and it "
                             f"cannot trace this model: {e}") from e
    return plan_graph(gm, example_inputs, cores, mode, memory_bytes, transfer_rate_bytes_per_sec, prefix="submod_")


def plan_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    cores: int,
    mode: str = "size_based",
    memory_bytes: int | None = None,
    transfer_rate_bytes_per_sec: float = DEFAULT_TRANSFER_RATE_BYTES_PER_SEC,
    prefix: str = "stage_",
) -> PipelinePlan:
    """Split ``gm`` (changed in place) into stages ``<prefix>0``, ``<prefix>1``... as torch's partitioner assigns
    its nodes; each stage owns the weights it reads (a weight read by two stages is copied into both).

    ``example_inputs`` are the graph's placeholders' values (they size the activations).
    """
    if mode not in MODES:
        raise PartitionError(f"placement mode {mode!r} is not one of {', '.join(MODES)}")
    if cores < 1:
        raise PartitionError(f"cores must be at least 1, got {cores}")
    budget = core_memory_bytes() if memory_bytes is None else memory_bytes
    split_shared_attrs(gm)
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    sizes: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if not hasattr(node.meta.get("tensor_meta"), "shape"):
            what = getattr(node.target, "__name__", node.target)
            # torch's partitioner sizes each node as one output tensor and fails on anything else.
            raise PartitionError(f"pipeline placement needs every node to output one tensor (torch's "
                                 f"partitioner sizes nodes that way); {node.name} ({what}) does not")
        node.size_bytes = get_size_of_node(gm, node)
        sizes[node] = node.size_bytes.total_size
    largest = max(sizes, key=sizes.get)
    # torch would find this inside size_based_partition; checking first names the node and its size.
    if sizes[largest] > budget:
        raise PartitionError(f"{largest} is too large to fit any device ({sizes[largest]} bytes; "
                             f"a core has {budget} bytes)")
    total = sum(sizes.values())
    if total > budget * cores:
        raise PartitionError(f"Devices have no enough memory for the module ({total} bytes over {cores} "
                             f"core(s) of {budget} bytes; largest node {largest}: {sizes[largest]} bytes)")
    latencies = measure_node_latencies(gm, tuple(example_inputs)) if mode != "size_based" else {}
    if mode == "latency":
        segments = balance_by_latency(gm, latencies, cores, budget)
        return PipelinePlan(gm, _fuse_stages(gm, segments, prefix), mode, budget, latencies)
    by_node = {n: NodeLatency(0.0, latencies.get(n.name, 0.0)) for n in gm.graph.nodes}
    devices = [Device(f"core{i}", budget, i) for i in range(cores)]
    config = TorchPartitionerConfig(devices, mode=PartitionMode[mode], node_to_latency_mapping=by_node,
                                    transfer_rate_bytes_per_sec=transfer_rate_bytes_per_sec)
    partitioner = Partitioner()
    try:
        partitioner.partition_graph(gm, gm, config)
    except RuntimeError as e:
        raise PartitionError(f"{e} (cores: {cores}, {budget} bytes each)") from e
    return PipelinePlan(gm, _fuse_stages(gm, partitioner.partitions, prefix), mode, budget, latencies)


_COMPUTE = ("call_function", "call_module", "call_method")


def _fuse_stages(gm: torch.fx.GraphModule, partitions: list, prefix: str) -> list[Stage]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # torch's partitions hold placeholders too; a stage takes those as inputs, and owns its get_attrs.
    groups = [sorted((n for n in p.nodes if n.op in _COMPUTE or n.op == "get_attr"), key=order.__getitem__)
              for p in partitions]
    keep = [(p, g) for p, g in zip(partitions, groups) if any(n.op in _COMPUTE for n in g)]
    # In execution order: by each stage's first operator (weights' get_attrs all sit at the graph's top).
    keep.sort(key=lambda pg: min(order[n] for n in pg[1] if n.op in _COMPUTE))
    stages = []
    for index, (partition, nodes) in enumerate(keep):
        inside = set(nodes)
        arriving = {i for n in nodes for i in n.all_input_nodes if i not in inside and i.op != "get_attr"}
        bytes_in = sum(_tensor_bytes(i.meta.get("tensor_meta")) for i in arriving)
        stages.append(Stage(f"{prefix}{index}", partition.logical_device_ids[0], partition.used_mem_bytes,
                            [n.name for n in nodes if n.op in _COMPUTE], bytes_in))
    fuse_by_partitions(gm, [dict.fromkeys(g) for _, g in keep], prefix=prefix)
    return stages


def _tensor_bytes(meta) -> int:
    if meta is None or not hasattr(meta, "shape"):
        return 0
    return int(torch.Size(meta.shape).numel()) * torch.empty((), dtype=meta.dtype).element_size()


def pipeline_partitions(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], placement: Placement,
                        config: PartitionerConfig, cores: int, mode: str) -> tuple[PartitionPlan, PipelinePlan]:
    """A captured graph as pipeline stages ``accel_0``, ``accel_1``... that ``trace`` compiles like any
    accelerator partition, each Partition carrying its stage's core, memory and incoming bytes.

    Every operator must run on the accelerator: a stage is one compiled executable on one core.
    """
    on_cpu = [(node, op, "unsupported") for node, op in placement.ops.items() if node not in placement.supported]
    on_cpu += [(node, op, "listed in ops_to_partition") for node, op in placement.ops.items()
               if node in placement.supported and op in config.ops_to_partition]
    if on_cpu:
        node, op, why = on_cpu[0]
        raise PartitionError(f"placement mode pipeline runs every operator on the accelerator, but {len(on_cpu)} "
                             f"would run on CPU, e.g. {op} ({node}, {why}); use placement mode replicate for a "
                             f"model with CPU partitions")
    plan = plan_graph(gm, flat_inputs, cores, mode, prefix=ACCEL_PREFIX)
    partitions = describe_partitions(gm, placement)
    by_name = {s.name: s for s in plan.stages}
    for p in partitions:
        stage = by_name[p.name]
        p.core, p.memory_bytes, p.bytes_in = stage.core, stage.memory_bytes, stage.bytes_in
    log_plan(partitions)
    partitioner_info("Pipeline (%s): %s", mode, ", ".join(f"{s.name} on core {s.core}" for s in plan.stages))
    return PartitionPlan(gm, partitions), plan
