"""Split a captured graph into accelerator and CPU subgraphs under PartitionerConfig.

Two passes of torch.fx's CapabilityBasedPartitioner: the first fuses the operators
the target supports into the fewest cycle-free accelerator subgraphs, the second
fuses what remains into CPU subgraphs around them. The rules of PartitionerConfig
(support threshold, max subgraph count, min subgraph size) are then checked on the
result and reported with torch-neuronx's messages.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field

import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from ..errors import PartitionError
from ..logs import partitioner_info
from ..model import Partition
from .config import NO_LIMIT, PartitionerConfig

ACCEL_PREFIX = "accel_"
CPU_PREFIX = "cpu_"
CPU = "cpu"

# Why an operator runs on CPU; the HTML report and the partition summary use these.
REASON_UNSUPPORTED = "unsupported"
REASON_FORCED = "ops_to_partition"


@dataclass(frozen=True)
class Placement:
    """What the planner needs from the analysis, as plain data.

    ``ops`` maps every arithmetic node (by name) to its operator ("aten::linear");
    ``supported`` names the nodes the target can run. The support figures, which the
    model support percentage threshold is checked against, are the analysis's
    (``GraphAnalysis`` counts them, leaving out ``additional_ignored_ops``).
    """

    ops: dict[str, str]
    supported: frozenset[str]
    target: str  # "neuron"
    device_label: str  # "Device.NEURON", as torch-neuronx logs it
    supported_count: int
    total: int
    support_fraction: float
    support_percentage: str  # "85.71%"


@dataclass(frozen=True)
class Violation:
    """One PartitionerConfig rule a plan breaks, with torch-neuronx's message."""

    rule: str
    subgraphs: list[int]  # 1-based indices of the subgraphs that break it (none for the threshold)
    message: str


@dataclass
class PartitionPlan:
    gm: torch.fx.GraphModule  # top graph calling one submodule per partition
    partitions: list[Partition]
    cpu_reasons: dict[str, str] = field(default_factory=dict)  # node name -> why it is on CPU

    def describe(self) -> list[dict]:
        return [p.describe() for p in self.partitions]


class _PlacedSupport(OperatorSupportBase):
    """Supports the compute nodes placed on one side, and the weights only they read."""

    def __init__(self, on_side: set[str]) -> None:
        self.on_side = on_side

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op == "get_attr":
            return bool(node.users) and all(self.is_node_supported(submodules, u) for u in node.users)
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:  # follows its producer
            return node.args[0].op == "call_function" and self.is_node_supported(submodules, node.args[0])
        return node.name in self.on_side


def split_shared_attrs(gm: torch.fx.GraphModule) -> None:
    """Give every reader of a weight its own get_attr (see below)."""
    # A weight read by operators on both sides gets one get_attr per reader, so each
    # subgraph owns its weights (kept resident on its device) instead of taking them
    # as per-call inputs.
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or len(node.users) < 2:
            continue
        for user in list(node.users)[1:]:
            with gm.graph.inserting_after(node):
                copy = gm.graph.get_attr(node.target)
            copy.meta = dict(node.meta)
            user.replace_input_with(node, copy)


def _fuse(gm: torch.fx.GraphModule, nodes: set[str], prefix: str) -> torch.fx.GraphModule:
    partitioner = CapabilityBasedPartitioner(gm, _PlacedSupport(nodes), allows_single_node_partition=True)
    return partitioner.fuse_partitions(partitioner.propose_partitions(), prefix=prefix)


def plan_partitions(gm: torch.fx.GraphModule, placement: Placement, config: PartitionerConfig) -> PartitionPlan:
    """Partition ``gm`` (mutated in place) and enforce ``config``'s rules (raising the first broken)."""
    if placement.support_fraction < config.model_support_percentage_threshold:
        raise PartitionError(_threshold_message(placement, config))  # before any work, as torch-neuronx
    cpu_reasons: dict[str, str] = {}
    accel: set[str] = set()
    for node, op in placement.ops.items():
        if node not in placement.supported:
            cpu_reasons[node] = REASON_UNSUPPORTED
        elif op in config.ops_to_partition:
            cpu_reasons[node] = REASON_FORCED
        else:
            accel.add(node)
    split_shared_attrs(gm)
    gm = _fuse(gm, accel, ACCEL_PREFIX)
    gm = _fuse(gm, set(cpu_reasons), CPU_PREFIX)
    partitions = describe_partitions(gm, placement)
    log_plan(partitions)
    broken = rule_violations(placement, partitions, config)
    if broken:
        raise PartitionError(broken[0].message)
    return PartitionPlan(gm, partitions, cpu_reasons)


def describe_partitions(gm: torch.fx.GraphModule, placement: Placement) -> list[Partition]:
    """One Partition per submodule ``gm`` calls, with its device and operator counts."""
    partitions = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = gm.get_submodule(node.target)
        # Fusing copies nodes with their names, so the analysis's names still find their operators.
        counts = Counter(placement.ops[n.name] for n in sub.graph.nodes if n.op == "call_function" and n.name in placement.ops)
        on_accel = node.target.startswith(ACCEL_PREFIX)
        partitions.append(
            Partition(
                index=len(partitions) + 1,
                name=node.target,
                device=placement.target if on_accel else CPU,
                device_label=placement.device_label if on_accel else "Device.CPU",
                op_counts=dict(counts),
            )
        )
    return partitions


def log_plan(partitions: list[Partition]) -> None:
    """torch-neuronx's partitioner log lines."""
    partitioner_info("Num Partitions: %d", len(partitions))
    for p in partitions:
        partitioner_info("Creating Partition #%d for device: %s", p.index, p.device_label)
        partitioner_info("The following operators will be included in this partition:")
        for op, count in p.op_counts.items():
            partitioner_info("%s:%d", op, count)


def _threshold_message(placement: Placement, config: PartitionerConfig) -> str:
    return (
        f"The partitioner has found {placement.support_percentage} of arithmetic operations "
        f"({placement.supported_count} of {placement.total}) supported which is below the specified "
        f"model support percentage threshold of {100 * config.model_support_percentage_threshold:.2f}%."
    )


def rule_violations(placement: Placement, partitions: list[Partition], config: PartitionerConfig) -> list[Violation]:
    """Every rule of ``config`` that ``partitions`` break, in the order torch-neuronx checks them.

    ``trace`` raises the first; the partition report lists them all.
    """
    found = []
    if placement.support_fraction < config.model_support_percentage_threshold:
        found.append(Violation("model_support_percentage_threshold", [], _threshold_message(placement, config)))
    if config.max_subgraph_count != NO_LIMIT and len(partitions) > config.max_subgraph_count:
        found.append(Violation(
            "max_subgraph_count", [p.index for p in partitions],
            f"The partitioner has found {len(partitions)} subgraphs which exceeds the specified "
            f"max subgraph count of {config.max_subgraph_count}.",
        ))
    if config.min_subgraph_size != NO_LIMIT:
        for p in partitions:
            if p.size < config.min_subgraph_size:
                found.append(Violation(
                    "min_subgraph_size", [p.index],
                    f"The partitioner has found a subgraph of size {p.size} (Partition #{p.index} for "
                    f"device: {p.device_label}) which is below the specified min subgraph size of "
                    f"{config.min_subgraph_size}.",
                ))
    return found
