"""Latency-balanced pipeline stages: the split torch's partitioner does not make.

torch's ``cost_aware`` and ``kl_based`` modes minimise the critical-path latency of one
input through the partitioned graph. For stages that run one after another that latency
is the sum of every stage's, whichever way the nodes are split, so they do not even out
the stages; yet a pipeline's throughput is set by its slowest stage. This splits the graph,
in topological order, into at most ``cores`` contiguous stages that minimise the slowest
stage's measured latency while each stage fits one core's memory (a bisection over that
latency with a greedy packing, each step linear in the nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from ..errors import PartitionError

_COMPUTE = ("call_function", "call_module", "call_method")


@dataclass
class Segment:
    """One stage, shaped like torch's Partition as the stage fuser reads it."""

    logical_device_ids: list[int]
    nodes: set[torch.fx.Node] = field(default_factory=set)
    used_mem_bytes: int = 0
    latency: float = 0.0


def _added_bytes(node: torch.fx.Node, segment: Segment) -> tuple[int, list[torch.fx.Node]]:
    """Bytes ``node`` adds to ``segment`` (its own size, its weights, activations arriving), and its weights."""
    size = node.size_bytes.total_size
    weights = []
    for source in node.all_input_nodes:
        if source in segment.nodes:
            continue
        if source.op == "get_attr":
            weights.append(source)
            size += source.size_bytes.total_size
        else:  # an activation from a placeholder or an earlier stage, held once per stage
            size += source.size_bytes.output_size
    return size, weights


def _pack(nodes: list[torch.fx.Node], latency: dict[str, float], limit: float, budget: int) -> list[Segment]:
    segments = [Segment([0])]
    for node in nodes:
        size, weights = _added_bytes(node, segments[-1])
        seconds = latency.get(node.name, 0.0)
        current = segments[-1]
        if current.nodes and (current.used_mem_bytes + size > budget or current.latency + seconds > limit):
            current = Segment([len(segments)])
            segments.append(current)
            size, weights = _added_bytes(node, current)
        current.nodes.update([node, *weights])
        current.used_mem_bytes += size
        current.latency += seconds
    return segments


def balance_by_latency(gm: torch.fx.GraphModule, latency: dict[str, float], cores: int, budget: int) -> list[Segment]:
    """At most ``cores`` contiguous stages of ``gm`` (nodes sized by torch's ``get_size_of_node``) that
    minimise the slowest stage's summed ``latency`` (seconds per node name) within ``budget`` bytes each."""
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE]
    fewest = _pack(nodes, latency, float("inf"), budget)
    if len(fewest) > cores:
        total = sum(s.used_mem_bytes for s in fewest)
        raise PartitionError(f"Devices have no enough memory for the module (stages one after another need "
                             f"{len(fewest)} cores of {budget} bytes, {total} bytes in all; there are {cores})")
    low = max((latency.get(n.name, 0.0) for n in nodes), default=0.0)
    high = sum(latency.get(n.name, 0.0) for n in nodes)
    best = fewest
    for _ in range(60):  # bisection to well under a microsecond of the optimum
        if high - low <= 1e-9:
            break
        middle = (low + high) / 2
        packed = _pack(nodes, latency, middle, budget)
        if len(packed) <= cores:
            best, high = packed, middle
        else:
            low = middle
    return best
